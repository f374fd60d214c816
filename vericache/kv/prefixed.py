"""A session's cache over a prefix it shares: [shared prefix | own slots], one layer at a time.

Sessions over one prefix read one copy of its KV, held read-only by the worker
(kv/shared_prefix.py): full KV on a verifier, the compressed KV a drafter fetched. A
`PrefixedLayerKV` pairs that copy's layer with the session's own dense layer, which holds
everything after it: the rest of the prompt, the output, a round's drafts. Appends, rollbacks and
the bytes a session is charged for touch the own layer alone.

The shared part is the prefix's whole layer, so a session holds none of its tokens. Quantized
layers are not shared (their packed groups take the session's tokens as they fill), nor are the
layers an online compressor rewrites (H2O, TOVA, StreamingLLM replace a layer by the slots they
keep, a private copy). The attention kernels run a row's online softmax over the shared slots and
carry it on into the own ones in the blocks of one buffer, the block that straddles the two read
from both (kernels/cpu_attention.cpp, vericache/kernels/triton_invariant_attention.py): output
with a shared prefix is bit for bit output without one, whatever shares it and whatever its
length. Attention elsewhere (sliding windows, library paths) reads `keys_values`, the two parts
copied into one buffer.
"""

from __future__ import annotations

import torch

from vericache.errors import CacheStateError
from vericache.kv.cache import DenseLayerKV, KVCache
from vericache.kv.pool import BufferPool
from vericache.kv.slots import aligned
from vericache.kv.state import LayerState


class PrefixedLayerKV:
    """A session's layer over a shared prefix: `shared` (read-only), then `own`."""

    is_dense = True  # full-precision slots, in token order within each part

    def __init__(self, shared: DenseLayerKV, own: DenseLayerKV):
        self.shared = shared
        self.own = own

    @property
    def num_slots(self) -> int:
        return self.shared.num_slots + self.own.num_slots

    def append(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        self.own.append(keys, values, positions)

    def reserve(self, num_new: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """The own layer's `DenseLayerKV.reserve`: new slots are the session's."""
        return self.own.reserve(num_new)

    def keys_values(self, pad_to: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """[T', H, D] copies of both parts in one buffer, for attention that cannot read them
        apart; padded as `DenseLayerKV.keys_values` pads."""
        end = aligned(self.num_slots, pad_to)
        own_keys, own_values = self.own.keys_values(pad_to=1)
        shared_keys, shared_values = self.shared.keys_values()
        tail = end - self.num_slots
        keys = torch.cat([shared_keys, own_keys, own_keys.new_zeros(tail, *own_keys.shape[1:])])
        values = torch.cat(
            [shared_values, own_values, own_values.new_zeros(tail, *own_keys.shape[1:])]
        )
        return keys, values

    def positions(self) -> torch.Tensor:
        return torch.cat([self.shared.positions(), self.own.positions()])

    def newest_positions(self, num_slots: int) -> torch.Tensor:
        if num_slots <= self.own.num_slots:
            return self.own.newest_positions(num_slots)
        return self.positions()[-num_slots:]

    def slots(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [end - start, H, D] of slots start..end-1: views where they lie in one
        part, else a copy."""
        split = self.shared.num_slots
        if start >= split:
            return self.own.slots(start - split, end - split)
        if end <= split:
            return self.shared.slots(start, end)
        shared_keys, shared_values = self.shared.slots(start, split)
        own_keys, own_values = self.own.slots(0, end - split)
        return torch.cat([shared_keys, own_keys]), torch.cat([shared_values, own_values])

    def drop_last(self, num_slots: int) -> None:
        if num_slots > self.own.num_slots:
            raise CacheStateError(
                f"cannot drop {num_slots} slots: {self.shared.num_slots} of the layer's "
                f"{self.num_slots} are a shared prefix's"
            )
        self.own.drop_last(num_slots)

    @property
    def nbytes(self) -> int:
        """The session's own bytes: the shared part is counted once, by its holder."""
        return self.own.nbytes

    def clone(self, capacity: int = 0, pool: BufferPool | None = None) -> PrefixedLayerKV:
        """A copy of the own part (room for `capacity` slots in all) over the same shared part."""
        own_capacity = max(capacity - self.shared.num_slots, 0)
        return PrefixedLayerKV(self.shared, self.own.clone(own_capacity, pool))

    def release(self, pool: BufferPool) -> None:
        """Hands the own buffers to `pool`; the shared part stays with its holder."""
        self.own.release(pool)

    def to_state(self) -> LayerState:
        """Both parts as one dense layer's state (a copy): what leaves the worker."""
        keys, values = self.slots(0, self.num_slots)
        tensors = {"keys": keys, "values": values, "positions": self.positions()}
        return LayerState("dense", {}, tensors)


def shared_clone(cache: KVCache, capacity: int, pool: BufferPool | None = None) -> KVCache:
    """A session's cache over `cache`, a prefix's copy held read-only for every session that
    uses it (full KV, or a compressor's kept tokens): each dense layer is read in place, and the
    session's own layer starts empty, with room for `capacity` slots in all. Other layers
    (quantized) are copied, as `clone` copies them."""
    return cache.with_layers([_shared_layer(layer, capacity, pool) for layer in cache.layers])


def _shared_layer(layer, capacity: int, pool: BufferPool | None):
    if isinstance(layer, PrefixedLayerKV) or not getattr(layer, "is_dense", False):
        return layer.clone(capacity, pool)
    if layer.num_slots == 0:
        return layer.clone(capacity, pool)
    keys, _ = layer.slots(0, 1)  # [1, H, D]: the layer's heads, size and dtype
    num_kv_heads, head_dim = keys.shape[1:]
    own_capacity = capacity - layer.num_slots
    own = DenseLayerKV(num_kv_heads, head_dim, keys.dtype, keys.device, own_capacity, pool)
    return PrefixedLayerKV(layer.head(layer.num_slots), own)
