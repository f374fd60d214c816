"""Full and compressed KV of prompt prefixes already computed, reused by later requests.

A prefix is prefilled once and compressed once per compressor; requests that start with it clone
what they need. A compressor's slot scores that do not depend on its ratio are kept too
(prefix_caches.py). Entries are evicted least recently used first beyond `capacity_bytes`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Protocol, TypeVar


class Stored(Protocol):
    @property
    def nbytes(self) -> int: ...


Entry = TypeVar("Entry", bound=Stored)


class PrefixStore:
    def __init__(self, capacity_bytes: int):
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[Hashable, Stored] = OrderedDict()
        self.hits = 0
        self.misses = 0

    @property
    def nbytes(self) -> int:
        return sum(cache.nbytes for cache in self._entries.values())

    def lookup(self, key: Hashable, build: Callable[[], Entry]) -> Entry:
        """The cache stored under `key`, built (and stored) on the first request. The cache is
        shared: callers clone it before editing."""
        cache = self._entries.get(key)
        if cache is None:
            self.misses += 1
            cache = build()
            self._store(key, cache)
        else:
            self.hits += 1
            self._entries.move_to_end(key)
        return cache

    def _store(self, key: Hashable, cache: Stored) -> None:
        if cache.nbytes > self.capacity_bytes:
            return
        self._entries[key] = cache
        while self.nbytes > self.capacity_bytes:
            self._entries.popitem(last=False)
