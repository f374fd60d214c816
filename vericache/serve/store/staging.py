"""Full KV of prefixes being registered, kept by the verifier between a registration's calls.

PutPrefix runs as three verifier calls (prefill, store, compress) so that each stage is reported;
the prefilled full KV waits here from the first to the last. A registration abandoned in between
(client cancel, deadline) never comes back for its entry, so entries expire `ttl_s` after their
last use and at most `max_entries` are kept, the least recently used dropped first. Dropping an
entry early is always safe: its registration prefills again or loads the stored KV.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from vericache.kv.cache import KVCache

TokenKey = tuple[str, tuple[int, ...]]  # (the registering tenant, the prefix's token ids)


@dataclass
class _Entry:
    cache: KVCache
    last_used: float  # by the clock of StagedPrefixes


class StagedPrefixes:
    def __init__(self, max_entries: int, ttl_s: float, clock: Callable[[], float] = time.monotonic):
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self._clock = clock
        self._entries: OrderedDict[TokenKey, _Entry] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()  # registrations of different prefixes run concurrently

    def put(self, token_ids: TokenKey, cache: KVCache) -> None:
        with self._lock:
            self._entries[token_ids] = _Entry(cache, self._clock())
            self._entries.move_to_end(token_ids)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)

    def get(self, token_ids: TokenKey) -> KVCache | None:
        """The staged full KV, which stays staged (and counts as used now)."""
        with self._lock:
            entry = self._entries.get(token_ids)
            if entry is None:
                return None
            entry.last_used = self._clock()
            self._entries.move_to_end(token_ids)
            return entry.cache

    def take(self, token_ids: TokenKey) -> KVCache | None:
        """Removes and returns the staged full KV."""
        with self._lock:
            entry = self._entries.pop(token_ids, None)
            return None if entry is None else entry.cache

    def expire(self) -> int:
        """Drops the entries unused for `ttl_s`; returns how many."""
        with self._lock:
            deadline = self._clock() - self.ttl_s
            stale = [key for key, entry in self._entries.items() if entry.last_used <= deadline]
            for key in stale:
                del self._entries[key]
            return len(stale)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(entry.cache.nbytes for entry in self._entries.values())
