"""Scheduled VERICACHE rounds: one scheduler per verifier plans the verifications and full-KV loads
of the requests verified there (CoordinatorConfig.scheduling "staggered" or "lockstep"), with the
same scheduler objects that drive the long-context engine and the simulator.

Each round makes two worker calls, whatever it loads: the drafters draft whole rounds on their own,
batching whatever they hold step by step, while the scheduler places the verifier's side of every
round. What the scheduler's words stand for here:
- an iteration is a tick of the coordinator's clock, one draft step long (the time drafters report
  per step, refined by every draft); a round of d drafts is one draft call made in its first draft
  iteration, and its verification is planned to start in iteration d + 1 after it;
- a load is the verifier making a session's own full KV resident again after an eviction (its
  prefix stays resident, shared), ahead of the session's verification, so that it overlaps other
  requests' verifications and drafts. The round's verifier call is made in the iteration the plan
  starts the load in, while the drafter still drafts: it starts the load and holds the draft call's
  answer by reference (`VerifyCall.drafts`), verifying as soon as the drafts reach the verifier.
  Verifications whose drafts arrive together share the verifier's forwards (its batch loop batches
  continuously);
- the memory ring is the verifier's device memory: its weights and the sessions' own full KV
  kept for verification (`VerifierConfig.resident_bytes`; the prefixes' shared copies have a
  budget of their own); compressed KV lives on the drafters;
- the link ring is the store-to-device bandwidth, first measured by the verifier, then by every
  load.
A verification hands back the exact KV of the committed tokens; the next draft call carries it
across the slow link.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from vericache.errors import WorkerUnavailableError
from vericache.kv.exact import ExactKV
from vericache.scheduler import (
    BaseScheduler,
    CostModel,
    LockstepScheduler,
    SchedulerRequest,
    StaggeredScheduler,
    Verify,
)
from vericache.serve.config import CoordinatorConfig
from vericache.serve.metrics import ServeMetrics
from vericache.serve.rounds import ServedRequest, draft_call, verification
from vericache.serve.worker_api import (
    DraftAnswer,
    Drafted,
    DrafterAPI,
    DraftInFlight,
    Verified,
    VerifierAPI,
    VerifierInfo,
    VerifierOpened,
    VerifyCall,
)

_END = object()  # the outbox's last item
Outcome = Verified | BaseException


@dataclass
class _Entry:
    """A request on the schedule: what its next draft and verification need."""

    served: ServedRequest
    drafter: DrafterAPI
    exact: ExactKV | None  # the verifier's KV of the tokens committed since the last draft
    link_delay_s: float  # until `exact` has crossed the link's bandwidth
    outbox: asyncio.Queue = field(default_factory=asyncio.Queue)  # token lists, an error, _END
    draft: asyncio.Task | None = None  # this round's draft call, once its round has begun
    drafts: tuple[int, ...] | DraftAnswer = ()  # ...and its answer, for the verifier
    verification: asyncio.Task | None = None  # this round's verifier call, once made

    @property
    def session_id(self) -> str:
        return self.served.session_id

    def tasks(self) -> list[asyncio.Task]:
        return [t for t in (self.draft, self.verification) if t and not t.done()]


class ScheduledRounds:
    """The rounds of every scheduled request verified on one verifier."""

    def __init__(
        self,
        verifier: VerifierAPI,
        new_scheduler: Callable[[CostModel], BaseScheduler],
        costs: CostModel,
        slot_bytes: int,
        metrics: ServeMetrics | None = None,
    ):
        self.verifier = verifier
        self.metrics = metrics
        self._new_scheduler = new_scheduler
        self.scheduler = new_scheduler(costs)
        self.slot_bytes = slot_bytes  # one cache slot of full KV
        self._entries: dict[str, _Entry] = {}
        self._loop: asyncio.Task | None = None

    async def rounds(
        self, served: ServedRequest, drafter: DrafterAPI, opened: VerifierOpened
    ) -> AsyncIterator[list[int]]:
        """Puts an opened request on the schedule; yields each round's committed tokens."""
        session_id = served.session_id
        # What the session holds of its own on the verifier: its prefix's shared copy stays
        # there, pinned, in the prefix cache's budget (kv/prefixed.py), and costs it no load.
        own_slots = served.capacity - served.seq.request.num_prefix_tokens
        full_kv_bytes = own_slots * self.slot_bytes
        draft_len = served.seq.request.draft_len
        self.scheduler.add_request(SchedulerRequest(session_id, full_kv_bytes, 0, draft_len))
        entry = _Entry(served, drafter, opened.exact, opened.link_delay_s)
        self._entries[session_id] = entry
        if self._loop is None or self._loop.done():
            self._loop = asyncio.create_task(self._run())
        try:
            while (item := await entry.outbox.get()) is not _END:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:  # finished, failed or cancelled: off the schedule, its reservations freed
            if self._entries.pop(session_id, None) is not None:
                self.scheduler.abort(session_id)
            for task in entry.tasks():
                _drop(task)

    async def close(self) -> None:
        """Stops the schedule before its workers shut down: no call starts after that."""
        stopping = WorkerUnavailableError("the server is stopping")
        for entry in self._entries.values():
            for task in entry.tasks():
                _drop(task)
            entry.outbox.put_nowait(stopping)
        if self._loop is not None and not self._loop.done():
            self._loop.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop

    async def _run(self) -> None:
        while self._entries:
            try:
                await self._iteration()
            except Exception as exc:  # noqa: BLE001 - a broken schedule fails its requests
                for session_id in list(self._entries):
                    self._fail(session_id, exc)
                # ...and starts afresh: the iteration it broke may be half planned.
                self.scheduler = self._new_scheduler(self.scheduler.costs)

    async def _iteration(self) -> None:
        started = time.perf_counter()
        plan = self.scheduler.schedule()
        if self.metrics is not None:
            scheduled = self.scheduler.metrics
            self.metrics.iteration_planned(scheduled.iterations[-1], scheduled.peak_memory_bytes)
        for request_id in plan.draft_ids:
            entry = self._entries[request_id]
            if entry.draft is None:  # the round's first draft iteration: it begins
                self._begin_round(entry)
        for load in plan.loads:  # inside its round's drafting (Reservation.load_start)
            entry = self._entries[load.request_id]
            if entry.draft is not None:  # else its verification loads when it starts
                self._start_verification(entry, load_first=True)
        for verify in plan.verify_starts:  # a round without a load of its own
            entry = self._entries[verify.request_id]
            if entry.verification is None:
                self._start_verification(entry, load_first=False)
        await self._report(plan.verifies)
        await self._pace(started)
        self.scheduler.end_iteration(None)  # ticks time nothing: the drafters time the steps

    async def _pace(self, started: float) -> None:
        """An iteration lasts a draft step while work is in flight (the plan's clock keeps pace
        with the drafters); with none, the next one follows at once."""
        in_flight = [task for entry in self._entries.values() for task in entry.tasks()]
        left = self.scheduler.costs.iteration_s - (time.perf_counter() - started)
        await asyncio.sleep(left if in_flight and left > 0 else 0)

    def _begin_round(self, entry: _Entry) -> None:
        """Starts a round of the reserved draft length (within the budget and the context) as
        one draft call, which carries the exact KV of the last round's committed tokens."""
        served = entry.served
        reserved = self.scheduler.request_state(entry.session_id).reservation.num_draft_tokens
        num_drafts = served.seq.begin_round(reserved)
        exact, entry.exact = entry.exact, None
        if num_drafts == 0:  # the budget leaves one token: the verification chooses it
            entry.draft, entry.drafts = asyncio.create_task(_nothing_drafted()), ()
            return
        served.num_round_calls += 1
        in_flight = entry.drafter.draft_ahead(
            draft_call(served, num_drafts, exact, entry.link_delay_s)
        )
        entry.draft, entry.drafts = asyncio.create_task(self._drafted(in_flight)), in_flight.answer

    async def _drafted(self, in_flight: DraftInFlight) -> Drafted:
        drafted = await in_flight.drafted
        if drafted.step_s > 0:
            self.scheduler.costs.observe_iteration(drafted.step_s)
        return drafted

    def _start_verification(self, entry: _Entry, load_first: bool) -> None:
        """The round's one verifier call, made before its drafts exist: they reach the verifier
        by reference."""
        served = entry.served
        call = VerifyCall(
            served.session_id, served.pending, entry.drafts, load_first, served.seq.sampler()
        )
        entry.verification = asyncio.create_task(self._verify(entry, call))

    async def _verify(self, entry: _Entry, call: VerifyCall) -> Outcome:
        """The round's outcome: its result, or its error."""
        try:
            verified = await verification(entry.served, self.verifier, call, entry.draft)
        except Exception as exc:  # noqa: BLE001 - this request fails, the others go on
            return exc
        if verified.forward_s > 0:  # the forward alone: the call also waited for drafts, loads
            self.scheduler.costs.observe_verification(verified.forward_s)
        return verified

    async def _report(self, verifies: tuple[Verify, ...]) -> None:
        """Finishes the rounds whose verification ends in this iteration (waiting for it)."""
        for verify in verifies:
            entry = self._entries.get(verify.request_id)
            if entry is None:  # cancelled meanwhile
                continue
            # Gathered: a request cancelled meanwhile has its call cancelled, not this loop.
            (outcome,) = await asyncio.gather(entry.verification, return_exceptions=True)
            entry.verification = entry.draft = None
            entry.drafts = ()
            if entry.session_id not in self._entries:
                continue  # cancelled while it verified (its session closed)
            if isinstance(outcome, BaseException):
                self._fail(entry.session_id, outcome)
            else:
                self._finish_round(entry, outcome)

    def _finish_round(self, entry: _Entry, verified: Verified) -> None:
        served = entry.served
        traffic = verified.traffic  # its load's bytes and time among them
        if traffic.store_bytes and traffic.store_s > 0:
            self.scheduler.costs.observe_load(traffic.store_bytes, traffic.store_s)
        num_accepted = verified.num_accepted
        committed = served.finish_round(verified)
        entry.exact, entry.link_delay_s = verified.exact, verified.link_delay_s
        is_finished = served.seq.is_finished
        self.scheduler.on_verified(entry.session_id, num_accepted, is_finished=is_finished)
        entry.outbox.put_nowait(committed)
        if is_finished:
            del self._entries[entry.session_id]
            entry.outbox.put_nowait(_END)

    def _fail(self, session_id: str, error: BaseException) -> None:
        entry = self._entries.pop(session_id, None)
        if entry is not None:
            self.scheduler.abort(session_id)
            for task in entry.tasks():
                _drop(task)
            entry.outbox.put_nowait(error)


