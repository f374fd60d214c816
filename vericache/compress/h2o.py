from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from vericache.compress.base import CompressionMode, TokenDropping
from vericache.compress.scoring import (
    accumulate_attention,
    all_prefix_scores,
    committed_queries,
    select_slots,
    token_budget,
)
from vericache.errors import InvalidRequestError
from vericache.kv.cache import KVCache
from vericache.kv.compressed import CompressedKV


@dataclass(frozen=True)
class H2O(TokenDropping):
    """Heavy hitters plus a recent window, `ratio` times fewer slots than tokens seen.

    Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language
    Models", NeurIPS 2023, https://arxiv.org/abs/2306.14048. Each slot accumulates the attention
    it receives from every query so far (per KV head, summed over its query heads). The cache keeps
    `ratio` times fewer slots than prefix tokens: a `recent_fraction` of them for the newest tokens
    and the rest for the highest accumulated scores. Online: the drafter's queries of committed
    tokens keep adding to the scores, and every update evicts down to 1/`ratio` of the tokens
    seen so far.
    """

    name: ClassVar[str] = "h2o"
    mode: ClassVar[CompressionMode] = CompressionMode.ONLINE
    records_queries: ClassVar[bool] = True

    recent_fraction: float = 0.5

    def __post_init__(self):
        super().__post_init__()
        if not 0 <= self.recent_fraction < 1:
            raise InvalidRequestError("h2o recent_fraction must lie in [0, 1)")

    def compress(self, full: KVCache, context=None) -> CompressedKV:
        context = self.require_context(context)
        budget = token_budget(full.num_tokens, self.ratio, minimum=2)
        layers, kept_scores = [], []
        for layer, scores in zip(full.layers, all_prefix_scores(full, context)):
            slot_index = self._kept_slots(scores, budget)
            layers.append(self.keep_slots(layer, slot_index))
            kept_scores.append(torch.gather(scores, 0, slot_index))
        budgets = [budget] * len(layers)
        return CompressedKV(layers, full.num_tokens, self, budgets, {"scores": kept_scores})

    def update(self, cache: CompressedKV) -> None:
        budgets = self.grow_budgets(cache)
        for index, layer in enumerate(cache.layers):
            scores = cache.extras["scores"][index]
            scores = F.pad(scores, (0, 0, 0, layer.num_slots - scores.shape[0]))  # new slots: 0
            observed = committed_queries(cache, index)
            if observed is not None:
                scores = scores + accumulate_attention(*observed, layer, layer.num_slots)
            if layer.num_slots > budgets[index]:
                slot_index = self._kept_slots(scores, budgets[index])
                cache.layers[index] = self.keep_slots(layer, slot_index)
                scores = torch.gather(scores, 0, slot_index)
            cache.extras["scores"][index] = scores

    def _kept_slots(self, scores: torch.Tensor, budget: int) -> torch.Tensor:
        """[k, H]: the newest recent_fraction * budget slots, then the heaviest hitters."""
        num_slots = scores.shape[0]
        num_recent = min(math.floor(budget * self.recent_fraction), num_slots)
        recent = torch.arange(num_slots, device=scores.device) >= num_slots - num_recent
        return select_slots(scores, budget, forced=recent)
