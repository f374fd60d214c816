"""Lock-step scheduling, the paper's baseline: every running request drafts x tokens, then all of
them verify in the same iteration, their full-KV loads started at once.

A round starts when no request is in flight: every unfinished request of the last round, then new
requests in FIFO order while the round fits (strict FIFO: the first that does not fit stops the
rest, so none starves). The B loads move B full KVs together, L = max(1, ceil(total bytes /
(bandwidth * iteration time))) iterations of link. By default they start after the last draft
step, as in the paper's 10-request example (40 GB moved at once, about 20 iterations without
drafting). overlap_loads=True is a stronger baseline: the loads start so as to end with the
drafting (at once if L > x, which still leaves L - x iterations without drafting). Either way every
full KV of the round holds device memory from the loads' start through the verification: the
memory spike staggering avoids. A round must fit the window: max(x, L) (or x + L) + V <= W, V the
iterations a verification spans (base.py).
"""

from __future__ import annotations

import math

from vericache.errors import InvalidRequestError
from vericache.scheduler.base import BaseScheduler, RequestState, Reservation
from vericache.scheduler.costs import CostModel
from vericache.scheduler.records import SchedulerConfig, SchedulerRequest


class LockstepScheduler(BaseScheduler):
    def __init__(
        self,
        costs: CostModel,
        draft_len: int,
        config: SchedulerConfig | None = None,
        overlap_loads: bool = False,
    ):
        super().__init__(costs, config)
        if not 1 <= draft_len <= self.config.window - 1:
            raise InvalidRequestError(
                f"draft_len must lie in [1, window - 1 = {self.config.window - 1}], got {draft_len}"
            )
        self.draft_len = draft_len
        self.overlap_loads = overlap_loads

    def add_request(self, request: SchedulerRequest) -> None:
        span = self.costs.num_load_iterations(request.full_kv_bytes)
        if self._round_iterations(span) + self.costs.num_verify_iterations() > self.config.window:
            raise InvalidRequestError(
                f"request {request.request_id!r}: a lock-step round of {self.draft_len} draft "
                f"steps and a {span}-iteration load does not fit the window of "
                f"{self.config.window}: raise SchedulerConfig.window"
            )
        super().add_request(request)

    def _admit_waiting(self, base: int) -> None:
        if self._running or not self._waiting:
            return  # a round is in flight, or nobody waits
        batch = [state for state in self._waiting if state.is_resident]
        new_resident = 0
        for state in self._waiting:
            if state.is_resident:
                continue
            compressed = state.request.compressed_kv_bytes
            if not self._round_fits(batch + [state], new_resident + compressed):
                break
            batch.append(state)
            new_resident += compressed
        if batch:
            self._start_round(batch, base)
            admitted = {state.request_id for state in batch}
            kept = [state for state in self._waiting if state.request_id not in admitted]
            self._waiting.clear()
            self._waiting.extend(kept)

    def _num_load_iterations(self, batch: list[RequestState]) -> tuple[int, float]:
        load_s = sum(self.costs.load_s(state.request.full_kv_bytes) for state in batch)
        return max(1, math.ceil(load_s / self.costs.iteration_s - 1e-9)), load_s

    def _round_iterations(self, num_load_iterations: int) -> int:
        if self.overlap_loads:
            return max(self.draft_len, num_load_iterations)
        return self.draft_len + num_load_iterations

    def _round_fits(self, batch: list[RequestState], new_resident: int) -> bool:
        num_load_iterations, _ = self._num_load_iterations(batch)
        num_verify = self.costs.num_verify_iterations()
        if self._round_iterations(num_load_iterations) + num_verify > self.config.window:
            return False
        full_kv_bytes = sum(state.request.full_kv_bytes for state in batch)
        fixed = self.costs.weights_bytes + self._resident_bytes + new_resident
        return fixed + full_kv_bytes <= self.costs.memory_budget_bytes

    def _start_round(self, batch: list[RequestState], base: int) -> None:
        num_load_iterations, load_s = self._num_load_iterations(batch)
        # Only when the costs drifted past the window since the round's requests were added:
        # the loads then book the window and the verification waits for them.
        num_verify = min(self.costs.num_verify_iterations(), self.config.window - 1)
        longest = self.config.window - num_verify - (0 if self.overlap_loads else self.draft_len)
        num_load_iterations = max(1, min(num_load_iterations, longest))
        verify_first = base + self._round_iterations(num_load_iterations) + 1
        verify_iteration = verify_first + num_verify - 1
        load_start = verify_first - num_load_iterations
        link_s = []  # the loads share the link: their total, iteration by iteration
        remaining = load_s
        for _ in range(num_load_iterations):
            link_s.append(min(self.costs.iteration_s, remaining))
            remaining -= link_s[-1]
        total_bytes = sum(state.request.full_kv_bytes for state in batch)
        for state in batch:
            share = state.request.full_kv_bytes / total_bytes
            bookings = tuple((load_start + i, s * share) for i, s in enumerate(link_s))
            reservation = Reservation(
                num_drafts=self.draft_len,
                draft_first=base + 1,
                draft_last=base + self.draft_len,
                load_start=load_start,
                verify_first=verify_first,
                verify_iteration=verify_iteration,
                link_bookings=bookings,
            )
            self._commit(state, reservation, base)
