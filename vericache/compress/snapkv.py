from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from vericache.compress.base import CompressionMode, TokenDropping
from vericache.compress.scoring import (
    pool_scores,
    select_slots,
    token_budget,
    window_scores,
)
from vericache.errors import InvalidRequestError
from vericache.kv.cache import KVCache
from vericache.kv.compressed import CompressedKV


@dataclass(frozen=True)
class SnapKV(TokenDropping):
    """Keeps the tokens the prompt's last queries attend to, per KV head.

    Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation", NeurIPS 2024,
    https://arxiv.org/abs/2404.14469. The queries of the last `window` prefix tokens (the
    observation window) score every earlier token; scores are smoothed with a pooling kernel so that
    neighbours of important tokens survive together, and each KV head keeps its top tokens plus the
    window itself, `ratio` times fewer slots than tokens.
    """

    name: ClassVar[str] = "snapkv"
    mode: ClassVar[CompressionMode] = CompressionMode.OFFLINE

    window: int = 32
    kernel_size: int = 7
    pooling: str = "max"

    def __post_init__(self):
        super().__post_init__()
        if self.window < 1 or self.kernel_size < 1 or self.kernel_size % 2 == 0:
            raise InvalidRequestError(f"{self.name} needs window >= 1 and an odd kernel_size")
        if self.pooling not in ("max", "avg"):
            raise InvalidRequestError(f"{self.name} pooling must be 'max' or 'avg'")

    @property
    def observation_window(self) -> int:
        return self.window

    def layer_budgets(self, num_tokens: int, num_layers: int) -> list[int]:
        return [token_budget(num_tokens, self.ratio)] * num_layers

    def compress(self, full: KVCache, context=None) -> CompressedKV:
        context = self.require_context(context)
        num_tokens = full.num_tokens
        window = min(self.window, num_tokens)
        scores = window_scores(full, context, window)
        budgets = self.layer_budgets(num_tokens, len(full.layers))
        positions = torch.arange(num_tokens, device=full.device)
        layers = []
        for layer, layer_scores, budget in zip(full.layers, scores, budgets):
            pooled = pool_scores(layer_scores, self.kernel_size, self.pooling)
            # The window is kept whole while it fills at most half the budget; on a prefix too
            # short for that, scores choose (the first token, the attention sink, scores high).
            in_window = positions >= num_tokens - min(window, budget // 2)
            layers.append(self.keep_slots(layer, select_slots(pooled, budget, forced=in_window)))
        return CompressedKV(layers, num_tokens, self)
