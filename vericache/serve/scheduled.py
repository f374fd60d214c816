"""Scheduled VERICACHE rounds: one scheduler per verifier plans every draft step, verification and
full-KV load of the requests verified there (CoordinatorConfig.scheduling "staggered" or
"lockstep"), the same scheduler objects that drive the long-context engine and the simulator.

What the scheduler's words stand for here:
- an iteration is one batched draft step on each drafter (one token for every drafting request)
  running beside one batched verification on the verifier;
- a load is the verifier bringing a session's full KV from its store onto its device
  (`Verifier.load`), started in the iteration the plan says and awaited before the verification;
- the memory ring is the verifier's device memory: its weights and the full KV kept for
  verification (`VerifierConfig.resident_bytes`); compressed KV lives on the drafters;
- the link ring is the store-to-device bandwidth, first measured by the verifier, then by every
  load.
Each verification hands the drafter the exact KV of the committed tokens; it crosses the slow link
before the request's next draft step, as in per-request rounds.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from vericache.scheduler import (
    BaseScheduler,
    CostModel,
    LockstepScheduler,
    SchedulerRequest,
    StaggeredScheduler,
    Verify,
)
from vericache.serve.config import CoordinatorConfig
from vericache.serve.handles import WorkerHandle
from vericache.serve.metrics import ServeMetrics
from vericache.serve.rounds import ServedRequest
from vericache.serve.worker import ExactKV, WorkResult

_END = object()  # the outbox's last item


@dataclass
class _Entry:
    """A request on the schedule: what its next draft step and verification need."""

    served: ServedRequest
    drafter: WorkerHandle
    exact: ExactKV | None  # the verifier's KV of the tokens committed since the last draft
    link_delay_s: float  # until `exact` has crossed the link
    outbox: asyncio.Queue = field(default_factory=asyncio.Queue)  # token lists, an error, _END
    round_target: int | None = None  # drafts this round; None until its first draft step
    drafts: list[int] = field(default_factory=list)
    load: asyncio.Task | None = None
    verification: asyncio.Task | None = None  # its batch's, shared with the batch's others

    @property
    def session_id(self) -> str:
        return self.served.plan.session_id

    def wants_draft_step(self) -> bool:
        ended = bool(self.drafts) and self.drafts[-1] in self.served.checker.end_ids
        return len(self.drafts) < self.round_target and not ended


class ScheduledRounds:
    """The rounds of every scheduled request verified on one verifier."""

    def __init__(
        self,
        verifier: WorkerHandle,
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
        self, served: ServedRequest, drafter: WorkerHandle, opened: WorkResult
    ) -> AsyncIterator[list[int]]:
        """Puts an opened request on the schedule; yields each round's committed tokens."""
        session_id = served.plan.session_id
        full_kv_bytes = served.capacity * self.slot_bytes
        self.scheduler.add_request(
            SchedulerRequest(session_id, full_kv_bytes, 0, served.plan.draft_len)
        )
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
            _drop(entry.load)

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
        plan = self.scheduler.schedule()
        if self.metrics is not None:
            scheduled = self.scheduler.metrics
            self.metrics.iteration_planned(scheduled.iterations[-1], scheduled.peak_memory_bytes)
        for load in plan.loads:
            self._start_load(self._entries[load.request_id])
        if plan.verify_starts:
            self._start_verification([self._entries[v.request_id] for v in plan.verify_starts])
        started = time.perf_counter()
        drafted = await self._draft_step(plan.draft_ids)
        # The iteration's own work is the draft step: waiting for a verification to end (or a
        # late load) is the verifier's time, which V, the iterations a verification spans, counts.
        elapsed = time.perf_counter() - started
        await self._report(plan.verifies)
        self.scheduler.end_iteration(elapsed if drafted and elapsed > 0 else None)
        if not drafted:
            await self._idle(plan.is_idle)

    async def _idle(self, is_idle: bool) -> None:
        """An iteration without a draft step lasts until a verification or load in flight ends,
        or an iteration's time: the plan's clock keeps pace with the workers."""
        in_flight = {
            task
            for entry in self._entries.values()
            for task in (entry.verification, entry.load)
            if task is not None and not task.done()
        }
        if in_flight:
            timeout = self.scheduler.costs.iteration_s
            await asyncio.wait(in_flight, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        elif is_idle:
            await asyncio.sleep(0.001)  # requests wait for room: let the running ones finish

    def _start_load(self, entry: _Entry) -> None:
        entry.load = asyncio.create_task(self.verifier.call("load", entry.session_id))

    async def _draft_step(self, request_ids: tuple[str, ...]) -> bool:
        """One draft token for each request drafting now, a batched call per drafter; returns
        whether any drafted."""
        batches: dict[WorkerHandle, list[_Entry]] = defaultdict(list)
        for request_id in request_ids:
            entry = self._entries[request_id]
            if entry.round_target is None:  # a round begins
                reserved = self.scheduler.request_state(request_id).reservation.num_draft_tokens
                entry.round_target = entry.served.draft_target(reserved)
                entry.drafts = []
            if entry.wants_draft_step():
                batches[entry.drafter].append(entry)
        await asyncio.gather(*(self._draft_batch(d, batch) for d, batch in batches.items()))
        return bool(batches)

    async def _draft_batch(self, drafter: WorkerHandle, batch: list[_Entry]) -> None:
        steps = []
        delay = 0.0
        for entry in batch:
            exact, entry.exact = entry.exact, None
            pending = entry.drafts[-1:] or entry.served.output_ids[-1:]
            end_ids = sorted(entry.served.checker.end_ids)
            steps.append((entry.session_id, pending, 1, end_ids, exact))
            if exact is not None:  # the round's first step waits for its exact KV
                delay = max(delay, entry.link_delay_s)
                entry.served.traffic.link_wait_s += entry.link_delay_s
        if delay > 0:
            await asyncio.sleep(delay)
        try:
            results = await drafter.call("step_many", steps)
        except Exception as exc:  # noqa: BLE001 - the batch's requests fail, the others go on
            for entry in batch:
                self._fail(entry.session_id, exc)
            return
        for entry, result in zip(batch, results):
            if result is not None:  # None: its session closed meanwhile (cancelled)
                entry.drafts += result.tokens

    def _start_verification(self, entries: list[_Entry]) -> None:
        """Verifies the requests whose drafts are done, as one batch that runs on while the
        others draft; each is reported in the iteration its reservation ends (`_report`)."""
        batch = asyncio.create_task(self._verify_batch(entries))
        for entry in entries:
            entry.verification = batch

    async def _verify_batch(
        self, entries: list[_Entry]
    ) -> dict[str, WorkResult | Exception | None]:
        """Waits for the batch's loads, then verifies it in one call; a session's outcome is its
        result or its error (None: closed meanwhile)."""
        outcomes: dict[str, WorkResult | Exception | None] = {}
        loads = await asyncio.gather(*(_loaded(e) for e in entries), return_exceptions=True)
        ready = []
        for entry, loaded in zip(entries, loads):
            entry.load = None
            if isinstance(loaded, Exception):
                outcomes[entry.session_id] = loaded
            else:
                self._record_load(entry, loaded)
                ready.append(entry)
        ready = [e for e in ready if e.session_id in self._entries]  # not cancelled meanwhile
        calls = [(e.session_id, e.served.output_ids[-1:], e.drafts) for e in ready]
        started = time.perf_counter()
        try:
            results = await self.verifier.call("verify_many", calls) if calls else []
        except Exception as exc:  # noqa: BLE001 - the batch's requests fail, the others go on
            results = [exc] * len(ready)
        else:
            if calls:
                self.scheduler.costs.observe_verification(time.perf_counter() - started)
        outcomes.update((e.session_id, result) for e, result in zip(ready, results))
        return outcomes

    async def _report(self, verifies: tuple[Verify, ...]) -> None:
        """Finishes the rounds whose verification ends in this iteration (waiting for it)."""
        for verify in verifies:
            entry = self._entries.get(verify.request_id)
            if entry is None:  # cancelled meanwhile
                continue
            outcomes = await entry.verification
            outcome = outcomes.get(entry.session_id)
            entry.verification = None
            if entry.session_id not in self._entries or outcome is None:
                continue  # cancelled while it verified (its session closed)
            if isinstance(outcome, Exception):
                self._fail(entry.session_id, outcome)
            else:
                self._finish_round(entry, outcome)

    def _record_load(self, entry: _Entry, loaded: WorkResult) -> None:
        entry.served.traffic.add(loaded)
        if loaded.store_bytes and loaded.store_s > 0:
            self.scheduler.costs.observe_load(loaded.store_bytes, loaded.store_s)

    def _finish_round(self, entry: _Entry, verified: WorkResult) -> None:
        served = entry.served
        committed = served.finish_round(entry.drafts, verified)
        entry.exact, entry.link_delay_s = verified.exact, verified.link_delay_s
        entry.round_target, entry.drafts = None, []
        is_finished = served.finish_reason is not None
        accepted = verified.num_accepted
        self.scheduler.on_verified(entry.session_id, accepted, is_finished=is_finished)
        entry.outbox.put_nowait(committed)
        if is_finished:
            del self._entries[entry.session_id]
            entry.outbox.put_nowait(_END)

    def _fail(self, session_id: str, error: BaseException) -> None:
        entry = self._entries.pop(session_id, None)
        if entry is not None:
            self.scheduler.abort(session_id)
            _drop(entry.load)
            entry.outbox.put_nowait(error)


def new_scheduled_rounds(
    verifier: WorkerHandle,
    about: dict,
    load_bytes_per_s: float,
    draft_step_s: float,
    config: CoordinatorConfig,
    metrics: ServeMetrics | None = None,
) -> ScheduledRounds:
    """The schedule of one verifier, from what it described of itself (`Verifier.describe`), its
    load bandwidth and the time of a draft step; both estimates are refined as it runs."""
    costs = CostModel(
        iteration_s=draft_step_s,
        link_bytes_per_s=load_bytes_per_s,
        memory_budget_bytes=about["weights_bytes"] + about["resident_bytes"],
        weights_bytes=about["weights_bytes"],
    )

    def new_scheduler(costs: CostModel) -> BaseScheduler:
        if config.scheduling == "lockstep":
            draft_len = min(config.default_draft_len, config.scheduler.window - 1)
            return LockstepScheduler(costs, draft_len, config.scheduler)
        return StaggeredScheduler(costs, config.scheduler)

    return ScheduledRounds(verifier, new_scheduler, costs, about["slot_bytes"], metrics)


async def _loaded(entry: _Entry) -> WorkResult:
    # Every round books a load before its verification; none would mean the KV is resident.
    return WorkResult() if entry.load is None else await entry.load


def _drop(task: asyncio.Task | None) -> None:
    """Forgets a load no one will wait for (its error, if any, included)."""
    if task is not None:
        task.cancel()
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
