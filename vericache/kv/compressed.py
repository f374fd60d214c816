"""CompressedKV: a cache made by a compressor, with what it kept and how it is stored.

Per layer and KV head it records either the kept tokens (their original positions, sorted, the
same count for every head of a layer) or the quantization scheme with packed codes, scales and zero
points. It is a `KVCache`, so the runner attends over it directly; `decompress(layer)` gives the
full-precision keys and values attention reads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from vericache.errors import CacheStateError
from vericache.kv.cache import DenseLayerKV, KVCache, LayerKV
from vericache.kv.outlier_quantized import OutlierQuantizedLayerKV
from vericache.kv.quantized import QuantizedLayerKV
from vericache.kv.state import CacheState, LayerState

if TYPE_CHECKING:
    from vericache.compress.base import Compressor

LAYER_KINDS: dict[str, type] = {
    "dense": DenseLayerKV,
    "quantized": QuantizedLayerKV,
    OutlierQuantizedLayerKV.kind: OutlierQuantizedLayerKV,
}


class CompressedKV(KVCache):
    def __init__(
        self,
        layers: list[LayerKV],
        num_tokens: int,
        compressor: Compressor,
        budgets: list[int] | None = None,
        extras: dict[str, list[torch.Tensor]] | None = None,
    ):
        super().__init__(layers, num_tokens)
        self.compressor = compressor
        # Most slots per layer an online token-dropping compressor keeps; None: no bound.
        self.budgets = budgets
        # Online compressor state per layer, by name (e.g. H2O's accumulated attention).
        self.extras = extras if extras is not None else {}
        # Queries the drafter computed since the last update, per layer: (positions [n], q [n,Hq,D])
        # for compressors that score tokens by the attention they receive while decoding.
        self.observed: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in layers]

    @property
    def records_queries(self) -> bool:
        return self.compressor.records_queries

    def observe(self, layer_index: int, positions, queries, layer_kv) -> None:
        """Runner hook: the rotated queries [n, Hq, D] a forward computed at `layer_index`."""
        self.observed[layer_index].append((positions, queries))

    def decompress(self, layer_index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Full-precision keys and values [slots, H, D] of one layer, in the cache dtype."""
        layer = self.layers[layer_index]
        keys, values = layer.keys_values()
        return keys[: layer.num_slots], values[: layer.num_slots]

    def kept_positions(self, layer_index: int) -> torch.Tensor:
        """[slots, H] original positions of the resident tokens, ascending per head."""
        return self.layers[layer_index].positions()

    @property
    def resident_bytes(self) -> int:
        """Bytes held: keys, values, quantization metadata and kept positions."""
        positions = sum(layer.positions().numel() * 4 for layer in self.layers)
        extras = sum(t.numel() * t.element_size() for ts in self.extras.values() for t in ts)
        return self.nbytes + positions + extras

    def with_layers(self, layers: list[LayerKV]) -> CompressedKV:
        """Over other layers, with a copy of the compressor's state."""
        return CompressedKV(
            layers,
            self.num_tokens,
            self.compressor,
            None if self.budgets is None else list(self.budgets),
            {name: [t.clone() for t in ts] for name, ts in self.extras.items()},
        )

    def to_state(self) -> CacheState:
        state = super().to_state()
        state.budgets = None if self.budgets is None else list(self.budgets)
        state.compressor = self.compressor.spec()
        state.extras = {name: list(ts) for name, ts in self.extras.items()}
        return state


def layer_from_state(state: LayerState) -> LayerKV:
    if state.kind not in LAYER_KINDS:
        raise CacheStateError(f"unknown layer kind {state.kind!r}")
    return LAYER_KINDS[state.kind].from_state(state)
