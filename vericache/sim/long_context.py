"""Pipeline 1 simulated: long-context decoding on one device (or one tensor-parallel group), the
compressed KV resident, the full KV in host memory, against full-KV decoding at the same memory.

VeriCache: the real scheduler (`StaggeredScheduler`, `LockstepScheduler`, any `BaseScheduler`)
makes every decision through its iteration protocol; the simulator only advances time and charges
resources. Each iteration starts the plan's full-KV loads on the host-to-device link, waits for
the loads of the verifications that start in it (a stall, if the link is behind), and runs one
forward: a draft row for each drafting request over its compressed KV and a row of x+1 tokens for
each verification over its full KV, as the engine batches them. The forward's time is what the cost
model gives (cost.py); the scheduler sees it as the iteration's measured time. Each verification
accepts what a recorded round accepts (workload.py).

The compressed KV is token-dropped to `kv_budget` of the prompt's tokens (KVzip's c); tokens the
request commits join it exactly, as VeriCache appends them.

Full KV: continuous batching with every admitted request's full KV resident; a request starts when
its KV fits beside the others and the weights; each step decodes one token for each.

Quantities are per device of the group: its share of the weights and of the KV heads, and its own
host link (each device loads its share of a full KV at once).
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from vericache.errors import InvalidRequestError
from vericache.scheduler import BaseScheduler, CostModel
from vericache.scheduler.records import IterationPlan, SchedulerRequest
from vericache.sim.cost import Row, forward_cost
from vericache.sim.events import Device, Link, Simulation
from vericache.sim.profiles import DeviceProfile, ModelProfile
from vericache.sim.workload import AcceptanceTrace, OutputLengths


@dataclass(frozen=True)
class LongContextScenario:
    model: ModelProfile
    device: DeviceProfile
    prompt_tokens: int
    kv_budget: float  # the compressed KV's share of the prompt's tokens, in (0, 1]
    draft_len: int
    arrivals: tuple[float, ...]  # seconds, one per request
    output_lengths: OutputLengths
    acceptance: AcceptanceTrace
    tensor_parallel: int = 1
    activation_reserve: float = 0.1  # share of device memory kept from the KV
    seed: int = 0

    def __post_init__(self):
        if self.prompt_tokens < 1 or not 0 < self.kv_budget <= 1 or self.draft_len < 1:
            raise InvalidRequestError("a scenario needs a prompt, kv_budget in (0, 1], x >= 1")
        if not self.arrivals or not 0 <= self.activation_reserve < 1:
            raise InvalidRequestError("a scenario needs arrivals and a reserve in [0, 1)")

    @property
    def kv_bytes_per_token(self) -> float:
        """Full KV of one token on one device of the group."""
        return self.model.kv_bytes_per_token() / self.tensor_parallel

    @property
    def weights_bytes(self) -> int:
        return self.model.weights_bytes() // self.tensor_parallel

    @property
    def memory_budget_bytes(self) -> int:
        return int(self.device.memory_bytes * (1 - self.activation_reserve))

    @property
    def kv_room_bytes(self) -> int:
        """Device memory for KV once the weights are loaded."""
        return self.memory_budget_bytes - self.weights_bytes

    @property
    def kept_prompt_tokens(self) -> int:
        """The prompt's tokens the compressed KV keeps."""
        return math.ceil(self.kv_budget * self.prompt_tokens)

    def full_kv_bytes(self, num_output_tokens: int) -> int:
        """A request's full KV at its end, on one device of the group."""
        return math.ceil((self.prompt_tokens + num_output_tokens) * self.kv_bytes_per_token)

    def compressed_kv_bytes(self, num_output_tokens: int) -> int:
        """Its compressed KV at its end: the kept prompt tokens and every output token, exact."""
        return math.ceil((self.kept_prompt_tokens + num_output_tokens) * self.kv_bytes_per_token)

    def forward_s(self, rows: list[Row]) -> float:
        cost = forward_cost(self.model, self.device, rows, tensor_parallel=self.tensor_parallel)
        return cost.seconds


