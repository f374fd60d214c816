"""A cache as plain named tensors: what the codec writes and what a compressed cache is made of.

`CacheState` is the single exchange format between a cache object and the outside (wire, disk,
tests). Each layer is a kind tag, a few scalars (`meta`) and named tensors holding exactly the
resident data: for a dense layer its keys, values and per-head original positions; for a quantized
layer its packed codes, scales, zero points, positions and full-precision residual.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

Scalar = int | float | str | bool


@dataclass
class LayerState:
    kind: str  # "dense" or "quantized"
    meta: dict[str, Scalar]
    tensors: dict[str, torch.Tensor]


@dataclass
class CacheState:
    num_tokens: int
    layers: list[LayerState]
    # Most slots per layer an online token-dropping compressor keeps; None: no bound.
    budgets: list[int] | None = None
    # Registry name and hyper-parameters of the compressor that made the cache; None: full KV.
    compressor: dict | None = None
    # Online compressor state per layer, by name (e.g. H2O's accumulated attention [slots, H]).
    extras: dict[str, list[torch.Tensor]] = field(default_factory=dict)

    def equals(self, other: CacheState) -> bool:
        """Bit-exact equality of every scalar and tensor (dtype and shape included)."""
        if (self.num_tokens, self.budgets, self.compressor) != (
            other.num_tokens,
            other.budgets,
            other.compressor,
        ):
            return False
        if len(self.layers) != len(other.layers) or self.extras.keys() != other.extras.keys():
            return False
        for mine, theirs in zip(self.layers, other.layers):
            if (mine.kind, mine.meta) != (theirs.kind, theirs.meta):
                return False
            if not _same_tensors(mine.tensors, theirs.tensors):
                return False
        return all(
            len(self.extras[name]) == len(other.extras[name])
            and all(_same(a, b) for a, b in zip(self.extras[name], other.extras[name]))
            for name in self.extras
        )


def _same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(_same(a[name], b[name]) for name in a)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    # Compare bit patterns: NaN payloads and signed zeros count.
    return torch.equal(_bits(a.cpu()), _bits(b.cpu()))


def _bits(t: torch.Tensor) -> torch.Tensor:
    if t.is_floating_point():
        return t.reshape(-1).contiguous().view(torch.uint8) if t.numel() else t.to(torch.uint8)
    return t
