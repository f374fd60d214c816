"""Pipeline 2 simulated with scheduled rounds: one real scheduler per verifier (`StaggeredScheduler`
or `LockstepScheduler`) plans that verifier's verifications and full-KV loads, as the coordinator's
scheduled rounds do (serve/backends/scheduled.py), while the drafters draft whole rounds on their
own.

A request opens as in per-request rounds (remote_prefix.py): the drafter fetches the compressed
prefix unless it holds it, the verifier loads the full prefix and prefills the suffix, and the first
token is committed. Then the verifier's scheduler takes it, and each iteration of the verifier's
clock (a draft step long, refined by every draft the drafters report):
- starts the plan's full-KV loads on the store link, each moving the prefix's full KV (the
  session's own tokens' KV stays on the verifier between rounds, outside the plan); the prefix's
  is on the verifier's device only from its load to its verification, as the scheduler's memory
  ring plans it (booked at the session's whole reservation, kv/slots.py). A verifier that keeps
  VeriCache's residency (`verifier_resident_bytes`) holds each prefix's full KV once, shared by
  its sessions, and makes the session's own full KV resident instead (booked at that alone, as
  the coordinator books it), held until verified: one it dropped since is rebuilt over the shared
  prefix once there is room, reading nothing from the store, as the served verifier's load ahead
  does;
- begins the round of each request whose first draft iteration it is: one draft call of the
  reserved length (within the budget and the context, the engine's round decides), which carries
  the last round's exact KV across the network, drafts step by step batched with the drafter's other
  requests, and crosses back (latency);
- starts the verifications due, as one batched verifier forward once their drafts and loads are in;
- waits for the verifications that end in it, commits them through the engine's round and reports
  them to the scheduler, then lasts at least the clock's iteration while work is in flight.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from vericache.errors import InvalidRequestError
from vericache.scheduler import BaseScheduler, CostModel, SchedulerRequest
from vericache.scheduler.records import IterationPlan
from vericache.sim.batch_loop import SimJob
from vericache.sim.kv_memory import Session
from vericache.sim.long_context import SimReport
from vericache.sim.remote_prefix import VeriCacheRequest
from vericache.sim.remote_prefix_scenario import RemotePrefixScenario
from vericache.sim.remote_prefix_workers import Run, Worker


def simulate_vericache_scheduled(
    scenario: RemotePrefixScenario, make_scheduler: Callable[[CostModel], BaseScheduler]
) -> SimReport:
    """VeriCache with each verifier's rounds planned by `make_scheduler(costs)`."""
    if scenario.warm_nodes or scenario.turns_per_session > 1:
        raise InvalidRequestError(
            "scheduled rounds serve one-turn sessions on central verifiers: warm nodes and "
            "sequential turns are per-request rounds'"
        )
    run = Run(scenario)
    for verifier in run.verifiers:
        verifier.schedule = VerifierSchedule(run, verifier, make_scheduler)
    return run.serve(_ScheduledRequest.start)