@dataclass
class SimReport:
    """One simulated run; `sources` says where its profiles and acceptance came from."""

    num_output_tokens: int = 0
    elapsed_s: float = 0.0
    num_forwards: int = 0
    device_busy_s: float = 0.0
    link_bytes: int = 0
    num_stalls: int = 0  # iterations that waited for a full-KV load
    stall_s: float = 0.0
    latencies_s: list[float] = field(default_factory=list)  # per request, arrival to last token
    accepted_per_round: list[int] = field(default_factory=list)
    draft_lens: list[int] = field(default_factory=list)  # of each round, as the scheduler chose
    sources: tuple[str, ...] = ()

    @property
    def tokens_per_s(self) -> float:
        return self.num_output_tokens / self.elapsed_s if self.elapsed_s else 0.0

    def latency_percentile(self, share: float) -> float:
        ordered = sorted(self.latencies_s)
        return ordered[min(len(ordered) - 1, int(share * len(ordered)))] if ordered else 0.0


class _Request:
    def __init__(self, request_id: str, arrival_s: float, num_output_tokens: int):
        self.request_id = request_id
        self.arrival_s = arrival_s
        self.num_output_tokens = num_output_tokens
        self.num_emitted = 0

    @property
    def is_finished(self) -> bool:
        return self.num_emitted >= self.num_output_tokens


def _requests(scenario: LongContextScenario) -> deque[_Request]:
    rng = random.Random(scenario.seed)
    return deque(
        _Request(f"r{i}", arrival, scenario.output_lengths.draw(rng))
        for i, arrival in enumerate(sorted(scenario.arrivals))
    )


def simulate_vericache(
    scenario: LongContextScenario, make_scheduler: Callable[[CostModel], BaseScheduler]
) -> SimReport:
    """VeriCache over the scenario, every decision made by `make_scheduler(costs)`."""
    return _VeriCacheRun(scenario, make_scheduler).run()


