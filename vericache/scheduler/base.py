"""The iteration protocol and bookkeeping shared by every scheduling policy.

The caller owns execution (as in vLLM v1). Each iteration it calls:

    plan = scheduler.schedule()          # admits what fits, then plans this iteration
    start plan.loads; run one draft step over plan.draft_ids; verify plan.verifies
    scheduler.on_verified(request_id, num_accepted, is_finished)   # once per plan.verifies
    scheduler.end_iteration(elapsed_s)   # refines the iteration time, moves the window on

Timeline of one round: a request admitted after iteration t with draft length d drafts in
iterations t+1..t+d and verifies in iteration v = t+d+1 (its own iteration, so a round of d draft
tokens takes d+1 iterations, as in the paper's throughput model). Its full-KV load books link time
in iterations t+1..t+d, so it completes before iteration v; the full KV holds device memory from
the iteration its load starts through v, and is released after the verification. Its compressed KV
stays resident from its first admission until it finishes or is aborted.

A verification that costs more than an iteration (V = CostModel.num_verify_iterations() > 1: a
verifier slower than a draft step, as on a CPU, or a drafter on a faster device) spans iterations
v..v+V-1: it starts in v (`plan.verify_starts`), runs while the others draft, and is reported in
v+V-1 (`plan.verifies`); its full KV stays reserved through v+V-1 and the round takes d+V
iterations. With V = 1 both lists are the same.

Two reservation rings cover the W iterations after the last finished one: link seconds booked per
iteration (never above the iteration time) and full-KV bytes reserved per iteration (with the
weights and every resident compressed KV, never above the memory budget). Policies differ only in
`_admit_waiting`, which turns waiting requests into reservations.
"""

from __future__ import annotations

import abc
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from vericache.errors import InvalidRequestError
from vericache.scheduler.costs import CostModel
from vericache.scheduler.records import (
    IterationMetrics,
    IterationPlan,
    LoadStart,
    RequestMetrics,
    SchedulerConfig,
    SchedulerRequest,
    SchedulerStateError,
    Verify,
)
from vericache.scheduler.rings import ReservationRing


@dataclass(frozen=True)
class Reservation:
    """One round of one request, as booked in the rings."""

    num_drafts: int
    draft_first: int  # first draft iteration
    draft_last: int  # last draft iteration (equal to draft_first + num_drafts - 1)
    load_start: int  # first iteration with link time booked; full KV reserved from here
    verify_first: int  # the verification starts here (right after the last draft iteration)
    verify_iteration: int  # ...and is reported here; full KV reserved through it
    link_bookings: tuple[tuple[int, float], ...]  # (iteration, link seconds)


@dataclass
class RequestState:
    request: SchedulerRequest
    draft_len: int  # preferred draft length, free to change between rounds
    metrics: RequestMetrics
    waiting_since: int  # last finished iteration when it joined the queue
    is_resident: bool = False  # compressed KV on the device
    reservation: Reservation | None = None  # None while waiting

    @property
    def request_id(self) -> str:
        return self.request.request_id


@dataclass
class SchedulerMetrics:
    history: int
    iterations: deque[IterationMetrics] = field(init=False)
    finished: deque[RequestMetrics] = field(init=False)
    peak_memory_bytes: int = 0  # device memory high-water mark over every iteration planned

    def __post_init__(self):
        self.iterations = deque(maxlen=self.history)
        self.finished = deque(maxlen=self.history)

    def record(self, metrics: IterationMetrics) -> None:
        self.iterations.append(metrics)
        self.peak_memory_bytes = max(self.peak_memory_bytes, metrics.memory_bytes)


DraftLenPolicy = Callable[[RequestState], int]


def preferred_draft_len(state: RequestState) -> int:
    return state.draft_len