@dataclass(eq=False)
class _ScheduledRequest(VeriCacheRequest):
    exact_tokens: int = 0  # committed since the last draft call: their exact KV goes with the next
    is_drafted: bool = False
    is_loading: bool = False  # its full KV on the store link
    is_loaded: bool = False
    batch: _Batch | None = None

    @property
    def request_id(self) -> str:
        return f"r{id(self)}"

    def verifier_session(self) -> Session:
        """The shared prefix beside the residency, where the verifier keeps one; else nothing
        kept between rounds: the full KV is loaded for each verification, within the memory the
        verifier's scheduler plans."""
        if self.verifier.residency is not None:
            return super().verifier_session()
        return Session(None, 0, 0)

    def _open(self) -> None:
        """The prefill needs the prefix's full KV on the verifier for its own forward (held
        shared already, where the verifier keeps a residency)."""
        if self.verifier.residency is not None:
            self._prefill()
            return
        full = self.run.scenario.prefix_bytes(compressed=False)
        self.verifier.link.send(full, self._prefill)

    def _first_token(self) -> None:
        self.run.emit(self.seq.first_token())
        if self.seq.is_finished:
            self.finished()
            return
        self.exact_tokens = self._after_prefix()  # the prompt's after its prefix, the first's
        self.verifier.schedule.add(self)

    def booked_kv_bytes(self) -> int:
        """What the verifier's scheduler books for the session, as the verifier allocates it
        (kv/slots.py): where the verifier keeps a residency, its own full KV past its prefix's
        shared copy, which stays resident (as the coordinator books it); else its whole full KV,
        loaded for each verification."""
        scenario, max_output_tokens = self.run.scenario, self.seq.max_output_tokens
        if self.verifier.residency is not None:
            return scenario.reserved_own_full_kv_bytes(max_output_tokens)
        return scenario.reserved_full_kv_bytes(max_output_tokens)

    def begin_round(self, reserved: int) -> None:
        """One draft call of the reserved length, cut by the engine's round."""
        num_drafts = self.seq.begin_round(reserved)
        self.is_drafted = False
        if num_drafts == 0:  # the budget leaves one token: the verification chooses it
            self._ready()
            return
        scenario = self.run.scenario
        exact_bytes = self.exact_tokens * scenario.kv_bytes_per_token
        exact_bytes += scenario.refresh_bytes_due(self.seq.seq.stats.rounds)
        self.exact_tokens = 0
        self.drafter.link.send(exact_bytes, lambda: self._call_drafter(num_drafts))

    def _call_drafter(self, num_drafts: int) -> None:
        started = self.run.sim.now

        def drafted() -> None:
            step_s = (self.run.sim.now - started) / num_drafts
            self.verifier.schedule.scheduler.costs.observe_iteration(step_s)
            self.run.sim.after(self.run.scenario.network_latency_s, self._ready)

        job = SimJob(self._draft_row, num_drafts, drafted, on_step=self.seq.draft_step)
        self.drafter.loop.submit(job)

    def _ready(self) -> None:
        self.is_drafted = True
        if self.batch is not None:
            self.batch.check()

    @property
    def is_in_flight(self) -> bool:
        """Whether a call of its round is on its way: its draft, its load, or its verification
        (waiting for them, or in the verifier's forward), as the coordinator's round tasks."""
        is_drafting = self.seq.is_in_round and not self.is_drafted
        is_verifying = self.batch is not None and not self.batch.is_done
        return is_drafting or self.is_loading or is_verifying

    def load(self) -> None:
        """The plan's load ahead of the verification: the prefix's full KV over the store link
        (what the verifier loads, not the blocks the plan reserved for the session), or made
        resident (and held there until verified) by the verifier's residency, which moves
        nothing from the store."""
        self.is_loading = True
        if self.verifier.residency is not None:
            self.verifier.residency.use(self, self._on_loaded)
        else:
            prefix_bytes = self.run.scenario.prefix_bytes(compressed=False)
            self.verifier.link.send(prefix_bytes, self._on_loaded)

    def _on_loaded(self) -> None:
        self.is_loading, self.is_loaded = False, True
        if self.batch is not None:
            self.batch.check()

    def verify_job(self, done: Callable[[], None]) -> SimJob:
        scenario = self.run.scenario
        row = scenario.row(self.seq.num_drafts + 1, self._after_prefix(), compressed=False)
        residency = self.verifier.residency

        def verified() -> None:
            if residency is not None:
                residency.release(self)  # held since its load
            done()

        return SimJob(lambda: row, 1, verified)

    def report(self) -> tuple[int, bool]:
        """Commits the verified round; returns the accepted drafts and whether it finished."""
        num_drafts = self.seq.num_drafts
        outcome = self.seq.verify(self.run.accepted(self.turns, num_drafts))
        accepted = self.seq.seq.stats.accepted_per_round[-1]
        self.run.report.accepted_per_round.append(accepted)
        self.run.report.draft_lens.append(num_drafts)
        self.run.emit(len(outcome.committed))
        self.exact_tokens += len(outcome.committed)
        self.batch, self.is_loaded = None, False
        return accepted, self.seq.is_finished


