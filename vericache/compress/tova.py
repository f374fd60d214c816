from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from vericache.compress.base import CompressionMode, TokenDropping
from vericache.compress.scoring import (
    accumulate_attention,
    committed_queries,
    select_slots,
    token_budget,
    window_scores,
)
from vericache.kv.cache import KVCache
from vericache.kv.compressed import CompressedKV


@dataclass(frozen=True)
class TOVA(TokenDropping):
    """Token Omission Via Attention: the newest query decides which tokens stay.

    Oren et al., "Transformers are Multi-State RNNs", EMNLP 2024, https://arxiv.org/abs/2401.06104.
    The cache keeps `ratio` times fewer slots than tokens seen; the slots the most recent token
    attends to least (averaged over every head of the layer, so the heads of a layer keep the same
    tokens) are dropped. The prefix is ranked by its last token's attention; online, each update
    ranks the slots by the attention of the newest committed token the drafter computed.
    """

    name: ClassVar[str] = "tova"
    mode: ClassVar[CompressionMode] = CompressionMode.ONLINE
    records_queries: ClassVar[bool] = True

    def compress(self, full: KVCache, context=None) -> CompressedKV:
        context = self.require_context(context)
        budget = token_budget(full.num_tokens, self.ratio)
        scores = window_scores(full, context, window=1)
        layers = [
            self.keep_slots(layer, _head_shared(layer_scores, budget))
            for layer, layer_scores in zip(full.layers, scores)
        ]
        return CompressedKV(layers, full.num_tokens, self, [budget] * len(layers))

    def update(self, cache: CompressedKV) -> None:
        budgets = self.grow_budgets(cache)
        for index, layer in enumerate(cache.layers):
            observed = committed_queries(cache, index)
            # Without a query seen for the new tokens there is no ranking yet: evict next time.
            if observed is None or layer.num_slots <= budgets[index]:
                continue
            queries, positions = observed
            newest = int(positions.argmax())
            scores = accumulate_attention(
                queries[newest : newest + 1], positions[newest : newest + 1], layer, layer.num_slots
            )
            cache.layers[index] = self.keep_slots(layer, _head_shared(scores, budgets[index]))


def _head_shared(scores: torch.Tensor, budget: int) -> torch.Tensor:
    """[k, H]: the same top-`budget` slots for every head, by scores [S, H] averaged over heads.
    Every head of a layer holds the same positions here, so a slot index means one token."""
    mean = scores.mean(dim=1, keepdim=True)  # [S, 1]
    return select_slots(mean, budget).expand(-1, scores.shape[1])