class BaseScheduler(abc.ABC):
    def __init__(
        self,
        costs: CostModel,
        config: SchedulerConfig | None = None,
        choose_draft_len: DraftLenPolicy = preferred_draft_len,
    ):
        config = config or SchedulerConfig()
        self.costs = costs
        self.config = config
        self.choose_draft_len = choose_draft_len  # the adaptive draft length plugs in here
        self.metrics = SchedulerMetrics(config.metrics_history)
        self.iteration = 0  # the next iteration to plan
        self._link = ReservationRing(config.window)  # link seconds
        self._memory = ReservationRing(config.window)  # full-KV bytes
        self._states: dict[str, RequestState] = {}
        self._waiting: deque[RequestState] = deque()
        self._running: dict[str, RequestState] = {}  # admitted, with a reservation
        self._resident_bytes = 0  # compressed KV of every resident request
        self._plan: IterationPlan | None = None  # the iteration in progress
        self._unreported: set[str] = set()

    # -- requests -------------------------------------------------------------------------------

    def add_request(self, request: SchedulerRequest) -> None:
        """Queues a request; it is admitted at the next `schedule()` if it fits."""
        rid = request.request_id
        if rid in self._states:
            raise InvalidRequestError(f"request {rid!r} is already scheduled")
        alone = self.costs.weights_bytes + request.compressed_kv_bytes + request.full_kv_bytes
        if alone > self.costs.memory_budget_bytes:
            raise InvalidRequestError(
                f"request {rid!r} needs {alone} bytes of device memory with the weights, more "
                f"than the budget of {self.costs.memory_budget_bytes}: shorten its context or "
                "compress it further"
            )
        span = self.costs.num_load_iterations(request.full_kv_bytes)
        if span > self.config.window - 1:
            raise InvalidRequestError(
                f"request {rid!r}: its full-KV load spans {span} iterations, more than the "
                f"window of {self.config.window} allows: raise SchedulerConfig.window"
            )
        state = RequestState(request, request.draft_len, RequestMetrics(rid), self.iteration - 1)
        self._states[rid] = state
        self._waiting.append(state)

    def set_draft_len(self, request_id: str, draft_len: int) -> None:
        """Changes a request's preferred draft length from its next admission on."""
        if draft_len < 1:
            raise InvalidRequestError(f"draft_len must be >= 1, got {draft_len}")
        self._state(request_id).draft_len = draft_len

    def abort(self, request_id: str) -> None:
        """Forgets a request and frees what it reserved from the next iteration on."""
        state = self._state(request_id)
        if state.reservation is None:
            self._waiting.remove(state)
        else:
            self._release_future(state.request, state.reservation)
            del self._running[request_id]
        self._unreported.discard(request_id)
        self._forget(state)

    # -- the iteration protocol -----------------------------------------------------------------

    def schedule(self) -> IterationPlan:
        """Admits waiting requests that fit (arrivals and last iteration's verified ones), then
        plans the next iteration."""
        if self._plan is not None:
            raise SchedulerStateError(f"iteration {self.iteration} is planned already: end it")
        self._admit_waiting(self.iteration - 1)
        now = self.iteration
        loads, drafts, starts, verifies = [], [], [], []
        for state in self._running.values():
            res = state.reservation
            if res.load_start == now:
                loads.append(
                    LoadStart(state.request_id, state.request.full_kv_bytes, res.verify_first)
                )
            if res.draft_first <= now <= res.draft_last:
                drafts.append(state.request_id)
            if res.verify_first == now:
                starts.append(Verify(state.request_id, res.num_drafts))
            if res.verify_iteration == now:
                verifies.append(Verify(state.request_id, res.num_drafts))
        self._plan = IterationPlan(now, tuple(loads), tuple(drafts), tuple(verifies), tuple(starts))
        self._unreported = {v.request_id for v in verifies}
        self.metrics.record(
            IterationMetrics(
                iteration=now,
                num_drafting=len(drafts),
                num_verifying=len(starts),
                num_loads_started=len(loads),
                num_running=len(self._running),
                num_waiting=len(self._waiting),
                link_utilisation=self._link[now] / self.costs.iteration_s,
                memory_bytes=self.memory_in_use(now),
            )
        )
        return self._plan

    def on_verified(self, request_id: str, num_accepted: int, is_finished: bool = False) -> None:
        """Reports one verification of this iteration; an unfinished request queues again."""
        if request_id not in self._unreported:
            raise SchedulerStateError(
                f"request {request_id!r} does not verify in iteration {self.iteration}, or was "
                "reported already"
            )
        state = self._states[request_id]
        num_drafts = state.reservation.num_drafts
        if not 0 <= num_accepted <= num_drafts:
            raise InvalidRequestError(
                f"request {request_id!r}: num_accepted must lie in [0, {num_drafts}], "
                f"got {num_accepted}"
            )
        self._unreported.discard(request_id)
        metrics = state.metrics
        metrics.num_rounds += 1
        metrics.num_drafts += num_drafts
        metrics.num_accepted += num_accepted
        metrics.draft_lens.append(num_drafts)
        metrics.accepted_per_round.append(num_accepted)
        # The full KV stays reserved through this iteration, which the ring retires at its end.
        del self._running[request_id]
        state.reservation = None
        if is_finished:
            self._forget(state)
        else:
            state.waiting_since = self.iteration
            self._waiting.append(state)

    def end_iteration(self, elapsed_s: float | None = None) -> None:
        """Ends the planned iteration. elapsed_s, its measured time, refines the iteration time:
        leave out time spent waiting for a late full-KV load, or a slow link would lengthen the
        estimated iteration, shrink S and make later loads later still."""
        if self._plan is None:
            raise SchedulerStateError("no iteration is in progress: call schedule() first")
        if self._unreported:
            raise SchedulerStateError(
                f"iteration {self.iteration}: verifications not reported: "
                f"{sorted(self._unreported)}"
            )
        # Idle iterations and lock-step stalls (waiting on the link) say nothing of compute time.
        if elapsed_s is not None and (self._plan.draft_ids or self._plan.verifies):
            self.costs.observe_iteration(elapsed_s)
        self._plan = None
        self._link.advance()
        self._memory.advance()
        self.iteration += 1

    # -- views ----------------------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def has_requests(self) -> bool:
        return bool(self._states)

    @property
    def waiting_ids(self) -> list[str]:
        return [state.request_id for state in self._waiting]

    @property
    def resident_bytes(self) -> int:
        return self._resident_bytes

    def request_state(self, request_id: str) -> RequestState:
        return self._state(request_id)

    def link_booked_s(self, iteration: int) -> float:
        return self._link[iteration]

    def full_kv_reserved_bytes(self, iteration: int) -> int:
        return round(self._memory[iteration])

    def memory_in_use(self, iteration: int) -> int:
        """Weights + resident compressed KV + full KV reserved in that iteration (as of now)."""
        return (
            self.costs.weights_bytes + self._resident_bytes + self.full_kv_reserved_bytes(iteration)
        )

    # -- for policies ---------------------------------------------------------------------------

    @abc.abstractmethod
    def _admit_waiting(self, base: int) -> None:
        """Admits waiting requests after iteration `base`; the rings hold base+1..base+W."""

    def _fits_memory(self, start: int, stop: int, full_kv_bytes: int, new_resident: int) -> bool:
        """Whether full_kv_bytes more over [start, stop], and new_resident more everywhere, fit."""
        fixed = self.costs.weights_bytes + self._resident_bytes + new_resident
        budget = self.costs.memory_budget_bytes
        if (
            new_resident
            and fixed + self._memory.peak(self._memory.first, self._memory.last) > budget
        ):
            return False
        return fixed + full_kv_bytes + self._memory.peak(start, stop) <= budget

    def _commit(self, state: RequestState, reservation: Reservation, base: int) -> None:
        for iteration, seconds in reservation.link_bookings:
            self._link.add(iteration, seconds)
        for iteration in range(reservation.load_start, reservation.verify_iteration + 1):
            self._memory.add(iteration, state.request.full_kv_bytes)
        if not state.is_resident:
            state.is_resident = True
            self._resident_bytes += state.request.compressed_kv_bytes
        waited = base - state.waiting_since
        state.metrics.num_waited_iterations += waited
        state.metrics.max_wait_iterations = max(state.metrics.max_wait_iterations, waited)
        state.reservation = reservation
        self._running[state.request_id] = state

    def _release_future(self, request: SchedulerRequest, reservation: Reservation) -> None:
        # The iteration in progress keeps what it booked; between iterations, all is future.
        first = self.iteration + (1 if self._plan is not None else 0)
        for iteration, seconds in reservation.link_bookings:
            if iteration >= first:
                self._link.release(iteration, seconds)
        for iteration in range(
            max(first, reservation.load_start), reservation.verify_iteration + 1
        ):
            self._memory.release(iteration, request.full_kv_bytes)

    def _forget(self, state: RequestState) -> None:
        if state.is_resident:
            self._resident_bytes -= state.request.compressed_kv_bytes
        del self._states[state.request_id]
        self.metrics.finished.append(state.metrics)

    def _state(self, request_id: str) -> RequestState:
        try:
            return self._states[request_id]
        except KeyError:
            raise InvalidRequestError(f"no scheduled request has id {request_id!r}") from None
