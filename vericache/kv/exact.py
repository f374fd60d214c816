"""The exact KV of committed tokens: the one representation every hand-over of it uses.

A verification (or a prefill) computes the full-KV keys and values of the tokens it commits. They
go on from there in one form, `ExactKV`, wherever they are needed:
- into the draft cache, in place of what it drafted (the engine in-process; a drafter, which
  receives them across the link with its next draft call);
- into a request's host copy of its full KV after each verification (long-context mode);
- into a verifier session's store of the tokens after its prefix, while its prefix is evicted.
`KVCache.append_exact` is the one append that takes them in.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from vericache.errors import CacheStateError

if TYPE_CHECKING:
    from vericache.kv.cache import KVCache


@dataclass(frozen=True)
class ExactKV:
    """Tokens [start, start + n) of one sequence: per layer, rotated keys and values [n, Hkv, D]."""

    start: int
    keys: tuple[torch.Tensor, ...]  # per layer [n, Hkv, D]
    values: tuple[torch.Tensor, ...]  # per layer [n, Hkv, D]
    # [2, layers, n, Hkv, D] whose views `keys` and `values` are, when they were copied out of a
    # cache: it crosses processes as it is.
    packed: torch.Tensor | None = field(default=None, compare=False, repr=False)

    @classmethod
    def of(cls, cache: KVCache, start: int, end: int, copy: bool = True) -> ExactKV:
        """Tokens [start, end) of an uncompressed cache (slot i holds token i). `copy=False`
        gives views of the cache's buffers, valid until the cache next changes."""
        if not cache.is_full or not 0 <= start <= end <= cache.num_tokens:
            raise CacheStateError(
                f"exact KV of tokens [{start}, {end}) needs an uncompressed cache holding them "
                f"(this one holds {cache.num_tokens}{'' if cache.is_full else ', compressed'})"
            )
        slots = [layer.slots(start, end) for layer in cache.layers]  # per layer [n, Hkv, D] twice
        if not copy:
            return cls(start, tuple(k for k, _ in slots), tuple(v for _, v in slots))
        first_keys, _ = slots[0]
        packed = first_keys.new_empty((2, len(cache.layers), *first_keys.shape))
        for index, (layer_keys, layer_values) in enumerate(slots):
            packed[0, index].copy_(layer_keys)
            packed[1, index].copy_(layer_values)
        return cls(start, tuple(packed[0].unbind(0)), tuple(packed[1].unbind(0)), packed)

    @property
    def num_tokens(self) -> int:
        return self.keys[0].shape[0] if self.keys else 0

    def to_host(self) -> ExactKV:
        """These tokens in host memory: themselves on a CPU, a pinned copy from a GPU (read back
        at the host link's full speed)."""
        if self.keys and self.keys[0].device.type == "cpu":
            return self
        packed = self.packed
        if packed is None:
            packed = torch.stack([torch.stack(self.keys), torch.stack(self.values)])
        host = packed.to("cpu").pin_memory() if packed.is_cuda else packed.to("cpu")
        return ExactKV(self.start, tuple(host[0].unbind(0)), tuple(host[1].unbind(0)), host)

    def head(self, num_tokens: int) -> ExactKV:
        """Its first `num_tokens` tokens, as views of it."""
        if not 0 <= num_tokens <= self.num_tokens:
            raise CacheStateError(f"exact KV of {self.num_tokens} tokens has no first {num_tokens}")
        packed = self.packed[:, :, :num_tokens] if self.packed is not None else None
        keys = tuple(k[:num_tokens] for k in self.keys)
        return ExactKV(self.start, keys, tuple(v[:num_tokens] for v in self.values), packed)

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    def __reduce__(self):
        # Across processes (Ray), one array instead of two tensors per layer, as raw bytes in a
        # numpy array, which pickle hands over out of band (zero-copy into Ray's object store):
        # 100 tokens of the embedded model serialized in 11.7 ms as 60 tensors, 4.1 ms as one
        # tensor (torch pickles a tensor's storage through torch.save) and 0.8 ms as this array.
        if not self.keys:
            return ExactKV, (self.start, (), ())
        packed = self.packed
        if packed is None:
            packed = torch.stack([torch.stack(self.keys), torch.stack(self.values)])
        raw = packed.detach().cpu().contiguous().view(torch.uint8).numpy()
        return _unpacked, (self.start, raw, packed.dtype)  # raw: [2, layers, n, Hkv, D * size]

    def positions(self, device: torch.device | str) -> torch.Tensor:
        """[n] int32 original positions of these tokens."""
        return torch.arange(self.start, self.end, dtype=torch.int32, device=device)


def _unpacked(start: int, raw: np.ndarray, dtype: torch.dtype) -> ExactKV:
    # Ray maps an out-of-band array read-only; a tensor over it must not be written to.
    writable = raw if raw.flags.writeable else raw.copy()
    # numpy gives an empty array zero strides, which a dtype view refuses.
    packed = torch.from_numpy(writable) if raw.size else torch.empty(raw.shape, dtype=torch.uint8)
    packed = packed.view(dtype)  # [2, layers, n, Hkv, D]
    return ExactKV(start, tuple(packed[0].unbind(0)), tuple(packed[1].unbind(0)), packed)
