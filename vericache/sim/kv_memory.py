"""A device's (or worker's) KV memory in the simulator, as a paged server manages it."""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from vericache.errors import InvalidRequestError
from vericache.sim.events import Link


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

    def __init__(self, capacity_bytes: int, link: Link | None = None, caches_prefixes: bool = True):
        self.capacity_bytes = capacity_bytes
        self.link = link
        self.caches_prefixes = caches_prefixes  # False: a prefix goes when its last session does
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
        if session.own_bytes + session.prefix_bytes > self.capacity_bytes:
            raise InvalidRequestError(
                f"a session needs {session.own_bytes + session.prefix_bytes} bytes of KV, more "
                f"than a worker's {self.capacity_bytes}: raise tensor_parallel or shorten it"
            )
        self._waiting.append((session, then))
        self._admit_waiting()

    def release(self, session: Session) -> None:
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
            else:
                self._refs[session.prefix] = self._refs.get(session.prefix, 0) + 1
                self._ensure(session, then)
            self.peak_bytes = max(self.peak_bytes, self.used_bytes)

    def _make_room(self, session: Session) -> bool:
        """Evicts unreferenced prefixes, least recent first, until the session fits; whether it
        does."""
        needed = session.own_bytes
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
        if prefix in self._fetching:
            self._fetching[prefix].append(then)
        elif prefix in self._held:
            self._held.move_to_end(prefix)
            then()
        else:
            self._held[prefix] = session.prefix_bytes
            self._fetching[prefix] = [then]
            self.link.send(session.prefix_bytes, lambda: self._arrived(prefix))

    def _arrived(self, prefix: Hashable) -> None:
        for then in self._fetching.pop(prefix):
            then()
