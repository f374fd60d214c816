"""Pipeline 1 simulated: long-context decoding on one device (or one tensor-parallel group), the
compressed KV resident, the full KV in host memory, against full-KV decoding at the same memory.

VeriCache: the real scheduler (`StaggeredScheduler`, `LockstepScheduler`, any `BaseScheduler`)
makes every decision through its iteration protocol; the simulator only advances time and charges
resources. Each iteration starts the plan's full-KV loads on the host-to-device link, waits for
the loads of the verifications that start in it (a stall, if the link is behind), and runs one
forward: a draft row for each drafting request over its compressed KV and a row of x+1 tokens for
each verification over its full KV, as the engine batches them. The forward's time is what the cost
model gives (cost.py); the scheduler sees it as the iteration's measured time. Each verification
accepts what a recorded round accepts (workload.py), and every round begins and commits through
the engine's own round (decoding.py): a round near a request's end drafts only what its budget
allows, and the next round's length is set as the long-context engine sets it. Neither side is
charged the prompt's prefill.

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
from vericache.kv.slots import reserved_full_kv_bytes
from vericache.scheduler import BaseScheduler, CostModel
from vericache.scheduler.records import IterationPlan, SchedulerRequest
from vericache.sim.batch_loop import ForwardCount, SimBatchLoop, SimJob
from vericache.sim.cost import Row, forward_seconds
from vericache.sim.decoding import SimSequence
from vericache.sim.events import Device, Link, Simulation
from vericache.sim.kv_memory import Session, WorkerMemory
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
    element_size: int = 2  # bytes per weight, activation and KV element (bf16; float32: 4)
    # Bytes per element of the prompt tokens the compressed KV keeps (None: element_size); e.g.
    # 2 where a float32 model keeps them in bfloat16, as the CPU benchmarks' "-bf16" labels do.
    compressed_element_size: int | None = None

    def __post_init__(self):
        if self.compressed_element_size is not None and self.compressed_element_size < 1:
            raise InvalidRequestError("compressed_element_size must be >= 1")
        if self.prompt_tokens < 1 or not 0 < self.kv_budget <= 1 or self.draft_len < 1:
            raise InvalidRequestError("a scenario needs a prompt, kv_budget in (0, 1], x >= 1")
        if not self.arrivals or not 0 <= self.activation_reserve < 1:
            raise InvalidRequestError("a scenario needs arrivals and a reserve in [0, 1)")
        if self.prompt_tokens >= self.model.max_positions:
            raise InvalidRequestError(
                f"a prompt of {self.prompt_tokens} tokens leaves no room in {self.model.name}'s "
                f"context of {self.model.max_positions}"
            )

    @property
    def kv_bytes_per_token(self) -> float:
        """Full KV of one token on one device of the group."""
        return self.model.kv_bytes_per_token(self.element_size) / self.tensor_parallel

    @property
    def weights_bytes(self) -> int:
        return self.model.weights_bytes(self.element_size) // self.tensor_parallel

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
        """A request's full KV with this many output tokens, on one device of the group: what a
        load moves."""
        return math.ceil((self.prompt_tokens + num_output_tokens) * self.kv_bytes_per_token)

    def reserved_full_kv_bytes(self, max_output_tokens: int) -> int:
        """What the engine reserves for a request's full KV, and tells its scheduler: whole blocks
        of slots for the prompt, every output token and one round's drafts (kv/slots.py), on one
        device of the group. The scheduler books memory and each load's link time by it; at short
        contexts the blocks add much (a 1.2k-token request reserves 2k slots)."""
        model = self.model
        reserved = reserved_full_kv_bytes(
            self.prompt_tokens,
            max_output_tokens,
            self.draft_len,
            model.max_positions,
            model.slot_bytes(self.element_size),
        )
        return math.ceil(reserved / self.tensor_parallel)

    @property
    def kept_kv_bytes_per_token(self) -> float:
        """KV of one kept prompt token in the compressed KV, on one device of the group."""
        size = self.compressed_element_size or self.element_size
        return self.model.kv_bytes_per_token(size) / self.tensor_parallel

    def compressed_kv_bytes(self, num_output_tokens: int) -> int:
        """Its compressed KV at its end: the kept prompt tokens and every output token, exact."""
        kept = self.kept_prompt_tokens * self.kept_kv_bytes_per_token
        return math.ceil(kept + num_output_tokens * self.kv_bytes_per_token)

    def forward_s(self, rows: list[Row]) -> float:
        return forward_seconds(
            self.model, self.device, rows, self.element_size, self.tensor_parallel
        )


@dataclass
class SimReport:
    """One simulated run; `sources` says where its profiles and acceptance came from."""

    num_output_tokens: int = 0
    elapsed_s: float = 0.0
    # Where an untimed first wave ran (RemotePrefixScenario.warmup_sessions): when the rest began,
    # and the tokens the wave emitted.
    timed_from_s: float = 0.0
    untimed_tokens: int = 0
    num_forwards: int = 0
    device_busy_s: float = 0.0
    link_bytes: int = 0
    num_stalls: int = 0  # iterations that waited for a full-KV load
    stall_s: float = 0.0
    peak_kv_bytes: int = 0  # the most KV one device (or worker) held or had reserved at once
    latencies_s: list[float] = field(default_factory=list)  # per request, arrival to last token
    accepted_per_round: list[int] = field(default_factory=list)
    draft_lens: list[int] = field(default_factory=list)  # of each round, as the scheduler chose
    sources: tuple[str, ...] = ()
    # (seconds, output tokens so far, link bytes moved so far, KV bytes held), at each emission
    timeline: list[tuple[float, int, int, int]] = field(default_factory=list)
    # Pipeline 2's own accounts (remote_prefix*.py):
    paths: dict[str, int] = field(default_factory=dict)  # `mode: auto`'s choices: path -> requests
    num_warm_streams: int = 0  # full KVs streamed into a drafter node's host tier
    num_warm_switches: int = 0  # sessions whose verification moved to their drafter's node
    num_local_verifications: int = 0  # on a warm drafter node
    num_central_verifications: int = 0  # on a verifier beside the store
    prefix_sources: dict[str, int] = field(default_factory=dict)  # where device misses came from
    # Per role, each resource's busiest worker's share of the run, and the one that binds.
    utilization: dict[str, dict[str, float]] = field(default_factory=dict)
    binds: str = ""
    # Per role, the forwards its workers ran after the untimed first wave, and the jobs they held.
    timed_forwards: dict[str, ForwardCount] = field(default_factory=dict)

    def sample(self, now: float, link_bytes: int, kv_bytes: int) -> None:
        self.timeline.append((now, self.num_output_tokens, link_bytes, kv_bytes))

    @property
    def tokens_per_s(self) -> float:
        return self.num_output_tokens / self.elapsed_s if self.elapsed_s else 0.0

    @property
    def timed_tokens_per_s(self) -> float:
        """Tokens/s after an untimed first wave (all of them where none ran)."""
        elapsed = self.elapsed_s - self.timed_from_s
        return (self.num_output_tokens - self.untimed_tokens) / elapsed if elapsed else 0.0

    def latency_percentile(self, share: float) -> float:
        ordered = sorted(self.latencies_s)
        return ordered[min(len(ordered) - 1, int(share * len(ordered)))] if ordered else 0.0


class _Request:
    def __init__(self, request_id: str, arrival_s: float, seq: SimSequence, max_output: int):
        self.request_id = request_id
        self.arrival_s = arrival_s
        self.seq = seq
        self.max_output_tokens = max_output  # the most it can emit: the KV it may come to hold


def _requests(scenario: LongContextScenario) -> deque[_Request]:
    rng = random.Random(scenario.seed)
    prompt, context = scenario.prompt_tokens, scenario.model.max_positions
    requests = deque()
    for i, arrival in enumerate(sorted(scenario.arrivals)):
        num_tokens = scenario.output_lengths.draw(rng)
        seq = SimSequence(prompt, num_tokens, context)
        requests.append(_Request(f"r{i}", arrival, seq, min(num_tokens, context - prompt)))
    return requests


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
        peak = self.scheduler.metrics.peak_memory_bytes - self.scheduler.costs.weights_bytes
        self.report.peak_kv_bytes = max(0, peak)
        return self.report

    def _iteration(self) -> None:
        self._admit_arrivals()
        if not self.scheduler.has_requests:
            if self.arriving:
                self.sim.at(self.arriving[0].arrival_s, self._iteration)
            return
        plan = self.scheduler.schedule()
        for load in plan.loads:  # the KV it holds so far, not the reservation the plan booked
            num_bytes = self.scenario.full_kv_bytes(
                self.live[load.request_id].seq.num_output_tokens
            )
            self.link.send(num_bytes, lambda rid=load.request_id: self._loaded(rid))
        self._stalled = (plan, self.sim.now)
        self._run_when_loaded()

    def _admit_arrivals(self) -> None:
        scenario = self.scenario
        while self.arriving and self.arriving[0].arrival_s <= self.sim.now:
            request = self.arriving.popleft()
            self.scheduler.add_request(
                SchedulerRequest(
                    request.request_id,
                    full_kv_bytes=scenario.reserved_full_kv_bytes(request.max_output_tokens),
                    compressed_kv_bytes=scenario.compressed_kv_bytes(request.max_output_tokens),
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
        drafting = self._drafting(plan)
        rows = [self._draft_row(seq) for seq in drafting]
        rows += [self._verify_row(self.live[v.request_id].seq) for v in plan.verify_starts]
        seconds = self.scenario.forward_s(rows) if rows else 0.0
        self.report.num_forwards += bool(rows)
        self.device.submit(seconds, lambda: self._finish(plan, drafting, seconds))

    def _drafting(self, plan: IterationPlan) -> list[SimSequence]:
        """The plan's draft steps, as the long-context engine takes them: a round begins at the
        scheduler's draft length, and a sequence whose round has its drafts takes no step."""
        drafting = []
        for request_id in plan.draft_ids:
            seq = self.live[request_id].seq
            if not seq.is_in_round:
                seq.begin_round(self.scheduler.request_state(request_id).reservation.num_drafts)
            if seq.wants_draft_step:
                drafting.append(seq)
        return drafting

    def _draft_row(self, seq: SimSequence) -> Row:
        """A draft step over the compressed KV: the kept prompt, the output and the drafts."""
        scenario = self.scenario
        exact = seq.num_output_tokens + seq.num_drafts
        context = scenario.kept_prompt_tokens + exact
        kv_bytes = (
            scenario.kept_prompt_tokens * scenario.kept_kv_bytes_per_token
            + exact * scenario.kv_bytes_per_token
        )
        return Row(1, context, kv_bytes / context)

    def _verify_row(self, seq: SimSequence) -> Row:
        context = self.scenario.prompt_tokens + seq.num_output_tokens
        return Row(seq.num_drafts + 1, context, self.scenario.kv_bytes_per_token, is_full_kv=True)

    def _finish(self, plan: IterationPlan, drafting: list[SimSequence], seconds: float) -> None:
        for seq in drafting:
            seq.draft_step()
        for verify in plan.verifies:
            self._verified(verify.request_id)
        self.scheduler.end_iteration(seconds if seconds else None)
        self._iteration()

    def _verified(self, request_id: str) -> None:
        request = self.live[request_id]
        seq, num_drafts = request.seq, request.seq.num_drafts
        outcome = seq.verify(self.scenario.acceptance.accepted(num_drafts, self.rng))
        accepted = seq.seq.stats.accepted_per_round[-1]
        self.report.num_output_tokens += len(outcome.committed)
        kv_bytes = self.scheduler.memory_in_use(self.scheduler.iteration)
        self.report.sample(
            self.sim.now, self.link.bytes_moved, kv_bytes - self.scheduler.costs.weights_bytes
        )
        self.report.accepted_per_round.append(accepted)
        self.report.draft_lens.append(num_drafts)
        self.loaded.discard(request_id)
        self.scheduler.on_verified(request_id, accepted, seq.is_finished)
        if seq.is_finished:
            self.report.latencies_s.append(self.sim.now - request.arrival_s)
            del self.live[request_id]
        else:  # the next round's length within the budget, as the engine sets it
            self.scheduler.set_draft_len(
                request_id, max(1, seq.drafts_wanted(self.scenario.draft_len))
            )


