from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from vericache.compress.base import CompressionMode, TokenDropping
from vericache.compress.scoring import replay_scores, select_slots, token_budget
from vericache.errors import InvalidRequestError
from vericache.kv.cache import KVCache
from vericache.kv.compressed import CompressedKV

REPEAT_PROMPT = "\n\nRepeat the previous context exactly.\n"


@dataclass(frozen=True)
class KVzip(TokenDropping):
    """Query-agnostic compression: keep the KV the model needs to reconstruct its context.

    Kim et al., "KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction", 2025,
    https://arxiv.org/abs/2505.23416. After the prefix, the model is asked to repeat it and is fed
    the prefix again, `chunk_size` tokens per pass; a prefix slot scores the highest attention any
    reconstruction query (and any query head of its group) pays it. Each KV head keeps its top
    slots, `ratio` times fewer than tokens. The scores do not depend on any later question, so one
    compressed prefix serves every request that shares it.
    """

    name: ClassVar[str] = "kvzip"
    mode: ClassVar[CompressionMode] = CompressionMode.OFFLINE

    chunk_size: int = 2048

    def __post_init__(self):
        super().__post_init__()
        if self.chunk_size < 1:
            raise InvalidRequestError(f"kvzip chunk_size must be >= 1, got {self.chunk_size}")

    def compress(self, full: KVCache, context=None) -> CompressedKV:
        context = self.require_context(context)
        budget = token_budget(full.num_tokens, self.ratio)
        scores = context.remembered_scores(
            (self.name, self.chunk_size), lambda: self._reconstruction_scores(full, context)
        )
        layers = [
            self.keep_slots(layer, select_slots(layer_scores, budget))
            for layer, layer_scores in zip(full.layers, scores)
        ]
        return CompressedKV(layers, full.num_tokens, self)

    def _reconstruction_scores(self, full: KVCache, context) -> list[torch.Tensor]:
        """Per layer [T, Hkv]: the most attention each prefix slot receives while rebuilding."""
        num_tokens = full.num_tokens
        prompt = _encode(context.tokenizer, REPEAT_PROMPT)
        room = context.runner.config.max_position_embeddings - num_tokens - len(prompt)
        chunk_size = min(self.chunk_size, room)
        if chunk_size < 1:
            raise InvalidRequestError(
                f"kvzip needs room after the {num_tokens}-token prefix to replay it"
            )
        prefix = list(context.token_ids[:num_tokens])
        replays = [
            (num_tokens, prompt + prefix[begin : begin + chunk_size])
            for begin in range(0, num_tokens, chunk_size)
        ]
        return replay_scores(full, context, replays, reduce="max")


def _encode(tokenizer, text: str) -> list[int]:
    if tokenizer is None:
        return []
    return list(tokenizer.encode(text, add_special_tokens=False))
