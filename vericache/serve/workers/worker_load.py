"""How many requests a worker serves now, and over time: what `mode: auto` divides a request's
seconds per token by (auto_path.py).

A request's seconds per token reflect every request its worker served beside it while it ran, not
only those there when it started: a request that starts alone on a worker that then fills up
decodes at the full worker's pace. So the load a request is charged with is its worker's mean
over the request's life: the time integral of the count (`load_seconds`) across it, over its
duration.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class WorkerLoad:
    """A worker's count of requests, and the integral of that count over time."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._count = 0
        self._since = clock()
        self._load_seconds = 0.0

    @property
    def count(self) -> int:
        return self._count

    @count.setter
    def count(self, value: int) -> None:
        if value < 0:
            raise ValueError(f"a worker serves no fewer than 0 requests, got {value}")
        self._advance()
        self._count = value

    def load_seconds(self) -> float:
        """The count integrated over time since the worker's handle was made."""
        self._advance()
        return self._load_seconds

    def mean_since(self, mark: tuple[float, float]) -> float:
        """The mean count since `mark` (a `mark()` taken then); the count now where no time has
        passed."""
        start_s, start_load_seconds = mark
        elapsed_s = self._clock() - start_s
        if elapsed_s <= 0:
            return float(self._count)
        return (self.load_seconds() - start_load_seconds) / elapsed_s

    def mark(self) -> tuple[float, float]:
        """(now, the integral now): where `mean_since` measures from."""
        return self._clock(), self.load_seconds()

    def _advance(self) -> None:
        now = self._clock()
        self._load_seconds += self._count * (now - self._since)
        self._since = now