@dataclass(eq=False)
class _Batch:
    """Verifications that start in one iteration: one verifier forward once all are ready."""

    schedule: VerifierSchedule
    entries: list[_ScheduledRequest]
    waiters: list[Callable[[], None]] = field(default_factory=list)
    started_s: float | None = None
    is_done: bool = False

    def check(self) -> None:
        if self.started_s is not None or not all(
            e.is_drafted and e.is_loaded for e in self.entries
        ):
            return
        run = self.schedule.run
        self.started_s, left = run.sim.now, [len(self.entries)]

        def one_done() -> None:
            left[0] -= 1
            if left[0] == 0:
                self._done()

        for entry in self.entries:  # submitted together: they share the next forward
            self.schedule.verifier.loop.submit(entry.verify_job(one_done))

    def _done(self) -> None:
        self.is_done = True
        costs = self.schedule.scheduler.costs
        costs.observe_verification(max(1e-9, self.schedule.run.sim.now - self.started_s))
        for then in self.waiters:
            then()


class VerifierSchedule:
    """One verifier's scheduler and the clock of its iterations."""

    def __init__(self, run: Run, verifier: Worker, make_scheduler):
        scenario = run.scenario
        self.run, self.verifier = run, verifier
        step_s = scenario.forward_s([scenario.row(1, scenario.suffix_tokens, compressed=True)])
        # The plan's memory: the verifier's, or the full KV it keeps (as the coordinator plans
        # within VerifierConfig.resident_bytes) beside its weights.
        resident = scenario.verifier_resident_bytes
        budget = (
            scenario.memory_budget_bytes if resident is None else scenario.weights_bytes + resident
        )
        costs = CostModel(
            step_s,
            link_bytes_per_s=scenario.store_bytes_per_s * scenario.tensor_parallel,
            memory_budget_bytes=budget,
            weights_bytes=scenario.weights_bytes,
        )
        self.scheduler = make_scheduler(costs)
        self.entries: dict[str, _ScheduledRequest] = {}
        self._ticking = False

    @property
    def kv_bytes(self) -> int:
        """The full KV planned onto the verifier in the iteration being served."""
        return self.scheduler.full_kv_reserved_bytes(self.scheduler.iteration)

    @property
    def peak_kv_bytes(self) -> int:
        return max(0, self.scheduler.metrics.peak_memory_bytes - self.scheduler.costs.weights_bytes)

    def add(self, entry: _ScheduledRequest) -> None:
        draft_len = self.run.scenario.draft_len
        request = SchedulerRequest(entry.request_id, entry.booked_kv_bytes(), 0, draft_len)
        self.scheduler.add_request(request)
        self.entries[entry.request_id] = entry
        if not self._ticking:
            self._ticking = True
            self._iteration()

    def _iteration(self) -> None:
        if not self.entries:
            self._ticking = False
            return
        started = self.run.sim.now
        plan = self.scheduler.schedule()
        for load in plan.loads:
            self.entries[load.request_id].load()
        for request_id in plan.draft_ids:
            entry = self.entries[request_id]
            if not entry.seq.is_in_round:
                state = self.scheduler.request_state(request_id)
                entry.begin_round(state.reservation.num_drafts)
        if plan.verify_starts:
            batch = _Batch(self, [self.entries[v.request_id] for v in plan.verify_starts])
            for entry in batch.entries:
                entry.batch = batch
            batch.check()
        self._when_verified(plan, lambda: self._end(plan, started))

    def _when_verified(self, plan: IterationPlan, then: Callable[[], None]) -> None:
        """Calls `then` once every verification ending in this iteration is done."""
        pending = [self.entries[v.request_id].batch for v in plan.verifies]
        pending = [batch for batch in {id(b): b for b in pending}.values() if not batch.is_done]
        if not pending:
            then()
            return
        left = [len(pending)]

        def one() -> None:
            left[0] -= 1
            if left[0] == 0:
                then()

        for batch in pending:
            batch.waiters.append(one)

    def _end(self, plan: IterationPlan, started: float) -> None:
        for verify in plan.verifies:
            entry = self.entries[verify.request_id]
            accepted, finished = entry.report()
            self.scheduler.on_verified(verify.request_id, accepted, is_finished=finished)
            if finished:
                del self.entries[verify.request_id]
                entry.finished()
        self.scheduler.end_iteration(None)  # the drafters time the steps
        # An iteration lasts a draft step while work is in flight; with none (a plan's load
        # iterations already served, say), the next follows at once, as the coordinator paces.
        wait = started + self.scheduler.costs.iteration_s - self.run.sim.now
        is_in_flight = any(entry.is_in_flight for entry in self.entries.values())
        self.run.sim.after(max(0.0, wait) if is_in_flight else 0.0, self._iteration)
