"""A refresh of a drafter's kept set (compress/steering.py plans it): the one record that changes
which prefix positions a token dropper's copy keeps, in-process or across the slow link.

A refresh replaces, per layer, some (head, position) entries of the kept set by others: for each
replaced entry, the position it drops, the position it keeps instead, and that position's exact
key and value in the kept slots' dtype. That is all that crosses the link, so a refresh costs in
bytes what it changes. It applies to one kept set, `base_version`, and makes `version`: the
drafter takes it only where its own set is that base (a refresh lost on the way leaves it on an
older one, which it tells the verifier with its next drafts), and only where its digest holds (a
refresh damaged on the way is dropped, and counted there). Applied, each head's slots are in
ascending position order again, on whichever side applies it, so both sides agree on the set.

A composition's quantized layer (`snapkv+kivi`) keeps its prefix slots in whole groups, keys
quantized per channel over each group: one entry cannot be swapped alone. Its refresh
(`LayerRegrouped`) carries the layer's leading groups whole, quantized again from the full KV's
exact keys and values at the new positions: what compressing the prefix keeping those positions
would have stored, so no error builds up over refreshes. The slots past the last whole group
(fewer than a group: each head's newest kept positions) stay as they are.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch

from vericache.kv.cache import DenseLayerKV, KVCache
from vericache.kv.prefixed import PrefixedLayerKV
from vericache.kv.quantized import QUANTIZED_TENSORS
from vericache.kv.state import CacheState

# Per layer: the kept prefix positions [k, H] of a dense layer or a regrouped quantized one (None:
# a layer steering leaves as it is).
KeptPositions = tuple[torch.Tensor | None, ...]


@dataclass(frozen=True)
class LayerRefresh:
    index: int  # the layer
    heads: torch.Tensor  # [m] int64: each replaced entry's KV head
    removed: torch.Tensor  # [m] int32: the position it drops
    added: torch.Tensor  # [m] int32: the position it keeps instead
    keys: torch.Tensor  # [m, D] the added positions' rotated keys, in the kept slots' dtype
    values: torch.Tensor  # [m, D]

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.heads, self.removed, self.added, self.keys, self.values)

    @property
    def num_changed(self) -> int:
        return self.heads.numel()


@dataclass(frozen=True, eq=False)
class LayerRegrouped:
    """A quantized layer's leading whole groups, quantized again at the positions they keep."""

    index: int  # the layer
    num_changed: int  # (head, position) entries it brings in
    groups: dict[str, torch.Tensor]  # kv/quantized.py `quantized_groups`: positions [n, H], codes

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(self.groups[name] for name in QUANTIZED_TENSORS)


@dataclass(frozen=True)
class KeptSetRefresh:
    version: int  # the kept set it makes
    base_version: int  # the kept set it applies to
    layers: tuple[LayerRefresh | LayerRegrouped, ...]
    digest: str = field(default="", compare=False)  # of everything above, `sealed()`

    @property
    def num_changed(self) -> int:
        """(layer, head, position) entries it replaces."""
        return sum(layer.num_changed for layer in self.layers)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers for t in layer.tensors())

    def sealed(self) -> KeptSetRefresh:
        """Itself with its digest, for a trip across the link."""
        return KeptSetRefresh(self.version, self.base_version, self.layers, self._computed_digest())

    def is_intact(self) -> bool:
        """Whether it is as it was sealed."""
        return bool(self.digest) and self.digest == self._computed_digest()

    def _computed_digest(self) -> str:
        digest = hashlib.sha256(f"{self.version}:{self.base_version}".encode())
        for layer in self.layers:
            digest.update(f"|{type(layer).__name__}:{layer.index}".encode())
            for tensor in layer.tensors():
                digest.update(f":{tensor.dtype}:{tuple(tensor.shape)}:".encode())
                digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy())
        return digest.hexdigest()


def kept_positions(cache: KVCache, num_prefix: int) -> KeptPositions:
    """A compressed cache's kept prefix positions, per layer [k, H] (None: not steered)."""
    return tuple(
        _kept_prefix_positions(layer, num_prefix) if _is_steered(layer) else None
        for layer in cache.layers
    )


def _is_steered(layer) -> bool:
    return getattr(layer, "is_dense", False) or getattr(layer, "regroups", False)


def stored_kept_positions(state: CacheState) -> KeptPositions:
    """A stored compressed prefix's kept positions, per layer [k, H] (None: not steered)."""
    return tuple(_stored_positions(layer) for layer in state.layers)


