from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from vericache.compress.base import CompressionKind, Compressor
from vericache.errors import InvalidRequestError
from vericache.kv.cache import DenseLayerKV, KVCache


@dataclass(frozen=True)
class StreamingLLM(Compressor):
    """Attention sinks plus a sliding window of recent tokens.

    Xiao et al., "Efficient Streaming Language Models with Attention Sinks", ICLR 2024,
    https://arxiv.org/abs/2309.17453. The prefix keeps its `num_sinks` first tokens and its most
    recent ones, `ratio` times fewer slots than tokens. Tokens appended later are kept, as for any
    compressed prefix; with `sliding=True` the cache keeps its size instead (the streaming
    setting): each committed token evicts the oldest non-sink slot.
    """

    name: ClassVar[str] = "streamingllm"
    kind: ClassVar[CompressionKind] = CompressionKind.TOKEN_DROPPING

    ratio: float = 4.0
    num_sinks: int = 4
    sliding: bool = False

    def __post_init__(self):
        if not self.ratio >= 1:
            raise InvalidRequestError(f"streamingllm ratio must be >= 1, got {self.ratio}")
        if self.num_sinks < 0:
            raise InvalidRequestError(f"num_sinks must be >= 0, got {self.num_sinks}")

    @property
    def label(self) -> str:
        return f"{self.name}-{self.ratio:g}x"

    def slot_budget(self, num_tokens: int) -> int:
        return max(self.num_sinks + 1, math.ceil(num_tokens / self.ratio))

    def compress(self, full: KVCache) -> KVCache:
        budget = self.slot_budget(full.num_tokens)
        layers = []
        for layer in full.layers:
            keys, values = layer.keys_values()
            keep = self._kept_slots(layer.num_slots, budget, keys.device)
            layers.append(
                DenseLayerKV.from_tensors(keys[keep], values[keep], layer.positions()[keep])
            )
        return KVCache(layers, num_tokens=full.num_tokens, slot_budget=budget)

    def update(self, cache: KVCache) -> None:
        if not self.sliding:
            return
        for layer in cache.layers:
            if layer.num_slots > cache.slot_budget:
                keep = self._kept_slots(
                    layer.num_slots, cache.slot_budget, layer.positions().device
                )
                num_heads = layer.positions().shape[1]
                layer.retain(keep.unsqueeze(1).expand(-1, num_heads))

    def _kept_slots(self, num_slots: int, budget: int, device) -> torch.Tensor:
        """[k] slot indices: the sinks and the newest `budget - num_sinks` slots."""
        if num_slots <= budget:
            return torch.arange(num_slots, device=device)
        sinks = torch.arange(min(self.num_sinks, budget), device=device)
        recent = torch.arange(num_slots - (budget - sinks.numel()), num_slots, device=device)
        return torch.cat([sinks, recent])
