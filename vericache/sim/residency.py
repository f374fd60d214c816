"""A VeriCache verifier's full KV in the simulator, kept as serve/workers/residency.py keeps it: at
most a budget of sessions' own full KV on the device (what each holds past the blocks of its prefix
that it reads in place from the worker's shared copy, kv_memory.WorkerMemory), held after a call
until another needs the room (least recently used first, never one in use). The next call of a
session dropped meanwhile rebuilds its cache over the shared copy, reading nothing from the store:
it waits only for room, while the full KV in use leaves none."""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field


@dataclass
class _Session:
    full_bytes: int  # its own full KV on the device: past its prefix's shared blocks
    is_resident: bool = False
    is_waiting: bool = False  # for room to be rebuilt in
    num_users: int = 0  # calls holding it on the device (in use, or pinned by a load ahead)
    on_resident: list[Callable[[], None]] = field(default_factory=list)


class SimResidency:
    def __init__(self, budget_bytes: int):
        self.budget_bytes = budget_bytes
        self.peak_bytes = 0
        self._sessions: OrderedDict[Hashable, _Session] = OrderedDict()  # least recent first
        self._waiting: deque[Hashable] = deque()  # sessions waiting for room

    def open(self, key: Hashable, full_bytes: int) -> None:
        self._sessions[key] = _Session(full_bytes)

    def close(self, key: Hashable) -> None:
        """The session ended (no call holds it): its full KV leaves the device."""
        del self._sessions[key]
        self._admit_waiting()

    def use(self, key: Hashable, then: Callable[[], None]) -> None:
        """Runs `then` once the session's full KV is on the device, held there until `release`:
        at once if it is or there is room for it, else when room frees."""
        session = self._sessions[key]
        self._sessions.move_to_end(key)
        session.num_users += 1
        if session.is_resident:
            then()
            return
        session.on_resident.append(then)
        if not session.is_waiting:
            session.is_waiting = True
            self._waiting.append(key)
            self._admit_waiting()

    def release(self, key: Hashable) -> None:
        self._sessions[key].num_users -= 1
        self._admit_waiting()

    @property
    def held_bytes(self) -> int:
        """Full KV on the device."""
        return sum(s.full_bytes for s in self._sessions.values() if s.is_resident)

    def _admit_waiting(self) -> None:
        """Makes every waiting session that fits resident, in the order they came (one fits an
        empty device). One that does not fit holds up none behind it: each of the served
        verifier's waiters checks for its own room, and holding a smaller session behind a larger
        one can deadlock a scheduled batch (its other session pinned, its room never freed)."""
        ready = []
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
            session.is_waiting, session.is_resident = False, True
            self.peak_bytes = max(self.peak_bytes, self.held_bytes)
            ready.append(session)
        for session in ready:  # after the loop: their calls may make others wait or resident
            waiters, session.on_resident = session.on_resident, []
            for then in waiters:
                then()

    def _evict(self, num_bytes: int) -> None:
        """Drops the full KV of idle sessions, least recently used first, until `num_bytes` are
        free (their own tokens' KV stays, outside the budget)."""
        for session in self._sessions.values():
            if num_bytes <= 0:
                return
            if session.is_resident and not session.num_users:
                session.is_resident = False
                num_bytes -= session.full_bytes
