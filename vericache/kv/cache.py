"""KV caches as explicit objects owned by the engine.

Layout, fixed once for every cache: per layer, keys and values are handed out as [slots, kv_heads,
head_dim] (token-major, as vLLM and LMCache chunks index them) and each slot records the original
position of the token it holds, per head: [slots, kv_heads]. A dense layer stores them head-major,
[kv_heads, capacity, head_dim], and hands out transposed views: decode attention streams each head's
keys from one contiguous block instead of striding over the other heads'. Keys are stored after
RoPE, so a compressed cache that dropped tokens keeps the rotation of the tokens it kept, and a new
token is rotated at its true position (the number of tokens the sequence has seen), not at its
slot index.

A full cache and a compressed (draft) cache are two instances of `KVCache`; a compressor decides
what their layers hold. Tokens appended during a draft are tentative: `truncate` rolls them back,
and compressors only evict or quantize tokens after they are committed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from vericache.errors import CacheStateError
from vericache.kv.slots import aligned
from vericache.kv.state import CacheState, LayerState

if TYPE_CHECKING:
    from vericache.kv.exact import ExactKV
    from vericache.kv.pool import BufferPool


def write_head_major(target: torch.Tensor, start: int, source: torch.Tensor) -> None:
    """Writes source [n, H, D] into slots start..start+n of a head-major target [H, capacity, D],
    on the same device or across devices."""
    end = start + source.shape[0]
    if source.device != target.device and source[:, 0].is_contiguous():
        # Head by head (a head-major buffer on the other device): each head is one contiguous
        # block on both sides, where a strided copy would stage through unpinned memory.
        for head in range(source.shape[1]):
            target[head, start:end].copy_(source[:, head])
    else:
        target[:, start:end] = source.to(target.device).transpose(0, 1)


def _empty(shape: tuple[int, ...], dtype, device) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=device)


class LayerKV(Protocol):
    """One layer of one sequence's cache."""

    num_slots: int

    def append(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        """keys, values: [n, H, D] (rotated); positions: [n] original positions."""

    def keys_values(self, pad_to: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """Full-precision [T', H, D] keys and values, T' = num_slots rounded up to `pad_to`.
        Slots past num_slots hold finite values that attention must mask."""

    def positions(self) -> torch.Tensor:
        """[num_slots, H] original positions of the resident slots."""

    def newest_positions(self, num_slots: int) -> torch.Tensor:
        """[min(num_slots, self.num_slots), H] positions of the newest slots: what a rollback
        checks, without assembling every slot's (a shared prefix's, a quantized layer's)."""

    def drop_last(self, num_slots: int) -> None:
        """Remove the newest `num_slots` slots (uncommitted tokens)."""

    @property
    def nbytes(self) -> int:
        """Bytes of resident keys, values and quantization metadata (positions excluded)."""

    def clone(self, capacity: int = 0, pool: BufferPool | None = None) -> LayerKV:
        """An independent copy with room for `capacity` slots (full-precision buffers from
        `pool` where it has some)."""

    def to_state(self) -> LayerState:
        """The resident data as named tensors (see state.py)."""


class DenseLayerKV:
    """Full-precision slots: every token (full cache) or the kept tokens (token dropping)."""

    is_dense = True  # full-precision slots in order (a quantized layer has none)

    def __init__(
        self,
        num_kv_heads: int,
        head_dim: int,
        dtype,
        device,
        capacity: int = 0,
        pool: BufferPool | None = None,
    ):
        capacity = aligned(max(capacity, 1))
        # Left uninitialised: filling whole buffers dominated opening a session on a long prefix.
        # Slots below `_num_finite` hold finite values (written, or zeroed for a padded view);
        # num_slots <= _num_finite <= capacity.
        empty = pool.empty if pool is not None else _empty
        self._keys = empty((num_kv_heads, capacity, head_dim), dtype, device)
        self._values = empty((num_kv_heads, capacity, head_dim), dtype, device)
        self._positions = empty((capacity, num_kv_heads), torch.int32, device)
        self.num_slots = 0
        self._num_finite = 0

    @classmethod
    def from_tensors(cls, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor):
        """keys, values: [T, H, D]; positions: [T, H] (or [T], the same for every head)."""
        layer = cls(keys.shape[1], keys.shape[2], keys.dtype, keys.device, capacity=keys.shape[0])
        layer._write(keys, values, positions)
        return layer

    @classmethod
    def over(
        cls, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, num_slots: int
    ) -> DenseLayerKV:
        """A layer over existing head-major buffers, holding their first num_slots slots: no
        copy, and appends write into them. keys, values: [H, capacity, D]; positions:
        [capacity, H]; every slot must hold finite values (attention reads padding past the
        last slot)."""
        layer = cls.__new__(cls)
        layer._keys, layer._values, layer._positions = keys, values, positions
        layer.num_slots = num_slots
        layer._num_finite = keys.shape[1]
        return layer

    @property
    def capacity(self) -> int:
        return self._keys.shape[1]

    @property
    def dtype(self) -> torch.dtype:
        return self._keys.dtype

    def buffers(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The head-major key and value buffers [H, capacity, D] and the position buffer
        [capacity, H] int32, as they are (a static step's table points at them)."""
        return self._keys, self._values, self._positions

    def _ensure_capacity(self, num_slots: int, to_fit: bool = False) -> None:
        """Room for num_slots; appends grow geometrically, `to_fit` grows to just what is asked."""
        if num_slots <= self.capacity:
            return
        new_capacity = aligned(num_slots if to_fit else max(num_slots, 2 * self.capacity))
        n = self.num_slots
        num_kv_heads, _, head_dim = self._keys.shape
        for name in ("_keys", "_values"):
            old = getattr(self, name)
            new = old.new_empty((num_kv_heads, new_capacity, head_dim))
            new[:, :n] = old[:, :n]
            setattr(self, name, new)
        positions = self._positions.new_empty((new_capacity, num_kv_heads))
        positions[:n] = self._positions[:n]
        self._positions = positions
        self._num_finite = n

    def reserve(self, num_new: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """Counts num_new slots past the resident ones as resident, for the caller to fill at once
        (the runner's batched store). Returns the key and value buffers [H, capacity, D], the
        position buffer [capacity, H] int32 and the first new slot."""
        start = self.num_slots
        self._ensure_capacity(start + num_new)
        self.num_slots = start + num_new
        self._num_finite = max(self._num_finite, self.num_slots)
        return self._keys, self._values, self._positions, start

    def _write(self, keys, values, positions) -> None:
        """keys, values: [n, H, D], on any device."""
        key_buffer, value_buffer, position_buffer, start = self.reserve(keys.shape[0])
        write_head_major(key_buffer, start, keys)
        write_head_major(value_buffer, start, values)
        positions = positions.to(position_buffer.device)
        # [n] positions (the same for every head) broadcast over heads.
        position_buffer[start : self.num_slots] = (
            positions if positions.dim() == 2 else positions.unsqueeze(1)
        )

    def append(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        self._write(keys, values, positions)

    def keys_values(self, pad_to: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """[T', H, D] views of the head-major buffers (strided, not contiguous)."""
        end = aligned(self.num_slots, pad_to)
        self._ensure_capacity(end, to_fit=True)
        if end > self._num_finite:
            # Attention gives the padding zero weight, but 0 * NaN is NaN: zero the tail it reads.
            self._keys[:, self._num_finite : end] = 0
            self._values[:, self._num_finite : end] = 0
            self._num_finite = end
        return self._keys[:, :end].transpose(0, 1), self._values[:, :end].transpose(0, 1)

    def positions(self) -> torch.Tensor:
        return self._positions[: self.num_slots]

    def newest_positions(self, num_slots: int) -> torch.Tensor:
        return self._positions[max(self.num_slots - num_slots, 0) : self.num_slots]

    def slots(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[end - start, H, D] views of the keys and values of slots start..end-1."""
        if not 0 <= start <= end <= self.num_slots:
            raise CacheStateError(f"slots [{start}, {end}) of a layer holding {self.num_slots}")
        keys = self._keys[:, start:end].transpose(0, 1)
        return keys, self._values[:, start:end].transpose(0, 1)

    def head(self, num_slots: int) -> DenseLayerKV:
        """The first `num_slots` slots as a layer over the same buffers (no copy): a prefix's
        layer that sessions read and never write."""
        if num_slots > self.num_slots:
            raise CacheStateError(
                f"the first {num_slots} slots of a layer holding {self.num_slots}"
            )
        return DenseLayerKV.over(
            self._keys[:, :num_slots],
            self._values[:, :num_slots],
            self._positions[:num_slots],
            num_slots,
        )

    def release(self, pool: BufferPool) -> None:
        """Hands the buffers to `pool` for the next cache; this layer must not be used again."""
        for buffer in (self._keys, self._values, self._positions):
            pool.release(buffer)
        self._keys = self._values = self._positions = None
        self.num_slots = self._num_finite = 0

    def drop_last(self, num_slots: int) -> None:
        if num_slots > self.num_slots:
            raise CacheStateError(f"cannot drop {num_slots} of {self.num_slots} slots")
        self.num_slots -= num_slots

    def retain(self, slot_index: torch.Tensor) -> None:
        """Keep only the given slots, per head: slot_index [k, H], ascending within each head."""
        n = self.num_slots
        gather = slot_index.T.unsqueeze(-1).expand(-1, -1, self._keys.shape[2])  # [H, k, D]
        keys = torch.gather(self._keys[:, :n], 1, gather)
        values = torch.gather(self._values[:, :n], 1, gather)
        positions = torch.gather(self._positions[:n], 0, slot_index)
        self.num_slots = 0
        self._write(keys.transpose(0, 1), values.transpose(0, 1), positions)

    @property
    def nbytes(self) -> int:
        num_kv_heads, _, head_dim = self._keys.shape
        return 2 * self.num_slots * num_kv_heads * head_dim * self._keys.element_size()

    def to_state(self) -> LayerState:
        keys, values = self.keys_values()
        n = self.num_slots
        tensors = {"keys": keys[:n], "values": values[:n], "positions": self._positions[:n]}
        return LayerState("dense", {}, tensors)

    @classmethod
    def from_state(cls, state: LayerState) -> DenseLayerKV:
        t = state.tensors
        return cls.from_tensors(t["keys"], t["values"], t["positions"])

    def clone(self, capacity: int = 0, pool: BufferPool | None = None) -> DenseLayerKV:
        """Copies the resident slots only (head by head, as stored); the rest of `capacity`
        stays unfilled."""
        num_kv_heads, _, head_dim = self._keys.shape
        dtype, device = self._keys.dtype, self._keys.device
        n = self.num_slots
        copy = DenseLayerKV(num_kv_heads, head_dim, dtype, device, max(capacity, n), pool)
        copy._keys[:, :n] = self._keys[:, :n]
        copy._values[:, :n] = self._values[:, :n]
        copy._positions[:n] = self._positions[:n]
        copy.num_slots = copy._num_finite = n
        return copy


class KVCache:
    """The KV of one sequence across all layers.

    `num_tokens` counts the tokens of the sequence the cache has seen; the next token is rotated
    at that position whatever the number of resident slots.
    """

    def __init__(self, layers: list[LayerKV], num_tokens: int = 0):
        self.layers = layers
        self.num_tokens = num_tokens

    @classmethod
    def empty(
        cls,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype,
        device,
        capacity: int = 0,
        pool: BufferPool | None = None,
    ) -> KVCache:
        """An uncompressed cache with room for `capacity` tokens, its buffers taken from `pool`
        where it has some."""
        layers = [
            DenseLayerKV(num_kv_heads, head_dim, dtype, device, capacity, pool)
            for _ in range(num_layers)
        ]
        return cls(layers)

    def release(self, pool: BufferPool) -> None:
        """Hands the dense layers' own buffers to `pool`; the cache must not be used again."""
        for layer in self.layers:
            if getattr(layer, "is_dense", False):
                layer.release(pool)
        self.layers, self.num_tokens = [], 0

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    def clone(self, capacity: int = 0, pool: BufferPool | None = None) -> KVCache:
        """An independent copy; `capacity` reserves slots for tokens to come."""
        return self.with_layers([layer.clone(capacity, pool) for layer in self.layers])

    def with_layers(self, layers: list[LayerKV]) -> KVCache:
        """A cache of the same kind and tokens over other layers (a copy's, a share's)."""
        return KVCache(layers, self.num_tokens)

    @property
    def is_full(self) -> bool:
        """True when every layer holds every token seen, in order (an uncompressed cache)."""
        return all(
            getattr(layer, "is_dense", False) and layer.num_slots == self.num_tokens
            for layer in self.layers
        )

    def advance(self, num_tokens: int) -> None:
        """Record that a forward appended `num_tokens` tokens to every layer."""
        self.num_tokens += num_tokens

    def truncate(self, num_tokens: int) -> None:
        """Roll back to the first `num_tokens` tokens, dropping the KV of every later token."""
        removed = self.num_tokens - num_tokens
        if removed < 0:
            raise CacheStateError(f"cannot truncate {self.num_tokens} tokens to {num_tokens}")
        if removed == 0:
            return
        tails = [layer.newest_positions(removed) for layer in self.layers]
        # One device sync for all layers.
        if min(t.shape[0] for t in tails) < removed or int(torch.cat(tails).min()) < num_tokens:
            raise CacheStateError(
                f"tokens after position {num_tokens} were compressed already; "
                "only uncommitted tokens can be rolled back"
            )
        for layer in self.layers:
            layer.drop_last(removed)
        self.num_tokens = num_tokens

    def append_exact(self, exact: ExactKV) -> None:
        """Appends the exact KV of the tokens right after the ones this cache holds (on any
        device): the one way committed tokens' exact KV enters a cache."""
        if exact.start != self.num_tokens:
            raise CacheStateError(
                f"cache holds {self.num_tokens} tokens, cannot append exact KV from {exact.start}"
            )
        device = self.device
        positions = exact.positions(device)
        for layer, keys, values in zip(self.layers, exact.keys, exact.values):
            layer.append(keys.to(device), values.to(device), positions)
        self.num_tokens = exact.end

    @property
    def device(self) -> torch.device:
        return self.layers[0].positions().device

    def to_state(self) -> CacheState:
        return CacheState(self.num_tokens, [layer.to_state() for layer in self.layers])
