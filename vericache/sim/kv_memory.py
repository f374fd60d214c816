"""A device's (or worker's) KV memory in the simulator, as a paged server manages it."""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, replace
from typing import Protocol

from vericache.errors import InvalidRequestError


class Inbound(Protocol):
    """Where a worker's prefixes come from: a link (events.Link), or one whose arrivals also cost
    the worker's device time."""

    def send(self, nbytes: int, delivered: Callable[[], None]) -> None: ...


@dataclass(frozen=True)
class Session:
    """What a session holds on a worker: a prefix, shared, and KV of its own."""

    prefix: Hashable | None  # None: none to share (its own bytes hold all it needs)
    prefix_bytes: int
    own_bytes: int  # its suffix and output, and its own copy of anything it does not share


class WorkerMemory:
    """A worker's KV memory as a paged server manages it (vLLM's and SGLang's prefix caching): a
    prefix is held once and shared by the sessions over it, held on after the last of them ends
    (least recently used evicted first when room is needed), and fetched once however many
    sessions wait for it. A session is admitted when its own KV and its prefix, unless held,
    fit beside what is referenced, first come first served (no one overtakes a waiting session);
    its `then` runs once its prefix has arrived. A memory without a link serves sessions that
    share no prefix."""

    def __init__(
        self,
        capacity_bytes: int,
        link: Inbound | None = None,
        caches_prefixes: bool = True,
        lru_bytes: int | None = None,
    ):
        self.capacity_bytes = capacity_bytes
        self.link = link
        self.caches_prefixes = caches_prefixes  # False: a prefix goes when its last session does
        # None: sessions share the prefix they are over (above). A number: each session holds its
        # own copy of its prefix, made from an LRU of the prefixes fetched, of at most that many
        # bytes (VeriCache's drafter, whose LRU is DrafterConfig.kv_cache_bytes; 0: no LRU, every
        # session fetches, as VeriCache's verifier loads each session's prefix from the store).
        self.lru_bytes = lru_bytes
        self.peak_bytes = 0
        self._own_bytes = 0  # of admitted sessions
        self._held: OrderedDict[Hashable, int] = (
            OrderedDict()
        )  # prefix -> bytes, arrived or fetching
        self._refs: dict[Hashable, int] = {}  # prefix -> sessions admitted over it
        self._fetching: dict[Hashable, list[Callable[[], None]]] = {}
        self._waiting: deque[tuple[Session, Callable[[], None]]] = deque()

    @property
    def used_bytes(self) -> int:
        return self._own_bytes + sum(self._held.values())

    def admit(self, session: Session, then: Callable[[], None]) -> None:
        needed = session.own_bytes + session.prefix_bytes
        if needed > self.capacity_bytes:
            raise InvalidRequestError(
                f"a session needs {needed} bytes of KV, more than a worker's "
                f"{self.capacity_bytes}: raise tensor_parallel or shorten it"
            )
        if self._is_private(session):  # its copy of the prefix is its own
            session = replace(session, own_bytes=needed)
        self._waiting.append((session, then))
        self._admit_waiting()

    def release(self, session: Session) -> None:
        if self._is_private(session):
            self._own_bytes -= session.own_bytes + session.prefix_bytes
            self._admit_waiting()
            return
        self._own_bytes -= session.own_bytes
        if session.prefix is not None:
            self._refs[session.prefix] -= 1
            if not self.caches_prefixes and not self._refs[session.prefix]:
                del self._held[session.prefix], self._refs[session.prefix]
        self._admit_waiting()

    def holds(self, prefix: Hashable) -> bool:
        return prefix in self._held and prefix not in self._fetching

    def _admit_waiting(self) -> None:
        while self._waiting and self._make_room(self._waiting[0][0]):
            session, then = self._waiting.popleft()
            self._own_bytes += session.own_bytes
            if session.prefix is None:
                then()
            elif self._is_private(session):
                self._copy_from_lru(session.prefix, session.prefix_bytes, then)
            else:
                self._refs[session.prefix] = self._refs.get(session.prefix, 0) + 1
                self._ensure(session, then)
            self.peak_bytes = max(self.peak_bytes, self.used_bytes)

    def _make_room(self, session: Session) -> bool:
        """Evicts unreferenced prefixes, least recent first, until the session fits; whether it
        does."""
        needed = session.own_bytes
        if self._is_private(session):
            self._evict_lru(self.used_bytes + needed - self.capacity_bytes)
            return self.used_bytes + needed <= self.capacity_bytes
        if session.prefix is not None and session.prefix not in self._held:
            needed += session.prefix_bytes
        for prefix in list(self._held):
            if self.used_bytes + needed <= self.capacity_bytes:
                break
            if not self._refs.get(prefix) and prefix != session.prefix:
                del self._held[prefix]
        return self.used_bytes + needed <= self.capacity_bytes

    def _ensure(self, session: Session, then: Callable[[], None]) -> None:
        prefix = session.prefix

        def fetch() -> None:  # held from now on: its bytes are reserved while it arrives
            self._held[prefix] = session.prefix_bytes
            self.link.send(session.prefix_bytes, lambda: self._arrived(prefix))

        self._when_held(prefix, then, fetch)

    def _when_held(self, prefix: Hashable, then: Callable[[], None], fetch) -> None:
        """Runs `then` once `prefix` is held: at once, when the fetch on its way arrives, or
        after a fetch `fetch` starts (whose arrival calls `_arrived`)."""
        if prefix in self._fetching:
            self._fetching[prefix].append(then)
        elif prefix in self._held:
            self._held.move_to_end(prefix)
            then()
        else:
            self._fetching[prefix] = [then]
            fetch()

    def _arrived(self, prefix: Hashable) -> None:
        for then in self._fetching.pop(prefix):
            then()

    # --- Private copies from an LRU (lru_bytes set) -----------------------------------------------

    def _is_private(self, session: Session) -> bool:
        return self.lru_bytes is not None and session.prefix is not None

    def _copy_from_lru(self, prefix: Hashable, num_bytes: int, then: Callable[[], None]) -> None:
        """The session's copy of its prefix: at once from the LRU, else once its fetch (its own,
        or one already on the way) has arrived; a fetched prefix joins the LRU if it fits.
        Without an LRU every session makes its own fetch, as each verifier session loads its own
        copy from the store."""
        if not self.lru_bytes:
            self.link.send(num_bytes, then)
            return

        def fetch() -> None:  # joins the LRU on arrival, if it fits
            self.link.send(num_bytes, lambda: self._arrived_for_lru(prefix, num_bytes))

        self._when_held(prefix, then, fetch)

    def _arrived_for_lru(self, prefix: Hashable, num_bytes: int) -> None:
        if num_bytes <= self.lru_bytes:
            self._evict_lru(sum(self._held.values()) + num_bytes - self.lru_bytes)
            room = self.capacity_bytes - self.used_bytes
            if num_bytes <= room:
                self._held[prefix] = num_bytes
        self._arrived(prefix)

    def _evict_lru(self, num_bytes: int) -> None:
        """Drops the least recently used prefixes of the LRU until `num_bytes` are free."""
        while num_bytes > 0 and self._held:
            _, freed = self._held.popitem(last=False)
            num_bytes -= freed
