"""A closed loop of clients, as a load generator runs one: `concurrency` sessions in flight, the
next starting as one ends; and, where a benchmark serves one, an untimed first wave of sessions
served to its end before the rest start, so that the rest meet warm caches and empty workers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

Session = TypeVar("Session")


class ClosedLoop(Generic[Session]):
    def __init__(
        self,
        sessions: list[Session],
        concurrency: int,
        start: Callable[[Session], None],
        wave: int = 0,
    ):
        self._pending = list(reversed(sessions))  # the next on top
        self.concurrency = concurrency
        self._start = start
        # Of the untimed first wave: its sessions not yet started, and not yet ended.
        self._wave_unstarted = self._wave_unfinished = wave

    def begin(self) -> None:
        for _ in range(self.concurrency):
            self._start_next()

    def ended(self) -> bool:
        """A session ended: the next starts, or where it was the first wave's last, the rest's
        first `concurrency`. Returns whether it was."""
        if self._wave_unfinished:
            self._wave_unfinished -= 1
            if not self._wave_unfinished:
                self.begin()
                return True
        self._start_next()
        return False

    def _start_next(self) -> None:
        if self._wave_unfinished and not self._wave_unstarted:
            return  # the wave's last session starts the rest as it ends
        self._wave_unstarted = max(0, self._wave_unstarted - 1)
        if self._pending:
            self._start(self._pending.pop())
