"""The schedules of VERICACHE rounds: where a request's rounds (served_round.py) go in time.

`Schedule` is what rounds.py drives a request's rounds on. `BackToBack` runs each request's rounds
one after another, each verifier call made as its round begins (CoordinatorConfig.scheduling
"per-request"); the verifier's batch loop batches whatever reaches it at once. `ScheduledRounds`
has one scheduler per verifier plan the verifications and full-KV loads of the requests verified
there ("staggered" or "lockstep"), with the same scheduler objects that drive the long-context
engine and the simulator. Either lets a request go between two rounds once its drafter node is
warm (`ServedRequest.is_leaving_schedule`): rounds.py moves its rounds there.

Under `ScheduledRounds`, each round still makes two worker calls, whatever it loads: the drafters
draft whole rounds on their own, batching whatever they hold step by step, while the scheduler
places the verifier's side of every round. What the scheduler's words stand for here:
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
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from vericache.errors import WorkerUnavailableError
from vericache.scheduler import (
    BaseScheduler,
    CostModel,
    LockstepScheduler,
    SchedulerRequest,
    StaggeredScheduler,
    Verify,
)
from vericache.serve.backends.metrics import ServeMetrics
from vericache.serve.backends.served_round import ServedRound
from vericache.serve.config import CoordinatorConfig
from vericache.serve.workers.worker_api import DrafterAPI, Verified, VerifierAPI, VerifierInfo

if TYPE_CHECKING:
    from vericache.serve.backends.rounds import ServedRequest

_END = object()  # the outbox's last item
Outcome = Verified | BaseException


class Schedule(Protocol):
    """Places the VERICACHE rounds of the requests one verifier verifies."""

    def rounds(self, served: ServedRequest, drafter: DrafterAPI) -> AsyncIterator[list[int]]:
        """Runs an opened request's rounds, yielding each round's committed tokens, until it is
        finished or leaves for its warm drafter node (`is_leaving_schedule`)."""
        ...


class BackToBack:
    """Each request's rounds one after another, the verifier call made as the round begins."""

    def __init__(self, verifier: VerifierAPI):
        self.verifier = verifier

    async def rounds(self, served: ServedRequest, drafter: DrafterAPI) -> AsyncIterator[list[int]]:
        seq = served.seq
        while not seq.is_finished and not served.is_leaving_schedule:
            served_round = ServedRound.begin(served, drafter, seq.request.draft_len)
            verified = await served_round.verify(self.verifier)
            yield served_round.finish(verified)


@dataclass
class _Entry:
    """A request on the schedule: its round in flight, once begun."""

    served: ServedRequest
    drafter: DrafterAPI
    outbox: asyncio.Queue = field(default_factory=asyncio.Queue)  # token lists, an error, _END
    round: ServedRound | None = None  # begun in its first draft iteration
    verification: asyncio.Task | None = None  # its verifier call, once made

    @property
    def session_id(self) -> str:
        return self.served.session_id

    def drop_calls(self) -> None:
        """Cancels its calls in flight: no one will wait for them."""
        if self.round is not None:
            self.round.cancel()
        _drop(self.verification)


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

    async def rounds(self, served: ServedRequest, drafter: DrafterAPI) -> AsyncIterator[list[int]]:
        """Puts an opened request on the schedule; yields each round's committed tokens."""
        session_id = served.session_id
        # What the session holds of its own on the verifier: its prefix's shared copy stays
        # there, pinned, in the prefix cache's budget (kv/prefixed.py), and costs it no load.
        own_slots = served.capacity - served.seq.request.num_prefix_tokens
        full_kv_bytes = own_slots * self.slot_bytes
        draft_len = served.seq.request.draft_len
        self.scheduler.add_request(SchedulerRequest(session_id, full_kv_bytes, 0, draft_len))
        entry = _Entry(served, drafter)
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
            entry.drop_calls()

    async def close(self) -> None:
        """Stops the schedule before its workers shut down: no call starts after that."""
        stopping = WorkerUnavailableError("the server is stopping")
        for entry in self._entries.values():
            entry.drop_calls()
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
            if entry.round is None:  # the round's first draft iteration: it begins
                self._begin_round(entry)
        for load in plan.loads:  # inside its round's drafting (Reservation.load_start)
            entry = self._entries[load.request_id]
            if entry.round is not None:  # else its verification loads when it starts
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
        in_flight = any(_calls_in_flight(entry) for entry in self._entries.values())
        left = self.scheduler.costs.iteration_s - (time.perf_counter() - started)
        await asyncio.sleep(left if in_flight and left > 0 else 0)

    def _begin_round(self, entry: _Entry) -> None:
        """Starts a round of the reserved draft length (`ServedRound.begin`)."""
        reserved = self.scheduler.request_state(entry.session_id).reservation.num_drafts
        costs = self.scheduler.costs
        entry.round = ServedRound.begin(
            entry.served, entry.drafter, reserved, costs.observe_iteration
        )

    def _start_verification(self, entry: _Entry, load_first: bool) -> None:
        """The round's one verifier call, made before its drafts exist: they reach the verifier
        by reference."""
        if entry.round is None:  # planned without a draft iteration of its own: it begins now
            self._begin_round(entry)
        entry.verification = asyncio.create_task(self._verify(entry.round, load_first))

    async def _verify(self, served_round: ServedRound, load_first: bool) -> Outcome:
        """The round's outcome: its result, or its error."""
        try:
            verified = await served_round.verify(self.verifier, load_first)
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
            served_round, entry.round, entry.verification = entry.round, None, None
            if entry.session_id not in self._entries:
                continue  # cancelled while it verified (its session closed)
            if isinstance(outcome, BaseException):
                self._fail(entry.session_id, outcome)
            else:
                self._finish_round(entry, served_round, outcome)

    def _finish_round(self, entry: _Entry, served_round: ServedRound, verified: Verified) -> None:
        """Commits the round; a request that is finished, or leaves for its warm drafter node,
        leaves the schedule."""
        traffic = verified.traffic  # its load's bytes and time among them
        if traffic.store_bytes and traffic.store_s > 0:
            self.scheduler.costs.observe_load(traffic.store_bytes, traffic.store_s)
        entry.outbox.put_nowait(served_round.finish(verified))
        served = entry.served
        leaves = served.seq.is_finished or served.is_leaving_schedule
        self.scheduler.on_verified(entry.session_id, verified.num_accepted, is_finished=leaves)
        if leaves:
            del self._entries[entry.session_id]
            entry.outbox.put_nowait(_END)

    def _fail(self, session_id: str, error: BaseException) -> None:
        entry = self._entries.pop(session_id, None)
        if entry is not None:
            self.scheduler.abort(session_id)
            entry.drop_calls()
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


def _calls_in_flight(entry: _Entry) -> bool:
    calls = (entry.verification, entry.round.drafting if entry.round else None)
    return any(call is not None and not call.done() for call in calls)


def _drop(task: asyncio.Task | None) -> None:
    """Cancels and forgets a task no one will wait for (its error, if any, included)."""
    if task is not None:
        task.cancel()
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
