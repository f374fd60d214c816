"""One served request: its state on the coordinator, and how each mode drives the workers.

The coordinator owns the request's tokens and decides when it ends (the engine's `StopChecker`, one
token at a time, so every mode stops at the same token); workers hold only its caches.
- VERICACHE: a round drafts up to x tokens on the drafter, then verifies them on the verifier,
  which returns the exact KV of the committed tokens; the next draft call carries it over.
- FULL_LOCAL: the verifier decodes alone over the full KV; FULL_REMOTE: a drafter that fetched the
  full KV over the slow link does; LOSSY: a drafter decodes over the compressed KV only.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from vericache.engine.request import SamplingParams
from vericache.engine.stops import StopChecker
from vericache.serve.handles import WorkerHandle
from vericache.serve.worker import ExactKV, WorkResult, cache_capacity
from vericache.v1 import vericache_pb2

Mode = vericache_pb2.Mode


@dataclass
class RequestPlan:
    """A checked Generate request, ready to run."""

    session_id: str
    mode: int  # vericache_pb2.Mode, never MODE_UNSPECIFIED
    prompt_ids: list[int]
    num_prefix_tokens: int
    prefix_id: str | None
    params: SamplingParams
    draft_len: int
    decode_chunk: int  # tokens per worker call when one worker decodes alone


@dataclass
class Traffic:
    link_bytes: int = 0
    link_wait_s: float = 0.0
    store_bytes: int = 0
    store_wait_s: float = 0.0

    def add(self, result: WorkResult) -> None:
        self.link_bytes += result.link_bytes
        self.link_wait_s += result.link_s
        self.store_bytes += result.store_bytes
        self.store_wait_s += result.store_s


@dataclass
class ServedRequest:
    plan: RequestPlan
    checker: StopChecker
    started_at: float = field(default_factory=time.perf_counter)
    token_ids: list[int] = field(default_factory=list)  # prompt + committed output
    finish_reason: str | None = None
    rounds: int = 0
    accepted_per_round: list[int] = field(default_factory=list)
    drafted_per_round: list[int] = field(default_factory=list)
    traffic: Traffic = field(default_factory=Traffic)
    first_token_at: float | None = None

    def __post_init__(self):
        self.token_ids = list(self.plan.prompt_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[len(self.plan.prompt_ids) :]

    @property
    def capacity(self) -> int:
        wanted = len(self.plan.prompt_ids) + self.plan.params.max_new_tokens + self.plan.draft_len
        return cache_capacity(wanted + 1, self.checker.max_total_tokens)

    def commit(self, tokens: list[int]) -> list[int]:
        """Appends tokens one at a time until a stop condition fires; returns those appended."""
        appended = []
        for token in tokens:
            if self.finish_reason is not None:
                break
            self.token_ids.append(token)
            appended.append(token)
            self.finish_reason = self.checker.finish_reason(self.output_ids, len(self.token_ids))
        if appended and self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        return appended

    def finish_round(self, drafts: list[int], verified: WorkResult) -> list[int]:
        """Commits a verified round: the accepted drafts and the verifier's own next token."""
        self.traffic.add(verified)
        accepted = verified.num_accepted
        committed = self.commit(drafts[:accepted] + [verified.tokens[accepted]])
        self.rounds += 1
        # A stop inside the accepted drafts ends the request before the rest is emitted.
        self.accepted_per_round.append(min(accepted, len(committed)))
        self.drafted_per_round.append(len(drafts))
        return committed

    def draft_target(self, draft_len: int | None = None) -> int:
        """Drafts for the next round: `draft_len` (the request's own by default) within the
        token budget and the context."""
        remaining = self.plan.params.max_new_tokens - len(self.output_ids)
        room = self.checker.max_total_tokens - len(self.token_ids)
        draft_len = self.plan.draft_len if draft_len is None else draft_len
        # A verification emits one token beyond the drafts; drafting past the budget is waste.
        return max(0, min(draft_len, remaining - 1, room))

    def decode_target(self) -> int:
        remaining = self.plan.params.max_new_tokens - len(self.output_ids)
        return max(1, min(self.plan.decode_chunk, remaining))

    def stats(self) -> vericache_pb2.GenerateStats:
        now = time.perf_counter()
        total = now - self.started_at
        first = self.first_token_at or now
        decode_time = now - first
        num_tokens = len(self.output_ids)
        accepted = self.accepted_per_round
        return vericache_pb2.GenerateStats(
            finish_reason=self.finish_reason or "cancelled",
            num_tokens=num_tokens,
            rounds=self.rounds,
            mean_accepted_per_round=sum(accepted) / len(accepted) if accepted else 0.0,
            accepted_per_round=accepted,
            link_bytes=self.traffic.link_bytes,
            store_bytes=self.traffic.store_bytes,
            link_wait_s=self.traffic.link_wait_s,
            store_wait_s=self.traffic.store_wait_s,
            ttft_s=first - self.started_at,
            tokens_per_s=(num_tokens - 1) / decode_time if decode_time > 0 else 0.0,
            total_s=total,
        )


