"""What a compressor may ask of the model: extra forward passes whose queries it observes."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import torch

from vericache.kv.cache import KVCache
from vericache.model.runner import DEFAULT_PREFILL_CHUNK, ModelRunner, SequenceInput

# observer(layer_index, query positions [n], rotated queries [n, Hq, D], the layer's KV after the
# new tokens were appended)
QueryObserver = Callable[[int, torch.Tensor, torch.Tensor, object], None]

# memo(key, compute): per-layer slot scores of this context's prefix stored under `key`, computed
# by `compute` on the first ask
ScoreMemo = Callable[[Hashable, Callable[[], list[torch.Tensor]]], list[torch.Tensor]]


@dataclass
class ModelContext:
    runner: ModelRunner
    token_ids: Sequence[int]  # the tokens the full KV holds
    tokenizer: object | None = None  # for methods that prompt the model (KVzip)
    score_memo: ScoreMemo | None = None  # where scores outlive one compression (prefix_caches.py)

    @property
    def num_heads(self) -> int:
        return self.runner.config.num_heads

    def remembered_scores(
        self, key: Hashable, compute: Callable[[], list[torch.Tensor]]
    ) -> list[torch.Tensor]:
        """Per-layer slot scores that depend on the prefix and `key` alone, not on how many
        slots are kept. Where the context has a memo (the engine's prefix store), a prefix
        compressed at several ratios, alone or composed with a quantizer, is scored once: for
        KVzip the scoring is most of the cost (a replay of the whole prefix)."""
        if self.score_memo is None:
            return compute()
        return self.score_memo(key, compute)

    def observe(
        self,
        full: KVCache,
        start: int,
        token_ids: Sequence[int],
        observer: QueryObserver,
        chunk_size: int = DEFAULT_PREFILL_CHUNK,
    ) -> None:
        """Feeds `token_ids` after the first `start` tokens of `full` (on a copy: `full` is left
        unchanged) and hands every layer's queries to `observer`, chunk by chunk."""
        cache = full.clone(capacity=start + len(token_ids))
        cache.truncate(start)
        ids = torch.tensor(list(token_ids), dtype=torch.long)
        for begin in range(0, ids.numel(), chunk_size):
            chunk = SequenceInput(ids[begin : begin + chunk_size], cache, 0, observer)
            self.runner.forward([chunk])