def _stored_positions(layer) -> torch.Tensor | None:
    tensors = layer.tensors
    if layer.kind == "dense":
        return tensors["positions"].clone()
    if layer.kind == "quantized":  # its groups, then the slots past them
        return torch.cat([tensors["positions"], tensors["residual_positions"]])
    return None


def refreshed_positions(base: KeptPositions, refresh: KeptSetRefresh) -> KeptPositions:
    """The kept positions `refresh` makes of `base` (each head ascending)."""
    positions = list(base)
    for layer in refresh.layers:
        base_positions = base[layer.index]
        if isinstance(layer, LayerRegrouped):
            grouped = layer.groups["positions"].to(base_positions.device)
            positions[layer.index] = torch.cat([grouped, base_positions[grouped.shape[0] :]])
            continue
        slots = _slots_of(base_positions, layer)
        positions[layer.index], _ = _replaced(base_positions, layer, slots)
    return tuple(positions)


def apply_refresh(cache: KVCache, num_prefix: int, refresh: KeptSetRefresh) -> None:
    """Replaces the entries `refresh` names in the cache's kept prefix slots (the cache's own
    copy of them: a prefix shared with other sessions stays as it was)."""
    for layer_refresh in refresh.layers:
        index = layer_refresh.index
        layer = cache.layers[index]
        if isinstance(layer_refresh, LayerRegrouped):
            if not getattr(layer, "regroups", False):
                raise ValueError("a regrouping refresh for a layer that is not regrouped")
            layer.replace_leading(layer_refresh.groups)
            continue
        kept = _kept_part(layer, num_prefix)
        keys, values = (t.clone() for t in kept.slots(0, kept.num_slots))  # [k, H, D] each
        slots = _slots_of(kept.positions(), layer_refresh)
        positions, order = _replaced(kept.positions(), layer_refresh, slots)
        keys[slots, layer_refresh.heads] = layer_refresh.keys.to(keys.device, keys.dtype)
        values[slots, layer_refresh.heads] = layer_refresh.values.to(values.device, values.dtype)
        heads = torch.arange(keys.shape[1], device=keys.device)
        new = DenseLayerKV.from_tensors(keys[order, heads], values[order, heads], positions)
        _replace_kept(cache, index, num_prefix, new)


def _replaced(
    positions: torch.Tensor, refresh: LayerRefresh, slots: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`positions` [k, H] with the refresh's entries (at `slots`) replaced, each head ascending,
    and the order [k, H] of the replaced slots that sorts them."""
    replaced = positions.clone()
    replaced[slots, refresh.heads.to(positions.device)] = refresh.added.to(positions.device)
    ordered, order = replaced.sort(dim=0)
    return ordered.contiguous(), order


def _slots_of(positions: torch.Tensor, refresh: LayerRefresh) -> torch.Tensor:
    """The slot [m] of each entry the refresh drops (its head's slot at its position)."""
    heads = refresh.heads.to(positions.device)
    removed = refresh.removed.to(positions.device)
    matches = positions[:, heads] == removed  # [k, m]
    if not bool(matches.any(0).all()):
        raise ValueError("a kept-set refresh drops a position its base does not keep")
    return matches.int().argmax(0)


def _kept_prefix_positions(layer, num_prefix: int) -> torch.Tensor:  # [k, H]
    """A compressed layer's kept prefix positions, read without copying its slots."""
    if isinstance(layer, PrefixedLayerKV):
        return layer.shared.positions().clone()
    positions = layer.positions()  # [slots, H]
    return positions[: _num_kept(positions, num_prefix)].clone()


def _num_kept(positions: torch.Tensor, num_prefix: int) -> int:
    """How many of a layer's slots [slots, H] hold prefix positions (as many for every head)."""
    return int((positions[:, 0] < num_prefix).sum())


def _kept_part(layer, num_prefix: int) -> DenseLayerKV:
    """A compressed dense layer's kept prefix slots, in a layer of their own."""
    if isinstance(layer, PrefixedLayerKV):
        return layer.shared
    positions = layer.positions()  # [slots, H]
    num_kept = _num_kept(positions, num_prefix)
    keys, values = layer.slots(0, num_kept)
    return DenseLayerKV.from_tensors(keys, values, positions[:num_kept])


def _replace_kept(cache: KVCache, index: int, num_prefix: int, new: DenseLayerKV) -> None:
    layer = cache.layers[index]
    if isinstance(layer, PrefixedLayerKV):
        layer.shared = new  # the session's own copy now: the shared one stays as it was
        return
    positions = layer.positions()
    num_kept = _num_kept(positions, num_prefix)
    keys, values = layer.slots(num_kept, layer.num_slots)
    new.append(keys, values, positions[num_kept:])
    cache.layers[index] = new
