"""A VeriCache verifier's full KV in the simulator, kept as serve/residency.py keeps it: at most a
budget of sessions' full KV on the device, held after a call until another needs the room (least
recently used first, never one in use), and loaded again from the store by the next call that
needs it. A load waits while the full KV in use or loading leaves no room for it."""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

from vericache.sim.kv_memory import Inbound


@dataclass
class _Session:
    full_bytes: int  # its full KV on the device: the prefix's and its own tokens'
    load_bytes: int  # what a load moves from the store: the prefix's
    is_resident: bool = False
    is_waiting: bool = False  # for room to load in
    is_loading: bool = False
    num_users: int = 0  # calls holding it on the device (in use, or pinned by a load ahead)
    on_loaded: list[Callable[[], None]] = field(default_factory=list)


class SimResidency:
    def __init__(self, budget_bytes: int, link: Inbound):
        self.budget_bytes = budget_bytes
        self.link = link  # from the store to the device
        self.peak_bytes = 0
        self._sessions: OrderedDict[Hashable, _Session] = OrderedDict()  # least recent first
        self._waiting: deque[Hashable] = deque()  # sessions whose load waits for room

    def open(self, key: Hashable, full_bytes: int, load_bytes: int) -> None:
        self._sessions[key] = _Session(full_bytes, load_bytes)

    def close(self, key: Hashable) -> None:
        """The session ended (no call holds it): its full KV leaves the device."""
        del self._sessions[key]
        self._admit_waiting()

    def use(self, key: Hashable, then: Callable[[], None]) -> None:
        """Runs `then` once the session's full KV is on the device, held there until `release`:
        at once if it is, else when its load has arrived."""
        session = self._sessions[key]
        self._sessions.move_to_end(key)
        session.num_users += 1
        if session.is_resident:
            then()
            return
        session.on_loaded.append(then)
        if not (session.is_waiting or session.is_loading):
            session.is_waiting = True
            self._waiting.append(key)
            self._admit_waiting()

    def release(self, key: Hashable) -> None:
        self._sessions[key].num_users -= 1
        self._admit_waiting()

    @property
    def held_bytes(self) -> int:
        """Full KV on the device or on its way there."""
        return sum(s.full_bytes for s in self._sessions.values() if s.is_resident or s.is_loading)

    def _admit_waiting(self) -> None:
        """Starts every waiting load that fits, in the order they came (a load fits an empty
        device). One that does not fit holds up none behind it: each of the served verifier's
        waiters checks for its own room, and holding a smaller load behind a larger one can
        deadlock a scheduled batch (its other session pinned, its room never freed)."""
        for key in list(self._waiting):
            session = self._sessions.get(key)
            if session is None:  # closed while it waited
                self._waiting.remove(key)
                continue
            self._evict(self.held_bytes + session.full_bytes - self.budget_bytes)
            held = self.held_bytes
            if held + session.full_bytes > self.budget_bytes and held > 0:
                continue
            self._waiting.remove(key)
            session.is_waiting, session.is_loading = False, True
            self.peak_bytes = max(self.peak_bytes, self.held_bytes)
            self.link.send(session.load_bytes, lambda s=session: self._loaded(s))

    def _evict(self, num_bytes: int) -> None:
        """Drops the full KV of idle sessions, least recently used first, until `num_bytes` are
        free (their own tokens' KV stays, outside the budget)."""
        for session in self._sessions.values():
            if num_bytes <= 0:
                return
            if session.is_resident and not session.num_users:
                session.is_resident = False
                num_bytes -= session.full_bytes

    def _loaded(self, session: _Session) -> None:
        session.is_loading, session.is_resident = False, True
        waiters, session.on_loaded = session.on_loaded, []
        for then in waiters:
            then()
