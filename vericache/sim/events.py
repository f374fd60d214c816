"""The discrete-event core: a clock, devices that run one piece of work at a time, and links that
move bytes.

Time advances only from event to event. Events at the same instant run in the order they were
scheduled, so a run is deterministic. A `Device` runs the work submitted to it one item at a time
in submission order (a GPU running one forward after another); a `Link` moves one transfer at a
time in arrival order at its bandwidth and delivers each `latency_s` after its last byte left
(a store-to-verifier path, PCIe, the slow network to remote drafters); background transfers move
in slices only while no foreground one waits, so they delay a foreground one by a slice at most.
Both keep the accounts the
tests check: busy seconds equal the work done, bytes delivered plus bytes in flight equal bytes
sent, and no queue goes below empty.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from vericache.errors import InvalidRequestError

Action = Callable[[], None]


class SimulationError(RuntimeError):
    """The simulation's own accounts broke: a bug, never bad input."""


class Simulation:
    def __init__(self):
        self.now = 0.0
        self._events: list[tuple[float, int, Action]] = []
        self._order = itertools.count()
        self.num_events = 0

    def at(self, time: float, action: Action) -> None:
        """Runs `action` at `time` (not before now)."""
        if time < self.now:
            raise SimulationError(f"an event at {time} s was scheduled at {self.now} s")
        heapq.heappush(self._events, (time, next(self._order), action))

    def after(self, delay_s: float, action: Action) -> None:
        if delay_s < 0:
            raise SimulationError(f"a negative delay: {delay_s} s")
        self.at(self.now + delay_s, action)

    def run(self, until: float | None = None, max_events: int = 10_000_000) -> None:
        """Runs events in time order until none is left, the next is past `until` (the clock then
        stops at `until`), or `max_events` have run (a guard against a run that never ends)."""
        while self._events:
            time, _, action = self._events[0]
            if until is not None and time > until:
                self.now = until
                return
            if self.num_events >= max_events:
                raise SimulationError(f"more than {max_events} events: the run does not end")
            heapq.heappop(self._events)
            self.now = time
            self.num_events += 1
            action()
        if until is not None:
            self.now = max(self.now, until)

    @property
    def is_idle(self) -> bool:
        return not self._events


@dataclass
class _Work:
    seconds: float
    done: Action
    submitted_s: float


class Device:
    """Runs submitted work one item at a time, first submitted first."""

    def __init__(self, sim: Simulation, name: str):
        self.sim = sim
        self.name = name
        self._queue: deque[_Work] = deque()
        self._running: _Work | None = None
        self.busy_s = 0.0  # seconds of work finished
        self.wait_s = 0.0  # seconds work spent queued before it started, summed
        self.num_done = 0

    def submit(self, seconds: float, done: Action) -> None:
        """Queues `seconds` of work; `done` runs when it finishes."""
        if not seconds >= 0:
            raise InvalidRequestError(f"{self.name}: work of {seconds} s")
        self._queue.append(_Work(seconds, done, self.sim.now))
        if self._running is None:
            self._start_next()

    @property
    def queue_length(self) -> int:
        """Items waiting to start (the one running not counted)."""
        return len(self._queue)

    @property
    def is_busy(self) -> bool:
        return self._running is not None

    def utilization(self) -> float:
        return self.busy_s / self.sim.now if self.sim.now else 0.0

    def _start_next(self) -> None:
        work = self._queue.popleft()
        self._running = work
        self.wait_s += self.sim.now - work.submitted_s
        self.sim.after(work.seconds, self._finish)

    def _finish(self) -> None:
        work, self._running = self._running, None
        if work is None:
            raise SimulationError(f"{self.name} finished work it was not running")
        self.busy_s += work.seconds
        self.num_done += 1
        if self._queue:
            self._start_next()
        work.done()


@dataclass
class _Transfer:
    nbytes: int
    delivered: Action
    num_moved: int = 0  # of a background transfer: the bytes its slices have moved


# A background transfer's slice: what a foreground transfer may have to wait behind (about 50 ms
# on a 1.2 GB/s network).
BACKGROUND_SLICE_BYTES = 64 << 20


