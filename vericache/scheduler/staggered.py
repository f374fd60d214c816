"""Cross-resource staggering (paper, "Scheduler"): each request verifies on its own schedule, so
full-KV loads spread over the link and over time instead of arriving all at once.

ADMIT(request), after iteration t: S = max(1, ceil(full KV / (bandwidth * iteration time))). Try
draft lengths d from the request's best (its draft-length policy) outward, best, -1, +1, -2, +2,
..., within [S, W-V] (V: the iterations a verification spans, base.py). For each d, book the
load's link seconds backward from iteration t+d, taking the free time of each iteration, over at
most S + load_slack iterations (and never before t+1): the load ends right before the verification
starts at t+d+1, so its full KV holds device memory for about S+V iterations, and loads aimed at
one busy iteration push requests to other draft lengths instead of piling up (which is what
staggers them). The first d whose link booking fits, and whose full KV fits device memory from the
load's start through the verification's end, is reserved. If none fits, the request waits.

Liveness, three rules:
- Admission order is the wait queue, FIFO by the iteration each request joined it (arrival or last
  verification), so whoever has waited longest chooses first.
- A new request is admitted only if, with its compressed KV resident, the largest full KV of any
  resident request still fits beside the weights and every resident compressed KV: every admitted
  request can then always verify once the link and memory it needs drain.
- Aging: once the queue's oldest request has waited `starvation_limit` iterations and could fit
  an empty window, nothing behind it is admitted until it is; the window then drains within W
  iterations. If it needs resident requests to finish first (a new request short of memory), only
  new requests behind it are held back, so resident memory can only shrink until it fits.
A load that no longer fits in W-1 iterations (the costs drifted since it was added) books W-1 whole
iterations, so it is admitted once they are free; its verification waits for the rest of the load.
"""

from __future__ import annotations

from collections.abc import Iterator

from vericache.scheduler.base import BaseScheduler, RequestState, Reservation


def draft_len_order(best: int, low: int, high: int) -> Iterator[int]:
    """best (clamped into [low, high]), then best-1, best+1, best-2, best+2, ... inside it."""
    best = min(max(best, low), high)
    yield best
    for step in range(1, max(best - low, high - best) + 1):
        if best - step >= low:
            yield best - step
        if best + step <= high:
            yield best + step


class StaggeredScheduler(BaseScheduler):
    def _admit_waiting(self, base: int) -> None:
        still_waiting = []
        hold_new = hold_all = False
        for state in self._waiting:
            is_held = hold_all or (hold_new and not state.is_resident)
            if not is_held and self._admit(state, base):
                continue
            still_waiting.append(state)
            if is_held or base - state.waiting_since < self.config.starvation_limit:
                continue
            if self._fits_empty_window(state):
                hold_all = True
            elif not state.is_resident:
                hold_new = True
        self._waiting.clear()
        self._waiting.extend(still_waiting)

    def _admit(self, state: RequestState, base: int) -> bool:
        if not state.is_resident and not self._keeps_reserve(state):
            return False
        num_verify = min(self.costs.num_verify_iterations(), self.config.window - 1)
        high = self.config.window - num_verify  # the verification ends inside the window
        span = min(self.costs.num_load_iterations(state.request.full_kv_bytes), high)
        capacity = self.costs.iteration_s
        load_s = min(self.costs.load_s(state.request.full_kv_bytes), span * capacity)
        link = _LinkTime(self._link.booked(base + 1, base + high), base + 1, capacity)
        for num_drafts in draft_len_order(self.choose_draft_len(state), span, high):
            last = base + num_drafts
            first = max(base + 1, last - span - self.config.load_slack + 1)
            if not link.may_hold(first, last, load_s):
                continue
            reservation = self._place(state, base, num_drafts, first, num_verify, load_s, link)
            if reservation is not None:
                self._commit(state, reservation, base)
                return True
        return False

    def _place(
        self,
        state: RequestState,
        base: int,
        num_drafts: int,
        first: int,  # the earliest iteration the load may use
        num_verify: int,
        remaining: float,  # the load's link seconds
        link: _LinkTime,
    ) -> Reservation | None:
        capacity, tolerance = self.costs.iteration_s, link.tolerance
        last = base + num_drafts
        bookings = []
        booked = link.booked(first, last)
        for iteration in range(last, first - 1, -1):
            free = capacity - booked[iteration - first]
            if free <= tolerance:
                continue
            seconds = min(free, remaining)
            bookings.append((iteration, seconds))
            remaining -= seconds
            if remaining <= tolerance:
                break
        if remaining > tolerance:
            return None
        load_start = bookings[-1][0]
        verify_first = base + num_drafts + 1
        verify_iteration = verify_first + num_verify - 1
        new_resident = 0 if state.is_resident else state.request.compressed_kv_bytes
        if not self._fits_memory(
            load_start, verify_iteration, state.request.full_kv_bytes, new_resident
        ):
            return None
        return Reservation(
            num_drafts=num_drafts,
            draft_first=base + 1,
            draft_last=base + num_drafts,
            load_start=load_start,
            verify_first=verify_first,
            verify_iteration=verify_iteration,
            link_bookings=tuple(reversed(bookings)),
        )

    def _keeps_reserve(self, state: RequestState) -> bool:
        largest_full = max(
            [s.request.full_kv_bytes for s in self._states.values() if s.is_resident]
            + [state.request.full_kv_bytes]
        )
        fixed = self.costs.weights_bytes + self._resident_bytes + state.request.compressed_kv_bytes
        return fixed + largest_full <= self.costs.memory_budget_bytes

    def _fits_empty_window(self, state: RequestState) -> bool:
        if state.is_resident:
            return True  # the reserve kept room for its full KV
        return self._keeps_reserve(state)


class _LinkTime:
    """The link's bookings over the iterations one admission may use, and prefix sums of their
    free seconds: a draft length whose load cannot fit is ruled out in O(1), not by a scan (a
    saturated link has every waiting request try every draft length, every iteration)."""

    def __init__(self, booked: list[float], start: int, capacity: float):
        self._booked, self._start = booked, start
        self.tolerance = 1e-9 * capacity  # link seconds a booking may leave unplaced
        self._margin = 1e-6 * capacity  # far above the rounding of a few hundred float sums
        self._free_before = [0.0]
        for seconds in booked:
            free = capacity - seconds
            usable = free if free > self.tolerance else 0.0
            self._free_before.append(self._free_before[-1] + usable)

    def booked(self, first: int, last: int) -> list[float]:
        return self._booked[first - self._start : last - self._start + 1]

    def may_hold(self, first: int, last: int, seconds: float) -> bool:
        """False only if a load of `seconds` surely cannot be booked into iterations [first,
        last]; True leaves the decision to the booking itself."""
        free = self._free_before[last - self._start + 1] - self._free_before[first - self._start]
        return free + self._margin >= seconds - self.tolerance
