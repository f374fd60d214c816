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

from dataclasses import dataclass
from typing import TYPE_CHECKING

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

    @classmethod
    def of(cls, cache: KVCache, start: int, end: int, copy: bool = True) -> ExactKV:
        """Tokens [start, end) of an uncompressed cache (slot i holds token i). `copy=False`
        gives views of the cache's buffers, valid until the cache next changes."""
        if not cache.is_full or not 0 <= start <= end <= cache.num_tokens:
            raise CacheStateError(
                f"exact KV of tokens [{start}, {end}) needs an uncompressed cache holding them "
                f"(this one holds {cache.num_tokens}{'' if cache.is_full else ', compressed'})"
            )
        keys, values = [], []
        for layer in cache.layers:
            layer_keys, layer_values = layer.keys_values()  # [T, Hkv, D]
            keys.append(layer_keys[start:end].clone() if copy else layer_keys[start:end])
            values.append(layer_values[start:end].clone() if copy else layer_values[start:end])
        return cls(start, tuple(keys), tuple(values))

    @property
    def num_tokens(self) -> int:
        return self.keys[0].shape[0] if self.keys else 0

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    def __reduce__(self):
        # Across processes (Ray), one tensor instead of two per layer: pickling 60 small tensors
        # of a 30-layer model took 2.3 ms and unpickling them 3.5, the packed one 0.07 each.
        if not self.keys:
            return ExactKV, (self.start, (), ())
        packed = torch.stack([torch.stack(self.keys), torch.stack(self.values)])
        return _unpacked, (self.start, packed)  # packed: [2, layers, n, Hkv, D]

    def positions(self, device: torch.device | str) -> torch.Tensor:
        """[n] int32 original positions of these tokens."""
        return torch.arange(self.start, self.end, dtype=torch.int32, device=device)


def _unpacked(start: int, packed: torch.Tensor) -> ExactKV:
    return ExactKV(start, tuple(packed[0].unbind(0)), tuple(packed[1].unbind(0)))
