"""One copy of each prefix's KV per worker, held read-only for the sessions that use it.

A worker keeps its prefixes' caches in `SharedPrefixes`, within a byte budget. A session acquires
its prefix when it opens and releases it when it closes: the copy held already, or one made once
by the loader it passes (a load from the full-KV store, checked there by its digests; a fetch over
the link). While any session holds a prefix it is pinned; unpinned copies stay, least recently
used first out, until a load needs their room. Acquiring a prefix that is loading waits for that
one load, so sessions opened at once read the store once.

What a session holds of its own is the rest: it reads the shared copy, never writes it (a cache
for its own tokens is built from it, `KVCache.clone`).

Where pins fill the budget, a new prefix is loaded for its session alone and dropped when that
session releases it (`HeldPrefix.is_shared` False): the request is served as it would be without
sharing, and counted. A prefix larger than the whole budget is refused (`PrefixBudgetError`,
RESOURCE_EXHAUSTED), before anything is loaded where its size is known.

A prefix deleted while sessions use it is retired: no new session gets it, and its copy is freed
with the last release.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from vericache.errors import QueueFullError


class PrefixBudgetError(QueueFullError):
    """A prefix's KV is larger than the whole budget a worker holds prefixes in."""


class Sized(Protocol):
    @property
    def nbytes(self) -> int: ...


C = TypeVar("C", bound=Sized)


@dataclass(eq=False)
class HeldPrefix(Generic[C]):
    """A prefix's copy, and who holds it."""

    key: Hashable
    cache: C  # read-only to every session
    is_shared: bool = True  # False: loaded for one session where pins left no room
    num_sessions: int = 0
    is_retired: bool = False

    @property
    def nbytes(self) -> int:
        return self.cache.nbytes


@dataclass(frozen=True)
class PrefixCacheStats:
    """What a worker holds, for its metrics."""

    budget_bytes: int
    num_prefixes: int
    resident_bytes: int
    sessions_per_prefix: tuple[int, ...]  # of each held prefix, most recently used last
    num_loads: int  # prefixes loaded since the start (each a store read or a fetch)
    num_unshared: int  # of those, loaded for one session alone (pins left no room)


@dataclass
class SharedPrefixes(Generic[C]):
    budget_bytes: int
    _held: OrderedDict[Hashable, HeldPrefix[C]] = field(default_factory=OrderedDict)
    _loading: dict[Hashable, threading.Event] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    num_loads: int = 0
    num_unshared: int = 0

    def __post_init__(self):
        if self.budget_bytes < 1:
            raise ValueError(
                f"a prefix cache needs a budget of 1 byte or more, not {self.budget_bytes}"
            )

    def acquire(
        self, key: Hashable, load: Callable[[], C], nbytes: int | None = None
    ) -> HeldPrefix[C]:
        """The prefix's copy, pinned for the caller until `release`; loaded once with `load`
        where no copy is held. `nbytes`: its size, where known before loading."""
        if nbytes is not None:
            self._check_fits(nbytes)
        while True:
            with self._lock:
                held = self._held.get(key)
                if held is not None and not held.is_retired:
                    return self._pin(held)
                loading = self._loading.get(key)
                if loading is None:
                    self._loading[key] = threading.Event()
                    break
            loading.wait()  # another session loads it: take that copy
        try:
            cache = load()
        finally:
            with self._lock:
                self._loading.pop(key).set()
        return self._admit(key, cache)

    def acquire_held(self, key: Hashable) -> HeldPrefix[C] | None:
        """The prefix's copy, pinned for the caller until `release`, where one is held complete;
        None where none is (or one is still loading): nothing is loaded."""
        with self._lock:
            held = self._held.get(key)
            if held is None or held.is_retired:
                return None
            return self._pin(held)

    def keys(self) -> list[Hashable]:
        """The keys of the complete, unretired copies held, least recently used first."""
        with self._lock:
            return [key for key, held in self._held.items() if not held.is_retired]

    def holds(self, key: Hashable) -> bool:
        """Whether a complete, unretired copy of the prefix is held."""
        with self._lock:
            held = self._held.get(key)
            return held is not None and not held.is_retired

    def release(self, held: HeldPrefix[C]) -> None:
        with self._lock:
            held.num_sessions -= 1
            if held.num_sessions == 0 and (held.is_retired or not held.is_shared):
                self._drop(held)

    def retire(self, key: Hashable) -> None:
        """No new session gets this prefix; its copy goes with the last release."""
        with self._lock:
            held = self._held.get(key)
            if held is not None:
                held.is_retired = True
                if held.num_sessions == 0:
                    self._drop(held)

    def stats(self) -> PrefixCacheStats:
        with self._lock:
            held = list(self._held.values())
            return PrefixCacheStats(
                self.budget_bytes, len(held), sum(h.nbytes for h in held),
                tuple(h.num_sessions for h in held), self.num_loads, self.num_unshared,
            )  # fmt: skip

    # --- Internals ------------------------------------------------------------------------------

    def _check_fits(self, nbytes: int) -> None:
        if nbytes > self.budget_bytes:
            raise PrefixBudgetError(
                f"the prefix's KV ({nbytes / 2**20:.0f} MiB) is larger than this worker's prefix "
                f"cache ({self.budget_bytes / 2**20:.0f} MiB): raise --prefix-cache-bytes (a "
                "verifier's) or --drafter-cache-bytes (a drafter's)"
            )

    def _admit(self, key: Hashable, cache: C) -> HeldPrefix[C]:
        self._check_fits(cache.nbytes)
        with self._lock:
            self.num_loads += 1
            if not self._make_room(cache.nbytes):
                self.num_unshared += 1
                return self._pin(HeldPrefix(key, cache, is_shared=False))
            held = HeldPrefix(key, cache)
            self._held[key] = held
            return self._pin(held)

    def _make_room(self, nbytes: int) -> bool:
        """Drops unpinned copies, least recently used first, until `nbytes` fit; whether they do."""
        used = sum(h.nbytes for h in self._held.values())
        for held in list(self._held.values()):
            if used + nbytes <= self.budget_bytes:
                break
            if held.num_sessions == 0:
                self._drop(held)
                used -= held.nbytes
        return used + nbytes <= self.budget_bytes

    def _pin(self, held: HeldPrefix[C]) -> HeldPrefix[C]:
        held.num_sessions += 1
        if held.is_shared:
            self._held.move_to_end(held.key)
        return held

    def _drop(self, held: HeldPrefix[C]) -> None:
        if self._held.get(held.key) is held:
            del self._held[held.key]