class Link:
    """Moves transfers one at a time, first sent first, at `bytes_per_s`; each arrives
    `latency_s` after its last byte left."""

    def __init__(self, sim: Simulation, name: str, bytes_per_s: float, latency_s: float = 0.0):
        if not bytes_per_s > 0 or latency_s < 0:
            raise InvalidRequestError(f"{name}: bandwidth must be > 0 and latency >= 0")
        self.sim = sim
        self.name = name
        self.bytes_per_s = bytes_per_s
        self.latency_s = latency_s
        self._queue: deque[_Transfer] = deque()
        self._background: deque[_Transfer] = deque()
        self._sending = False
        self.bytes_sent = 0  # handed to the link
        self.bytes_delivered = 0
        self.busy_s = 0.0  # seconds the link spent moving bytes
        self.background_busy_s = 0.0  # of which, background slices
        self._bytes_moved = 0  # of transfers (or slices) whose last byte has left
        self._current: tuple[float, int] | None = None  # (start, bytes) of the one moving now
        self._queued_foreground_bytes = 0

    def send(self, nbytes: int, delivered: Action, background: bool = False) -> None:
        """Queues `nbytes`; `delivered` runs when the last of them has arrived. A background
        transfer moves only while no foreground one waits."""
        if nbytes < 0:
            raise InvalidRequestError(f"{self.name}: a transfer of {nbytes} bytes")
        self.bytes_sent += nbytes
        if background:
            self._background.append(_Transfer(nbytes, delivered))
        else:
            self._queue.append(_Transfer(nbytes, delivered))
            self._queued_foreground_bytes += nbytes
        if not self._sending:
            self._start_next()

    def foreground_wait_s(self) -> float:
        """How long a foreground transfer sent now waits before its first byte leaves: the
        transfer (or slice) moving now, and the foreground ones queued."""
        current = 0.0
        if self._current is not None:
            start, nbytes = self._current
            current = max(0.0, start + nbytes / self.bytes_per_s - self.sim.now)
        return current + self._queued_foreground_bytes / self.bytes_per_s

    def backlog_s(self) -> float:
        """How long the link stays busy with what it holds now, background transfers included."""
        background = sum(t.nbytes - t.num_moved for t in self._background)
        return self.foreground_wait_s() + background / self.bytes_per_s

    @property
    def bytes_in_flight(self) -> int:
        return self.bytes_sent - self.bytes_delivered

    @property
    def bytes_moved(self) -> int:
        """Bytes that have left so far, the transfer moving now counted as far as it has gone:
        the link's traffic as a rate over time shows it, not lumps at each arrival."""
        if self._current is None:
            return self._bytes_moved
        start, nbytes = self._current
        return self._bytes_moved + min(nbytes, int((self.sim.now - start) * self.bytes_per_s))

    def seconds_for(self, nbytes: int) -> float:
        """How long `nbytes` take on an idle link, latency included."""
        return nbytes / self.bytes_per_s + self.latency_s

    def _start_next(self) -> None:
        if self._queue:
            transfer = self._queue.popleft()
            self._queued_foreground_bytes -= transfer.nbytes
            nbytes, is_last = transfer.nbytes, True
        else:
            transfer = self._background[0]
            nbytes = min(BACKGROUND_SLICE_BYTES, transfer.nbytes - transfer.num_moved)
            transfer.num_moved += nbytes
            is_last = transfer.num_moved >= transfer.nbytes
            if is_last:
                self._background.popleft()
            self.background_busy_s += nbytes / self.bytes_per_s
        self._sending = True
        seconds = nbytes / self.bytes_per_s
        self.busy_s += seconds
        self._current = (self.sim.now, nbytes)
        self.sim.after(seconds, lambda: self._sent(transfer, nbytes, is_last))

    def _sent(self, transfer: _Transfer, nbytes: int, is_last: bool) -> None:
        self._sending = False
        self._current = None
        self._bytes_moved += nbytes
        if self._queue or self._background:
            self._start_next()
        if is_last:
            self.sim.after(self.latency_s, lambda: self._arrive(transfer))

    def _arrive(self, transfer: _Transfer) -> None:
        self.bytes_delivered += transfer.nbytes
        if self.bytes_delivered > self.bytes_sent:
            raise SimulationError(f"{self.name} delivered more bytes than it was sent")
        transfer.delivered()