class _VeriCacheRun:
    def __init__(self, scenario: LongContextScenario, make_scheduler):
        self.scenario = scenario
        self.sim = Simulation()
        self.device = Device(self.sim, "device")
        self.link = Link(self.sim, "host-to-device", scenario.device.host_to_device_bytes_per_s)
        self.scheduler = make_scheduler(self._first_costs())
        self.arriving = _requests(scenario)
        self.live: dict[str, _Request] = {}
        self.loaded: set[str] = set()
        self.rng = random.Random(scenario.seed + 1)
        self.report = SimReport(sources=(scenario.device.source, scenario.acceptance.source))
        self._stalled: tuple[IterationPlan, float] | None = None

    def _first_costs(self) -> CostModel:
        """The costs the scheduler starts from, as a start-up calibration would measure them: a
        draft step of one request; it refines them from each iteration's time."""
        scenario = self.scenario
        step_s = scenario.forward_s(
            [Row(1, scenario.kept_prompt_tokens, scenario.kv_bytes_per_token)]
        )
        return CostModel(
            iteration_s=step_s,
            link_bytes_per_s=scenario.device.host_to_device_bytes_per_s,
            memory_budget_bytes=scenario.memory_budget_bytes,
            weights_bytes=scenario.weights_bytes,
        )

    def run(self) -> SimReport:
        self.sim.at(self.arriving[0].arrival_s, self._iteration)
        self.sim.run()
        if self.arriving or self.live:
            raise InvalidRequestError("the scheduler left requests unserved (they never fit)")
        self.report.elapsed_s = self.sim.now
        self.report.device_busy_s = self.device.busy_s
        self.report.link_bytes = self.link.bytes_delivered
        return self.report

    def _iteration(self) -> None:
        self._admit_arrivals()
        if not self.scheduler.has_requests:
            if self.arriving:
                self.sim.at(self.arriving[0].arrival_s, self._iteration)
            return
        plan = self.scheduler.schedule()
        for load in plan.loads:
            self.link.send(load.num_bytes, lambda rid=load.request_id: self._loaded(rid))
        self._stalled = (plan, self.sim.now)
        self._run_when_loaded()

    def _admit_arrivals(self) -> None:
        scenario = self.scenario
        while self.arriving and self.arriving[0].arrival_s <= self.sim.now:
            request = self.arriving.popleft()
            self.scheduler.add_request(
                SchedulerRequest(
                    request.request_id,
                    full_kv_bytes=scenario.full_kv_bytes(request.num_output_tokens),
                    compressed_kv_bytes=scenario.compressed_kv_bytes(request.num_output_tokens),
                    draft_len=scenario.draft_len,
                )
            )
            self.live[request.request_id] = request

    def _loaded(self, request_id: str) -> None:
        self.loaded.add(request_id)
        self._run_when_loaded()

    def _run_when_loaded(self) -> None:
        if self._stalled is None:
            return
        plan, since = self._stalled
        if any(v.request_id not in self.loaded for v in plan.verify_starts):
            return  # a load is late: the iteration waits for it
        self._stalled = None
        if self.sim.now > since:
            self.report.num_stalls += 1
            self.report.stall_s += self.sim.now - since
        rows = [self._draft_row(rid) for rid in plan.draft_ids]
        rows += [self._verify_row(v.request_id, v.num_draft_tokens) for v in plan.verify_starts]
        seconds = self.scenario.forward_s(rows) if rows else 0.0
        self.report.num_forwards += bool(rows)
        self.device.submit(seconds, lambda: self._finish(plan, seconds))

    def _draft_row(self, request_id: str) -> Row:
        scenario, request = self.scenario, self.live[request_id]
        kept = scenario.kept_prompt_tokens + request.num_emitted
        return Row(1, kept, scenario.kv_bytes_per_token)

    def _verify_row(self, request_id: str, num_drafts: int) -> Row:
        scenario, request = self.scenario, self.live[request_id]
        context = scenario.prompt_tokens + request.num_emitted
        return Row(num_drafts + 1, context, scenario.kv_bytes_per_token)

    def _finish(self, plan: IterationPlan, seconds: float) -> None:
        for verify in plan.verifies:
            request = self.live[verify.request_id]
            accepted = self.scenario.acceptance.accepted(verify.num_draft_tokens, self.rng)
            emitted = min(accepted + 1, request.num_output_tokens - request.num_emitted)
            request.num_emitted += emitted
            self.report.num_output_tokens += emitted
            self.report.accepted_per_round.append(accepted)
            self.report.draft_lens.append(verify.num_draft_tokens)
            self.loaded.discard(verify.request_id)
            self.scheduler.on_verified(verify.request_id, accepted, request.is_finished)
            if request.is_finished:
                self.report.latencies_s.append(self.sim.now - request.arrival_s)
                del self.live[verify.request_id]
        self.scheduler.end_iteration(seconds if seconds else None)
        self._iteration()


def simulate_full_kv(scenario: LongContextScenario) -> SimReport:
    """Full-KV decoding at the same memory: continuous batching of every request whose full KV
    fits beside the weights and the others'; one token per request per step."""
    requests, report = _requests(scenario), SimReport(sources=(scenario.device.source,))
    now, busy, running = 0.0, 0.0, []
    while requests or running:
        while requests and requests[0].arrival_s <= now and _fits(scenario, running, requests[0]):
            running.append(requests.popleft())
        if not running:
            if scenario.full_kv_bytes(requests[0].num_output_tokens) > scenario.kv_room_bytes:
                raise InvalidRequestError("one request's full KV does not fit the device")
            now = max(now, requests[0].arrival_s)
            continue
        kv = scenario.kv_bytes_per_token
        rows = [Row(1, scenario.prompt_tokens + r.num_emitted, kv) for r in running]
        seconds = scenario.forward_s(rows)
        now, busy = now + seconds, busy + seconds
        report.num_forwards += 1
        for request in running:
            request.num_emitted += 1
            report.num_output_tokens += 1
            if request.is_finished:
                report.latencies_s.append(now - request.arrival_s)
        running = [r for r in running if not r.is_finished]
    report.elapsed_s, report.device_busy_s = now, busy
    return report


def _fits(scenario: LongContextScenario, running: list[_Request], request: _Request) -> bool:
    used = sum(scenario.full_kv_bytes(r.num_output_tokens) for r in running)
    return used + scenario.full_kv_bytes(request.num_output_tokens) <= scenario.kv_room_bytes
