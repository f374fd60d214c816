"""Where a request's caches over its prompt prefix come from (`PrefixCaches`, prefill.py).

`SharedPrefixes` (the engine's): the prefix store's KV, prefilled once and compressed once per
compressor, which every request on the prefix reads in place while holding its own tokens alone
(kv/prefixed.py). `OwnPrefixes` (the long-context engine's): the prefix prefilled into the
request's own full KV, and its compressed KV compressed from that, since shared KV would sit on
the device outside the long-context engine's budget. Both prefill through the same `Prefiller`:
the same chunks through the same kernels, so the two give the same bits.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, replace
from functools import partial

import torch

from vericache.compress.base import Compressor
from vericache.engine.prefill import Prefiller
from vericache.engine.prefix_store import PrefixStore
from vericache.engine.request import DecodeMode
from vericache.kv.cache import KVCache
from vericache.kv.compressed import CompressedKV
from vericache.kv.prefixed import shared_clone


class SharedPrefixes:
    def __init__(self, prefiller: Prefiller, store: PrefixStore):
        self.prefiller = prefiller
        self.store = store

    def caches(
        self, prefix_ids: tuple[int, ...], mode: DecodeMode, compressor: Compressor, capacity: int
    ) -> tuple[KVCache | None, CompressedKV | None]:
        full = None
        if mode is not DecodeMode.LOSSY:
            full = shared_clone(self.prefix_kv(prefix_ids), capacity)
        compressed = None
        if mode is not DecodeMode.FULL:
            compressed = shared_clone(self.compressed_prefix_kv(prefix_ids, compressor), 0)
        return full, compressed

    def compressed_prefix_kv(
        self, prefix_ids: tuple[int, ...], compressor: Compressor
    ) -> CompressedKV:
        """A prefix's KV compressed once per compressor, then reused. Shared: clone it to edit."""
        context = replace(
            self.prefiller.model_context(prefix_ids),
            score_memo=partial(self._remembered_scores, prefix_ids),
        )
        return self.store.lookup(
            (prefix_ids, compressor),
            lambda: compressor.compress(self.prefix_kv(prefix_ids), context),
        )

    def _remembered_scores(
        self,
        prefix_ids: tuple[int, ...],
        key: Hashable,
        compute: Callable[[], list[torch.Tensor]],
    ) -> list[torch.Tensor]:
        """A prefix's slot scores beside its KV in the store, evicted with the same LRU."""
        return self.store.lookup((prefix_ids, key), lambda: SlotScores(compute())).layers

    def prefix_kv(self, prefix_ids: tuple[int, ...]) -> KVCache:
        """The full KV of a prefix, prefilled once and then reused. Shared: clone it to edit."""

        return self.store.lookup(
            prefix_ids, lambda: self.prefiller.prefill_prefix(prefix_ids, len(prefix_ids))
        )


@dataclass(frozen=True)
class SlotScores:
    """A prefix's per-layer slot scores ([T, Hkv] each) as the prefix store holds them."""

    layers: list[torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(scores.nbytes for scores in self.layers)


class OwnPrefixes:
    def __init__(self, prefiller: Prefiller):
        self.prefiller = prefiller

    def caches(
        self, prefix_ids: tuple[int, ...], mode: DecodeMode, compressor: Compressor, capacity: int
    ) -> tuple[KVCache, CompressedKV | None]:
        full = self.prefiller.prefill_prefix(prefix_ids, capacity)
        if mode is DecodeMode.FULL:
            return full, None
        return full, compressor.compress(full, self.prefiller.model_context(prefix_ids))
