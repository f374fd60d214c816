"""Which waiting request runs next: resident prefixes first, with a bound on any request's wait.

The coordinator runs at most `max_running` requests and queues `max_waiting` more (past them a
request is refused, RESOURCE_EXHAUSTED). When a slot frees, a request whose prefix is resident on
the workers goes first: its KV is there already, so it costs no store read or link transfer, and
its rows join the forwards that read that prefix once for all of them (cascade attention). A
prefix counts as resident while a running request uses it, and for `RESIDENT_AFTER_S` after the
last one ended (the workers keep an unpinned copy until its room is needed). Nobody starves: a
request that has waited `max_skip_s` goes before every later one, resident or not.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field

from vericache.errors import QueueFullError

# How long after its last request a prefix is still taken to be on the workers.
RESIDENT_AFTER_S = 30.0


@dataclass(eq=False)
class _Waiter:
    prefix: str | None
    arrived: float
    admitted: asyncio.Future = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


class Admission:
    """Running slots for requests on their prefixes, handed out resident-first (one event loop)."""

    def __init__(self, max_running: int, max_waiting: int, max_skip_s: float):
        self.max_running = max_running
        self.max_waiting = max_waiting
        self.max_skip_s = max_skip_s
        self.num_running = 0
        self._waiting: list[_Waiter] = []  # in order of arrival
        self._running_on: Counter[str] = Counter()  # prefix -> running requests on it
        self._last_ended: dict[str, float] = {}  # prefix -> when its last request ended
        self.num_resident_first = 0  # admissions that went before an earlier arrival

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    async def admit(self, prefix: str | None) -> None:
        """Waits for a running slot for a request on `prefix` (None: no prefix); refuses when
        every slot and the queue are taken."""
        if self.num_running < self.max_running and not self._waiting:
            self._start(prefix)
            return
        if len(self._waiting) >= self.max_waiting:
            raise QueueFullError(
                f"{self.num_running} requests are running and {len(self._waiting)} waiting: "
                "retry later"
            )
        waiter = _Waiter(prefix, time.monotonic())
        self._waiting.append(waiter)
        try:
            await waiter.admitted
        except asyncio.CancelledError:
            if waiter in self._waiting:
                self._waiting.remove(waiter)
            elif waiter.admitted.done():  # admitted as it was cancelled: hand the slot on
                self.release(prefix)
            raise

    def release(self, prefix: str | None) -> None:
        """A running request on `prefix` ended: its slot goes to the next waiter."""
        self.num_running -= 1
        if prefix is not None:
            self._running_on[prefix] -= 1
            if not self._running_on[prefix]:
                del self._running_on[prefix]
                self._last_ended[prefix] = time.monotonic()
        while self._waiting and self.num_running < self.max_running:
            waiter = self._next()
            self._waiting.remove(waiter)
            self._start(waiter.prefix)
            waiter.admitted.set_result(None)

    def is_resident(self, prefix: str | None, now: float) -> bool:
        if prefix is None:
            return False
        ended = self._last_ended.get(prefix)
        return prefix in self._running_on or (ended is not None and now - ended < RESIDENT_AFTER_S)

    def _next(self) -> _Waiter:
        """The oldest waiter past its bound, else the oldest on a resident prefix, else the
        oldest."""
        now = time.monotonic()
        oldest = self._waiting[0]
        if now - oldest.arrived >= self.max_skip_s:
            return oldest
        for waiter in self._waiting:
            if self.is_resident(waiter.prefix, now):
                self.num_resident_first += waiter is not oldest
                return waiter
        return oldest

    def _start(self, prefix: str | None) -> None:
        self.num_running += 1
        if prefix is not None:
            self._running_on[prefix] += 1
        self._forget_old(time.monotonic())

    def _forget_old(self, now: float) -> None:
        for prefix, ended in list(self._last_ended.items()):
            if now - ended >= RESIDENT_AFTER_S or prefix in self._running_on:
                del self._last_ended[prefix]