class Schedule(Protocol):
    """Runs VERICACHE rounds across requests (scheduled.py) instead of one request alone."""

    def rounds(
        self, request: ServedRequest, drafter: WorkerHandle, opened: WorkResult
    ) -> AsyncIterator[list[int]]: ...


async def run_request(
    request: ServedRequest,
    verifier: WorkerHandle | None,
    drafter: WorkerHandle | None,
    transfer_address: str,
    schedule: Schedule | None = None,
) -> AsyncIterator[list[int]]:
    """Drives the workers for one request; yields each batch of committed tokens. VERICACHE
    rounds run on `schedule` when given, else on their own."""
    plan = request.plan
    if plan.mode == Mode.VERICACHE:
        rounds = _vericache(request, verifier, drafter, transfer_address, schedule)
    elif plan.mode == Mode.FULL_LOCAL:
        opening = _open_verifier(request, verifier, False)
        rounds = _alone(request, verifier, "decode", opening)
    else:
        role = "full" if plan.mode == Mode.FULL_REMOTE else "lossy"
        opening = _open_drafter(request, drafter, role, transfer_address)
        rounds = _alone(request, drafter, "step", opening)
    async for tokens in rounds:
        yield tokens


async def _open_verifier(request: ServedRequest, verifier, exact_for_drafter: bool) -> WorkResult:
    plan = request.plan
    return await verifier.call(
        "open",
        plan.session_id,
        plan.prefix_id,
        plan.prompt_ids,
        request.capacity,
        exact_for_drafter,
    )


async def _open_drafter(request: ServedRequest, drafter, role: str, address: str) -> WorkResult:
    plan = request.plan
    return await drafter.call(
        "open",
        plan.session_id,
        role,
        address,
        plan.prefix_id,
        plan.prompt_ids,
        plan.num_prefix_tokens,
        request.capacity,
    )


async def _alone(
    request: ServedRequest, worker: WorkerHandle, method: str, opening
) -> AsyncIterator[list[int]]:
    """One worker decodes: the first token from its prefill, then `method` calls that each
    decode `decode_chunk` tokens."""
    opened = await opening
    request.traffic.add(opened)
    request.rounds += 1
    yield request.commit(opened.tokens)
    end_ids = sorted(request.checker.end_ids)
    while request.finish_reason is None:
        target = request.decode_target()
        result = await worker.call(
            method, request.plan.session_id, request.output_ids[-1:], target, end_ids
        )
        request.traffic.add(result)
        request.rounds += len(result.tokens)
        yield request.commit(result.tokens)


async def _vericache(
    request: ServedRequest,
    verifier: WorkerHandle,
    drafter: WorkerHandle,
    address: str,
    schedule: Schedule | None,
) -> AsyncIterator[list[int]]:
    plan = request.plan
    # The verifier prefills the prompt while the drafter fetches the compressed prefix.
    opened, fetched = await asyncio.gather(
        _open_verifier(request, verifier, True), _open_drafter(request, drafter, "draft", address)
    )
    request.traffic.add(opened)
    request.traffic.add(fetched)
    yield request.commit(opened.tokens)
    if schedule is not None:
        if request.finish_reason is None:
            async with contextlib.aclosing(schedule.rounds(request, drafter, opened)) as rounds:
                async for tokens in rounds:
                    yield tokens
        return
    end_ids = sorted(request.checker.end_ids)
    exact: ExactKV | None = opened.exact
    link_delay = opened.link_delay_s
    while request.finish_reason is None:
        target = request.draft_target()
        drafts: list[int] = []
        if target > 0:
            await _cross_link(request, link_delay)
            stepped = await drafter.call(
                "step", plan.session_id, request.output_ids[-1:], target, end_ids, exact
            )
            drafts = stepped.tokens
        verified = await verifier.call("verify", plan.session_id, request.output_ids[-1:], drafts)
        exact, link_delay = verified.exact, verified.link_delay_s
        yield request.finish_round(drafts, verified)


async def _cross_link(request: ServedRequest, delay: float) -> None:
    """Waits until the verifier's exact KV has crossed the link to the drafter."""
    if delay > 0:
        await asyncio.sleep(delay)
        request.traffic.link_wait_s += delay
