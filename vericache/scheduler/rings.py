"""A reservation ring: an amount booked per iteration over a sliding window of W iterations.

Slots are indexed by absolute iteration modulo W. The ring holds iterations [first, first + W); as
each iteration ends, its slot is cleared and reused for iteration first + W.
"""

from __future__ import annotations

from vericache.scheduler.records import SchedulerStateError


class ReservationRing:
    def __init__(self, window: int, first: int = 0):
        self.window = window
        self.first = first  # oldest iteration the ring holds
        self._slots = [0.0] * window

    @property
    def last(self) -> int:
        return self.first + self.window - 1

    def __getitem__(self, iteration: int) -> float:
        self._check(iteration)
        return self._slots[iteration % self.window]

    def booked(self, start: int, stop: int) -> list[float]:
        """The bookings of iterations [start, stop] (both inside the ring), in order: one check
        and two slices, where the schedulers would index every iteration (the simulator places
        millions of reservations)."""
        if start > stop:
            return []
        self._check(start)
        self._check(stop)
        low, high = start % self.window, stop % self.window
        if low <= high:
            return self._slots[low : high + 1]
        return self._slots[low:] + self._slots[: high + 1]

    def add(self, iteration: int, amount: float) -> None:
        self._check(iteration)
        self._slots[iteration % self.window] += amount

    def release(self, iteration: int, amount: float) -> None:
        """Takes back a booking; iterations that have left the ring need nothing taken back."""
        if self.first <= iteration <= self.last:
            slot = iteration % self.window
            # Clamped: float sums of bookings and releases may leave -1e-17 behind.
            self._slots[slot] = max(0.0, self._slots[slot] - amount)

    def advance(self) -> None:
        """The oldest iteration is over: its slot becomes the newest iteration, empty."""
        self._slots[self.first % self.window] = 0.0
        self.first += 1

    def peak(self, start: int, stop: int) -> float:
        """Largest booking over iterations [start, stop] (both inside the ring)."""
        return max(self.booked(start, stop))

    def _check(self, iteration: int) -> None:
        if not self.first <= iteration < self.first + self.window:
            raise SchedulerStateError(
                f"iteration {iteration} lies outside the window [{self.first}, {self.last}]"
            )