def simulate_full_kv(scenario: LongContextScenario) -> SimReport:
    """Full-KV decoding at the same memory: continuous batching (batch_loop.py) of every request
    whose full KV fits beside the weights and the others' (kv_memory.py, first come first
    served); one token per request per step."""
    sim, report = Simulation(), SimReport(sources=(scenario.device.source,))
    device = Device(sim, "device")
    loop = SimBatchLoop(device, scenario.forward_s)
    memory = WorkerMemory(scenario.kv_room_bytes)
    for request in _requests(scenario):
        sim.at(request.arrival_s, lambda r=request: _decode_full(scenario, r, loop, memory, report))
    sim.run()
    report.elapsed_s, report.device_busy_s = sim.now, device.busy_s
    report.num_forwards, report.peak_kv_bytes = loop.num_forwards, memory.peak_bytes
    return report


def _decode_full(scenario, request: _Request, loop: SimBatchLoop, memory, report) -> None:
    seq, kv = request.seq, scenario.kv_bytes_per_token
    session = Session(None, 0, scenario.reserved_full_kv_bytes(request.max_output_tokens))

    def row() -> Row:
        return Row(1, scenario.prompt_tokens + seq.num_output_tokens, kv, is_full_kv=True)

    def step() -> None:
        report.num_output_tokens += seq.decode_step()
        report.sample(loop.device.sim.now, 0, memory.used_bytes)  # no link: nothing loads

    def done() -> None:
        report.latencies_s.append(loop.device.sim.now - request.arrival_s)
        memory.release(session)

    memory.admit(session, lambda: loop.submit(SimJob(row, seq.num_left, done, on_step=step)))
