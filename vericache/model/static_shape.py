"""The shapes of static forwards (static_forward.py): which sequences a static step serves, and
how it groups them.

A static step serves layers of three kinds (`LayerKind`), each with its attention kernel: full-
precision slots (a full cache, a dropper's kept slots), a session's own slots over a shared
prefix, and KIVI's packed codes before a full-precision residual. Sequences fall into groups by
their new tokens (a bucket), their attention (exact or fast) and their layers' kind; a group's
sequence count is a bucket too.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from vericache.kv.cache import DenseLayerKV
from vericache.kv.prefixed import PrefixedLayerKV
from vericache.kv.quantized import QuantizedLayerKV

# Sequences per group, and new tokens per sequence (a verification of up to 63 drafts).
BUCKETS = (1, 2, 4, 8, 16, 32, 64)


class LayerKind(enum.IntEnum):
    """What a static step's layers hold, which picks its attention kernel."""

    DENSE = 0  # full-precision slots: a full cache, or a dropper's kept slots
    PREFIXED = 1  # a shared prefix's slots, then the session's own (kv/prefixed.py)
    PACKED = 2  # KIVI's packed codes, then a full-precision residual (kv/quantized.py)


NO_PACKING = (0, 0)


@dataclass(frozen=True, order=True)
class GroupShape:
    """Sequences of a static forward that feed alike: `batch` of them (a bucket, padding
    included), up to `tokens` new tokens each (a bucket: padding tokens after a sequence's own),
    over full KV by the batch-invariant kernels (`exact`) or by the fast ones, over layers of one
    kind (and for KIVI one packing: bits, group size)."""

    tokens: int
    exact: bool
    kind: LayerKind
    packing: tuple[int, int]
    batch: int


GroupKey = tuple[int, bool, LayerKind, tuple[int, int]]  # a GroupShape's, but its batch


def layer_form(layer, dtype: torch.dtype) -> tuple[LayerKind, tuple[int, int]] | None:
    """How a static step serves a layer (its kind and packing), or None where it does not: its
    full-precision slots must be in the model's dtype, a KIVI layer's packed tensors contiguous
    (the kernels read them through their addresses)."""
    if type(layer) is DenseLayerKV:
        return (LayerKind.DENSE, NO_PACKING) if layer.dtype == dtype else None
    if type(layer) is PrefixedLayerKV:
        parts = (layer.shared, layer.own)
        if all(type(part) is DenseLayerKV and part.dtype == dtype for part in parts):
            return LayerKind.PREFIXED, NO_PACKING
        return None
    if type(layer) is QuantizedLayerKV:  # not its subclasses (outliers: no packed attention)
        residual = layer.residual
        tensors = layer.packed_tensors()
        if residual.dtype == dtype and all(t.is_contiguous() for t in tensors):
            return LayerKind.PACKED, (layer.bits, layer.group_size)
    return None


def new_slots(layer) -> DenseLayerKV:
    """The dense layer a step's new tokens go to: the layer, a session's own, a KIVI residual."""
    if type(layer) is PrefixedLayerKV:
        return layer.own
    if type(layer) is QuantizedLayerKV:
        return layer.residual
    return layer


@dataclass(frozen=True)
class StepShape:
    groups: tuple[GroupShape, ...]
    invariant: bool  # the forward's linear layers: the batch-invariant set

    @property
    def num_tokens(self) -> int:
        return sum(g.batch * g.tokens for g in self.groups)

    @property
    def num_sequences(self) -> int:
        return sum(g.batch for g in self.groups)


@dataclass(frozen=True)
class StaticSplit:
    """What a static forward serves of a batch: its shape, the indices of the sequences it takes
    (ascending; the others go dynamic), and each one's (group, index within the group)."""

    shape: StepShape
    chosen: list[int]
    placed: list[tuple[int, int]]  # [len(chosen)]


def bucket(count: int) -> int | None:
    return next((size for size in BUCKETS if size >= count), None)
