from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from vericache.compress.base import CompressionMode, TokenDropping
from vericache.errors import InvalidRequestError
from vericache.kv.cache import KVCache
from vericache.kv.compressed import CompressedKV


@dataclass(frozen=True)
class StreamingLLM(TokenDropping):
    """Attention sinks plus a sliding window of recent tokens.

    Xiao et al., "Efficient Streaming Language Models with Attention Sinks", ICLR 2024,
    https://arxiv.org/abs/2309.17453. The prefix keeps its `num_sinks` first tokens and its most
    recent ones, `ratio` times fewer slots than tokens. Tokens appended later are kept, as for any
    compressed prefix; with `sliding=True` the cache keeps its size instead (the streaming
    setting): each committed token evicts the oldest non-sink slot.
    """

    name: ClassVar[str] = "streamingllm"
    mode: ClassVar[CompressionMode] = CompressionMode.ONLINE

    num_sinks: int = 4
    sliding: bool = False

    def __post_init__(self):
        super().__post_init__()
        if self.num_sinks < 0:
            raise InvalidRequestError(f"num_sinks must be >= 0, got {self.num_sinks}")

    def slot_budget(self, num_tokens: int) -> int:
        """Slots kept: `ratio` times fewer than tokens, and room for the sinks plus one token
        (the bound a sliding cache keeps, even over a prefix shorter than that)."""
        return max(self.num_sinks + 1, math.ceil(num_tokens / self.ratio))

    def compress(self, full: KVCache, context=None) -> CompressedKV:
        budget = self.slot_budget(full.num_tokens)
        layers = [self.keep_slots(layer, self._kept_slots(layer, budget)) for layer in full.layers]
        return CompressedKV(layers, full.num_tokens, self, budgets=[budget] * len(layers))

    def update(self, cache: CompressedKV) -> None:
        if not self.sliding:
            return
        for index, (layer, budget) in enumerate(zip(cache.layers, cache.budgets)):
            if layer.num_slots > budget:
                cache.layers[index] = self.keep_slots(layer, self._kept_slots(layer, budget))

    def _kept_slots(self, layer, budget: int) -> torch.Tensor:
        """[k, H] slot indices: the sinks and the newest `budget - num_sinks` slots."""
        positions = layer.positions()
        num_slots, num_heads, device = layer.num_slots, positions.shape[1], positions.device
        if num_slots <= budget:
            kept = torch.arange(num_slots, device=device)
        else:
            sinks = torch.arange(min(self.num_sinks, budget), device=device)
            recent = torch.arange(num_slots - (budget - sinks.numel()), num_slots, device=device)
            kept = torch.cat([sinks, recent])
        return kept.unsqueeze(1).expand(-1, num_heads)
