"""A device's (or worker's) KV memory in the simulator, as a paged server manages it."""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Protocol

from vericache.errors import InvalidRequestError


class Inbound(Protocol):
    """Where a worker's prefixes come from: a link (events.Link), or one whose arrivals also cost
    the worker's device time."""

    def send(self, nbytes: int, delivered: Callable[[], None]) -> None: ...


class PrefixSource(Protocol):
    """Where a worker with more than one way to get a prefix gets it (host_tier.TieredFetch: its
    host memory, a prefill, or its link), and where the prefixes it evicts go."""

    def fetch(self, prefix: Hashable, nbytes: int, delivered: Callable[[], None]) -> None: ...

    def evicted(self, prefix: Hashable, nbytes: int) -> None: ...


@dataclass(frozen=True)
class Session:
    """What a session holds on a worker: a prefix, shared, and KV of its own."""

    prefix: Hashable | None  # None: none to share (its own bytes hold all it needs)
    prefix_bytes: int
    own_bytes: int  # its suffix and output: what it holds beside the prefix it reads


class WorkerMemory:
    """A worker's KV memory as a paged server manages it (vLLM's and SGLang's prefix caching,
    and VeriCache's workers, kv/shared_prefix.py): a prefix is held once and shared by the
    sessions over it, held on after the last of them ends (least recently used evicted first
    when room is needed), and fetched once however many sessions wait for it. A session is
    admitted when its own KV and its prefix, unless held, fit beside what is referenced, first
    come first served (no one overtakes a waiting session); its `then` runs once its prefix has
    arrived. A memory without a link serves sessions that share no prefix.

    `prefix_budget_bytes` (None: prefixes are held within the memory alone) bounds the prefixes
    held, as VeriCache's workers bound them apart from their sessions' own KV
    (VerifierConfig.prefix_cache_bytes, DrafterConfig.kv_cache_bytes): a new prefix evicts
    unreferenced ones for room within it, and where the referenced ones leave none, the session
    fetches a copy for itself alone, dropped when it ends, as SharedPrefixes serves it: from
    `source` where there is one (a node's host tier holding the prefix reads it from there, as a
    served drafter reads its tier's copy), else over the link.

    `source` (None: the link) fetches the prefixes it lacks and takes the ones it evicts.
    `clock` (None: not counted) times `blocked_s`, the seconds a session waited for room."""

    def __init__(
        self,
        capacity_bytes: int,
        link: Inbound | None = None,
        caches_prefixes: bool = True,
        prefix_budget_bytes: int | None = None,
        source: PrefixSource | None = None,
        clock: Callable[[], float] | None = None,
    ):
        self.capacity_bytes = capacity_bytes
        self.link = link
        self.caches_prefixes = caches_prefixes  # False: a prefix goes when its last session does
        self.prefix_budget_bytes = prefix_budget_bytes
        self.source = source
        self.clock = clock
        self.peak_bytes = 0
        self.blocked_s = 0.0  # seconds during which a session waited for room
        self._blocked_since: float | None = None
        self._own_bytes = 0  # of admitted sessions, with the copies held for one session alone
        self._held: OrderedDict[Hashable, int] = OrderedDict()  # prefix -> bytes, or fetching
        self._held_bytes = 0  # the sum of _held's values, kept as they change
        self._refs: dict[Hashable, int] = {}  # prefix -> sessions admitted over it
        self._fetching: dict[Hashable, list[Callable[[], None]]] = {}
        self._waiting: deque[tuple[Session, Callable[[], None]]] = deque()
        self._unshared: Counter[Session] = Counter()  # sessions holding a copy of their own
        self._device_only: set[Hashable] = set()  # held entries dropped, not spilled, on eviction

    @property
    def used_bytes(self) -> int:
        return self._own_bytes + self.held_prefix_bytes

    @property
    def held_prefix_bytes(self) -> int:
        """The shared prefixes held, or on their way."""
        return self._held_bytes

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def fits_now(self, session: Session) -> bool:
        """Whether the session would be admitted at once: none waits ahead of it, and it fits once
        unreferenced prefixes are evicted."""
        if self._waiting:
            return False
        needed = session.own_bytes
        if session.prefix is not None and session.prefix not in self._held:
            needed += session.prefix_bytes
        evictable = sum(size for prefix, size in self._held.items() if not self._refs.get(prefix))
        return self.used_bytes - evictable + needed <= self.capacity_bytes

    def offer(self, prefix: Hashable, nbytes: int, spills: bool = True) -> None:
        """Keeps a prefix that passed through the device (a warm node's full KV, read for a
        verification; a session's KV kept for its next turn) where it fits beside what is held
        and no session waits for room: unreferenced, evicted least recently used first as any
        other when room is needed, into `source` unless not `spills` (a cache the worker keeps
        on its device alone)."""
        if prefix in self._held or self._waiting or self.used_bytes + nbytes > self.capacity_bytes:
            return
        budget = self.prefix_budget_bytes
        if budget is not None and self.held_prefix_bytes + nbytes > budget:
            return
        self._hold(prefix, nbytes)
        if not spills:
            self._device_only.add(prefix)
        self.peak_bytes = max(self.peak_bytes, self.used_bytes)

    def touch(self, prefix: Hashable) -> None:
        self._held.move_to_end(prefix)

    def pin(self, key: Hashable) -> None:
        """Keeps a held entry from eviction until `unpin` (a full-KV turn reading the KV its
        session's turn before left here), as a session over it would."""
        if not self.holds(key):
            raise InvalidRequestError(f"{key} is not held: nothing to pin")
        self._refs[key] = self._refs.get(key, 0) + 1
        self.touch(key)

    def unpin(self, key: Hashable, drop: bool = False) -> None:
        """Lets a pinned entry be evicted again, or with `drop` lets it go now (without a host
        tier's copy: what replaces it holds its tokens) once no one else pins it."""
        self._refs[key] -= 1
        if drop and not self._refs[key]:
            self._drop(key)
            del self._refs[key]
            self._admit_waiting()

    def admit(self, session: Session, then: Callable[[], None]) -> None:
        needed = session.own_bytes + session.prefix_bytes
        if needed > self.capacity_bytes:
            raise InvalidRequestError(
                f"a session needs {needed} bytes of KV, more than a worker's "
                f"{self.capacity_bytes}: raise tensor_parallel or shorten it"
            )
        budget = self.prefix_budget_bytes
        if budget is not None and session.prefix_bytes > budget:
            raise InvalidRequestError(
                f"a prefix of {session.prefix_bytes} bytes of KV is larger than a worker's "
                f"prefix budget of {budget}"
            )
        self._waiting.append((session, then))
        self._admit_waiting()

    def release(self, session: Session) -> None:
        self._own_bytes -= session.own_bytes
        # Sessions are told apart by value: where equal ones hold both kinds, the copy of its
        # own goes first (it was made before the shared one was loaded, so likely ends first).
        if self._unshared[session]:
            self._unshared[session] -= 1
            self._own_bytes -= session.prefix_bytes
        elif session.prefix is not None:
            self._refs[session.prefix] -= 1
            if not self.caches_prefixes and not self._refs[session.prefix]:
                self._drop(session.prefix)
                del self._refs[session.prefix]
        self._admit_waiting()

    def holds(self, prefix: Hashable) -> bool:
        return prefix in self._held and prefix not in self._fetching

    def is_fetching(self, prefix: Hashable) -> bool:
        return prefix in self._fetching

    def _admit_waiting(self) -> None:
        while self._waiting and self._make_room(self._waiting[0][0]):
            self._admit(*self._waiting.popleft())
        self._count_blocked()

    def _admit(self, session: Session, then: Callable[[], None]) -> None:
        self._own_bytes += session.own_bytes
        if session.prefix is None:
            then()
        elif self._can_share(session):
            self._refs[session.prefix] = self._refs.get(session.prefix, 0) + 1
            self._ensure(session, then)
        else:  # the referenced prefixes fill the budget: a copy of its own, brought as a miss is
            self._unshared[session] += 1
            self._own_bytes += session.prefix_bytes
            self._fetch(session.prefix, session.prefix_bytes, then)
        self.peak_bytes = max(self.peak_bytes, self.used_bytes)

    def _count_blocked(self) -> None:
        if self.clock is None:
            return
        is_blocked = bool(self._waiting)
        if is_blocked and self._blocked_since is None:
            self._blocked_since = self.clock()
        elif not is_blocked and self._blocked_since is not None:
            self.blocked_s += self.clock() - self._blocked_since
            self._blocked_since = None

    def _make_room(self, session: Session) -> bool:
        """Evicts unreferenced prefixes, least recent first, until the session fits (its prefix,
        unless held, within the prefix budget if it can be); whether it does."""
        needed = session.own_bytes
        if session.prefix is not None and session.prefix not in self._held:
            needed += session.prefix_bytes
            if self.prefix_budget_bytes is not None:
                limit = self.prefix_budget_bytes - session.prefix_bytes
                self._evict(lambda: self.held_prefix_bytes <= limit, session.prefix)
        self._evict(lambda: self.used_bytes + needed <= self.capacity_bytes, session.prefix)
        return self.used_bytes + needed <= self.capacity_bytes

    def _evict(self, is_done: Callable[[], bool], keep: Hashable | None) -> None:
        for prefix in list(self._held):
            if is_done():
                return
            if not self._refs.get(prefix) and prefix != keep:
                spills = prefix not in self._device_only
                nbytes = self._drop(prefix)
                if self.source is not None and spills:
                    self.source.evicted(prefix, nbytes)

    def _hold(self, prefix: Hashable, nbytes: int) -> None:
        self._held[prefix] = nbytes
        self._held_bytes += nbytes

    def _drop(self, prefix: Hashable) -> int:
        self._device_only.discard(prefix)
        nbytes = self._held.pop(prefix)
        self._held_bytes -= nbytes
        return nbytes

    def _can_share(self, session: Session) -> bool:
        """Whether the session's prefix is held, or fits the prefix budget (`_make_room` made what
        room it could)."""
        budget = self.prefix_budget_bytes
        if session.prefix in self._held or budget is None:
            return True
        return self.held_prefix_bytes + session.prefix_bytes <= budget

    def _ensure(self, session: Session, then: Callable[[], None]) -> None:
        """Runs `then` once the session's prefix is held: at once, when the fetch on its way
        arrives, or after a fetch it starts."""
        prefix = session.prefix
        if prefix in self._fetching:
            self._fetching[prefix].append(then)
        elif prefix in self._held:
            self._held.move_to_end(prefix)
            then()
        else:  # held from now on: its bytes are reserved while it arrives
            self._fetching[prefix] = [then]
            self._hold(prefix, session.prefix_bytes)
            self._fetch(prefix, session.prefix_bytes, lambda: self._arrived(prefix))

    def _fetch(self, prefix: Hashable, nbytes: int, then: Callable[[], None]) -> None:
        """Brings a prefix the device lacks: from `source` (its host tier where it holds the
        prefix), else over the link."""
        if self.source is not None:
            self.source.fetch(prefix, nbytes, then)
        else:
            self.link.send(nbytes, then)

    def _arrived(self, prefix: Hashable) -> None:
        for then in self._fetching.pop(prefix):
            then()
