"""A discrete simulator: drives a scheduler through its iteration protocol against synthetic
requests, with no model, to check invariants over many iterations and compare policies.

Each iteration lasts `SimHardware.iteration_s` while any request is live (none pass while the
simulator only waits for arrivals). The link moves `link_bytes_per_s * iteration_s` bytes per
iteration among the started loads, earliest verification first (preemptive EDF meets every
deadline that some schedule within the bookings meets). A verification whose load still has bytes
left stalls the iteration until they arrive (`num_stalls`, `stall_s`). Each draft token is accepted
with probability `acceptance` given that the ones before it were; a request finishes once it has
emitted `num_output_tokens` (each round emits accepted + 1 tokens).
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from vericache.errors import InvalidRequestError
from vericache.scheduler.base import BaseScheduler
from vericache.scheduler.costs import CostModel
from vericache.scheduler.records import (
    IterationMetrics,
    IterationPlan,
    RequestMetrics,
    SchedulerRequest,
    SchedulerStateError,
    Verify,
)

GB = 10**9


@dataclass(frozen=True)
class SimRequest:
    request: SchedulerRequest
    num_output_tokens: int
    acceptance: float = 0.8  # chance a draft token is accepted, given the ones before it were
    arrival_iteration: int = 0

    def __post_init__(self):
        if self.num_output_tokens < 1 or not 0 <= self.acceptance <= 1:
            raise InvalidRequestError("num_output_tokens must be >= 1 and acceptance in [0, 1]")


@dataclass(frozen=True)
class SimHardware:
    iteration_s: float
    link_bytes_per_s: float
    memory_budget_bytes: int
    weights_bytes: int = 0

    def costs(self, alpha: float = 0.2) -> CostModel:
        """A cost model that knows the hardware exactly (as a perfect calibration would)."""
        return CostModel(
            self.iteration_s,
            self.link_bytes_per_s,
            self.memory_budget_bytes,
            self.weights_bytes,
            alpha,
        )


@dataclass
class SimResult:
    num_iterations: int = 0
    elapsed_s: float = 0.0
    num_output_tokens: int = 0
    num_stalls: int = 0  # verifications whose full KV had not arrived
    stall_s: float = 0.0
    peak_memory_bytes: int = 0
    requests: dict[str, RequestMetrics] = field(default_factory=dict)
    iterations: list[IterationMetrics] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.num_output_tokens / self.elapsed_s if self.elapsed_s else 0.0

    def mean(self, name: str) -> float:
        """Mean of one IterationMetrics field over the iterations with a live request."""
        busy = [m for m in self.iterations if m.num_running or m.num_waiting]
        return sum(getattr(m, name) for m in busy) / len(busy) if busy else 0.0


@dataclass
class _Load:
    num_bytes: int
    verify_iteration: int
    remaining: float


PlanHook = Callable[[BaseScheduler, IterationPlan], None]


def simulate(
    scheduler: BaseScheduler,
    requests: Iterable[SimRequest],
    hardware: SimHardware,
    *,
    seed: int = 0,
    max_iterations: int = 100_000,
    observe_costs: bool = False,
    on_plan: PlanHook | None = None,
) -> SimResult:
    """Runs every request to completion. observe_costs feeds measured iteration and load times
    back into scheduler.costs (online refinement); on_plan sees each plan as it is made."""
    run = _Simulation(scheduler, list(requests), hardware, seed, observe_costs)
    while run.pending or scheduler.has_requests:
        if scheduler.iteration >= max_iterations:
            raise SchedulerStateError(
                f"requests unfinished after {max_iterations} iterations: "
                f"{scheduler.num_running} running, {scheduler.num_waiting} waiting"
            )
        run.step(on_plan)
    result = run.result
    result.num_iterations = scheduler.iteration
    result.peak_memory_bytes = scheduler.metrics.peak_memory_bytes
    result.requests = {m.request_id: m for m in scheduler.metrics.finished}
    result.iterations = list(scheduler.metrics.iterations)
    return result


class _Simulation:
    def __init__(self, scheduler, requests, hardware, seed, observe_costs):
        self.scheduler = scheduler
        self.hardware = hardware
        self.observe_costs = observe_costs
        self.rng = random.Random(seed)
        self.pending = deque(sorted(requests, key=lambda r: r.arrival_iteration))
        self.by_id = {r.request.request_id: r for r in requests}
        self.num_emitted = dict.fromkeys(self.by_id, 0)
        self.loads: dict[str, _Load] = {}
        self.result = SimResult()

    def step(self, on_plan: PlanHook | None) -> None:
        scheduler, bandwidth = self.scheduler, self.hardware.link_bytes_per_s
        while self.pending and self.pending[0].arrival_iteration <= scheduler.iteration:
            scheduler.add_request(self.pending.popleft().request)
        plan = scheduler.schedule()
        if on_plan is not None:
            on_plan(scheduler, plan)
        duration = self.hardware.iteration_s if scheduler.has_requests else 0.0
        for load in plan.loads:
            self.loads[load.request_id] = _Load(
                load.num_bytes, load.verify_iteration, load.num_bytes
            )
        _move(self.loads, bandwidth * duration)
        stall_s = sum(self._verify(verify) for verify in plan.verifies) / bandwidth
        # Time spent waiting for a late load is not compute time: counted, not observed.
        scheduler.end_iteration(duration if self.observe_costs and duration else None)
        self.result.elapsed_s += duration + stall_s
        self.result.stall_s += stall_s

    def _verify(self, verify: Verify) -> float:
        """Finishes one verification; returns the bytes of its load that arrived late."""
        rid = verify.request_id
        load = self.loads.pop(rid, None)
        if load is None:
            raise SchedulerStateError(f"request {rid!r} verifies without a full-KV load")
        is_late = load.remaining > 1e-6 * load.num_bytes
        self.result.num_stalls += is_late
        if self.observe_costs:
            alone_s = load.num_bytes / self.hardware.link_bytes_per_s
            self.scheduler.costs.observe_load(load.num_bytes, alone_s)
        sim = self.by_id[rid]
        num_accepted = _num_accepted(self.rng, sim.acceptance, verify.num_drafts)
        num_tokens = min(num_accepted + 1, sim.num_output_tokens - self.num_emitted[rid])
        self.num_emitted[rid] += num_tokens
        self.result.num_output_tokens += num_tokens
        is_finished = self.num_emitted[rid] >= sim.num_output_tokens
        self.scheduler.on_verified(rid, num_accepted, is_finished)
        return load.remaining if is_late else 0.0


def _move(loads: dict[str, _Load], num_bytes: float) -> None:
    for load in sorted(loads.values(), key=lambda load: load.verify_iteration):
        moved = min(load.remaining, num_bytes)
        load.remaining -= moved
        num_bytes -= moved
        if num_bytes <= 0:
            return


def _num_accepted(rng: random.Random, acceptance: float, num_drafts: int) -> int:
    for index in range(num_drafts):
        if rng.random() >= acceptance:
            return index
    return num_drafts


def paper_example(
    num_requests: int = 10,
    draft_len: int = 30,
    acceptance: float = 0.98,
    num_output_tokens: int = 1000,
) -> tuple[list[SimRequest], SimHardware]:
    """The paper's Mistral-24B example: 1 GB compressed and 4 GB full KV per request, 48 GB of
    weights on a 141 GB device, full KVs over a 50 GB/s link (40 GB in 800 ms, about 20 iterations
    of 40 ms). acceptance 0.98 accepts about 22 of 30 draft tokens, as the paper reports at x=30."""
    requests = [
        SimRequest(
            SchedulerRequest(f"r{i}", 4 * GB, 1 * GB, draft_len),
            num_output_tokens,
            acceptance,
        )
        for i in range(num_requests)
    ]
    return requests, SimHardware(0.040, 50 * GB, 141 * GB, 48 * GB)
