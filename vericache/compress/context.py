"""What a compressor may ask of the model: extra forward passes whose queries it observes."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from vericache.kv.cache import KVCache
from vericache.model.runner import DEFAULT_PREFILL_CHUNK, ModelRunner, SequenceInput

# observer(layer_index, query positions [n], rotated queries [n, Hq, D], the layer's KV after the
# new tokens were appended)
QueryObserver = Callable[[int, torch.Tensor, torch.Tensor, object], None]


@dataclass
class ModelContext:
    runner: ModelRunner
    token_ids: Sequence[int]  # the tokens the full KV holds
    tokenizer: object | None = None  # for methods that prompt the model (KVzip)

    @property
    def num_heads(self) -> int:
        return self.runner.config.num_heads

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