def new_scheduled_rounds(
    verifier: VerifierAPI,
    about: VerifierInfo,
    load_bytes_per_s: float,
    draft_step_s: float,
    config: CoordinatorConfig,
    metrics: ServeMetrics | None = None,
) -> ScheduledRounds:
    """The schedule of one verifier, from what it described of itself, its load bandwidth and the
    time of a draft step; both estimates are refined as it runs."""
    costs = CostModel(
        iteration_s=draft_step_s,
        link_bytes_per_s=load_bytes_per_s,
        memory_budget_bytes=about.weights_bytes + about.resident_bytes,
        weights_bytes=about.weights_bytes,
    )
    new_scheduler = scheduler_for(config)
    return ScheduledRounds(verifier, new_scheduler, costs, about.slot_bytes, metrics)


def scheduler_for(config: CoordinatorConfig) -> Callable[[CostModel], BaseScheduler]:
    """The scheduler of a verifier's rounds under `config.scheduling` (staggered or lockstep)
    and its settings; the simulator plans a served run's rounds with the same one."""

    def new_scheduler(costs: CostModel) -> BaseScheduler:
        if config.scheduling == "lockstep":
            draft_len = min(config.default_draft_len, config.scheduler.window - 1)
            return LockstepScheduler(costs, draft_len, config.scheduler)
        return StaggeredScheduler(costs, config.scheduler)

    return new_scheduler


async def _nothing_drafted() -> Drafted:
    return Drafted((), 0.0)


def _drop(task: asyncio.Task | None, cancel: bool = True) -> None:
    """Forgets a task no one will wait for (its error, if any, included), cancelling it unless
    told not to."""
    if task is not None:
        if cancel:
            task.cancel()
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
