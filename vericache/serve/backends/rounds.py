"""One served request: its state on the coordinator, and how each mode drives the workers.

The coordinator owns the request's tokens and decides when it ends: its `Sequence` (the engine's,
engine/sequence.py) begins, accepts and commits every round exactly as the in-process engines do;
workers hold only its caches.
- VERICACHE: a round is one drafter call (a whole draft of up to x tokens, carrying the exact KV of
  the previous round's committed tokens) and one verifier call, which returns the exact KV of the
  tokens it commits (served_round.py). A schedule (scheduled.py) places the rounds: back to back,
  each request on its own, or staggered or lock-step across a verifier's requests. Once its
  drafter node holds the prefix's full KV in its host tier (warm_node.py), a request leaves its
  schedule between two rounds and its rounds move there: one call each, drafted and verified on
  that node, and the central verifier is let go (local_rounds.py).
- FULL_LOCAL: the verifier decodes alone over the full KV; FULL_REMOTE: a drafter that fetched the
  full KV over the slow link does; LOSSY: a drafter decodes over the compressed KV only.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vericache.engine.device_memory import full_kv_capacity
from vericache.engine.request import GrammarState, Request, TokenLogprob
from vericache.engine.sampling import SequenceSampler
from vericache.engine.sequence import Sequence
from vericache.scheduler.path_choice import ServingPath
from vericache.serve.api_types import GenerateSummary, ServeMode
from vericache.serve.backends.local_rounds import (
    go_local,
    local_rounds,
    may_verify_on,
    same_arithmetic,
)
from vericache.serve.backends.served_round import KeptSetRefreshes, KVHandover
from vericache.serve.workers.worker_api import (
    DecodeCall,
    DrafterAPI,
    DraftRole,
    LocalRound,
    OpenDrafter,
    OpenVerifier,
    Traffic,
    Verified,
    VerifierAPI,
    VerifierOpened,
)

if TYPE_CHECKING:
    from vericache.serve.backends.scheduled import Schedule


@dataclass(frozen=True)
class RequestPlan:
    """A checked Generate request, ready to run."""

    session_id: str  # also the request id of its logs and status details
    mode: ServeMode
    prefix_id: str | None
    tenant: str  # "" for the anonymous tenant
    # The engine's request: prompt, prefix length, sampling, decode mode, compressor, draft length.
    request: Request
    decode_chunk: int  # tokens per worker call when one worker decodes alone
    # Its prefix's compressed KV bytes over its full KV bytes (PrefixRecord): what auto prices.
    compressed_share: float = 1.0


@dataclass
class ServedRequest:
    plan: RequestPlan
    seq: Sequence
    traffic: Traffic = Traffic()
    started_at: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    num_round_calls: int = 0  # worker calls its VERICACHE rounds made (draft and verify)
    num_local_rounds: int = 0  # of its rounds, those its warm drafter node verified itself
    num_migrations: int = 0  # times it went on elsewhere after a worker died
    reused_tokens: int = 0  # of its prompt after the prefix, those a kept turn held (turn_cache.py)
    drafter_is_warm: bool = False  # its drafter said it holds the prefix's full KV
    # Its rounds may move to its drafter node once that is warm: the node verifies with the
    # verifier's arithmetic, and its tier did not let the prefix go when the request last tried.
    may_go_local: bool = False
    # The verifier's exact KV that its next draft call carries (served_round.py).
    handover: KVHandover = KVHandover()
    kept_set_refreshes: KeptSetRefreshes = field(default_factory=KeptSetRefreshes)
    # Where it was placed: the mean count of requests on its decoding worker over its life, it
    # included (auto_path.py, worker_load.py), and whether that drafter was warm for its prefix
    # (a FULL_REMOTE request then reads its tier).
    worker_load: float = 1.0
    co_runners: float = 0.0  # and the mean count of workers busy beside it (co_runners.py)
    on_warm_node: bool = False
    # The arithmetic of the worker whose forwards choose its tokens (`ModelInfo.numerics`), from
    # its first placement on: where it goes on after a worker died, it stays on such a worker.
    numerics: str = ""
    # Called once its rounds moved to its warm drafter node: the central verifier no longer
    # counts it among its load (placement, distributed.py).
    release_verifier: Callable[[], None] = lambda: None

    @property
    def history(self) -> tuple[int, ...]:
        """What a worker session is opened with: the prompt and every committed token but the
        newest (which stays `pending`). A request that lost its workers goes on from here: the
        verifier's prefill of it gives the same bits its rounds did (batch-invariant kernels)."""
        token_ids = self.seq.token_ids
        return tuple(token_ids[:-1] if self.seq.output_ids else token_ids)

    @property
    def opening_sampler(self) -> SequenceSampler | None:
        """The sampler of the token after `history` (None: greedy): a session's first token."""
        seq = self.seq
        sampler = seq.sampler()
        if sampler is None or not seq.output_ids:
            return sampler
        return dataclasses.replace(sampler, history=sampler.history[:-1])

    @property
    def grammar(self) -> GrammarState | None:
        """What a worker call needs to choose under the request's constraint, if it has one."""
        constraint = self.plan.request.constraint
        if constraint is None:
            return None
        return GrammarState(constraint, tuple(self.seq.output_ids))

    @property
    def is_resumed(self) -> bool:
        """Its sessions open after tokens were committed: their first token is known already."""
        return bool(self.seq.output_ids)

    @property
    def session_id(self) -> str:
        return self.plan.session_id

    @property
    def is_leaving_schedule(self) -> bool:
        """Its next rounds go to its warm drafter node: its schedule lets it go."""
        return self.may_go_local and self.drafter_is_warm and not self.seq.is_finished

    @property
    def pending(self) -> tuple[int, ...]:
        """The newest committed token: the one no cache has been fed yet."""
        return tuple(self.seq.token_ids[-1:])

    @property
    def end_ids(self) -> frozenset[int]:
        return frozenset(self.seq.stop_checker.end_ids)

    @property
    def capacity(self) -> int:
        """Cache slots for the whole request: prompt, output and one round's drafts."""
        return full_kv_capacity(self.plan.request, self.seq.stop_checker.max_total_tokens)

    def add(self, traffic: Traffic) -> None:
        self.traffic = self.traffic + traffic

    def commit(self, tokens: list[int], logprobs: tuple[TokenLogprob, ...] = ()) -> list[int]:
        """Tokens committed outside a round or decode step (the prefill's first token)."""
        return self._first_token_seen(self.seq.commit(tokens, logprobs))

    def commit_decoded(
        self, tokens: list[int], logprobs: tuple[TokenLogprob, ...] = ()
    ) -> list[int]:
        return self._first_token_seen(self.seq.commit_decoded(tokens, logprobs))

    def finish_round(self, verified: Verified | LocalRound) -> list[int]:
        """Commits a verified round (`Sequence.finish_round`)."""
        if isinstance(verified, Verified):
            self.add(verified.traffic)
        outcome = self.seq.finish_round(list(verified.tokens), verified.logprobs)
        return self._first_token_seen(list(outcome.committed))

    def _first_token_seen(self, committed: list[int]) -> list[int]:
        if committed and self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        return committed

    def summary(self) -> GenerateSummary:
        now = time.perf_counter()
        first = self.first_token_at or now
        num_tokens = len(self.seq.output_ids)
        stats = self.seq.stats
        decode_time = now - first
        return GenerateSummary(
            finish_reason=self.seq.finish_reason or "cancelled",
            num_tokens=num_tokens,
            rounds=stats.rounds,
            accepted_per_round=tuple(stats.accepted_per_round),
            link_bytes=self.traffic.link_bytes,
            store_bytes=self.traffic.store_bytes,
            link_wait_s=self.traffic.link_s,
            store_wait_s=self.traffic.store_s,
            ttft_s=first - self.started_at,
            tokens_per_s=(num_tokens - 1) / decode_time if decode_time > 0 else 0.0,
            total_s=now - self.started_at,
            seed=self.seq.seed,
            prompt_tokens=len(self.seq.request.prompt_ids),
            local_rounds=self.num_local_rounds,
            kept_set_refreshes=self.kept_set_refreshes.taken,
            kept_set_refreshes_dropped=self.kept_set_refreshes.dropped,
            path=self.path.value if self.path else self.plan.mode.value,
            cached_tokens=self.plan.request.num_prefix_tokens + self.reused_tokens,
        )

    @property
    def path(self) -> ServingPath | None:
        """How it is served, in auto's terms (None: LOSSY, which auto never chooses)."""
        mode = self.plan.mode
        if mode is ServeMode.LOSSY:
            return None
        if mode is ServeMode.FULL_REMOTE and self.on_warm_node:
            return ServingPath.FULL_WARM
        return ServingPath(mode.value)


async def run_request(
    served: ServedRequest,
    verifier: VerifierAPI,
    drafter: DrafterAPI | None,
    transfer_address: str,
    schedule: Schedule,
) -> AsyncIterator[list[int]]:
    """Drives the workers for one request; yields each batch of committed tokens. VERICACHE
    rounds verified by `verifier` run on its `schedule`."""
    mode = served.plan.mode
    if mode is ServeMode.VERICACHE:
        rounds = _vericache(served, verifier, drafter, transfer_address, schedule)
    elif mode is ServeMode.FULL_LOCAL:
        rounds = _alone(served, verifier, _open_verifier(served, verifier, False))
    else:
        role = DraftRole.FULL if mode is ServeMode.FULL_REMOTE else DraftRole.LOSSY
        rounds = _alone(served, drafter, _open_drafter(served, drafter, role, transfer_address))
    async for tokens in rounds:
        yield tokens


async def _open_verifier(
    served: ServedRequest, verifier: VerifierAPI, for_drafter: bool
) -> VerifierOpened:
    call = OpenVerifier(
        served.session_id, served.history, served.plan.prefix_id, served.capacity, for_drafter,
        served.opening_sampler, grammar=served.grammar,
        steer_every=served.plan.request.steer_every if for_drafter else 0,
    )  # fmt: skip
    opened = await verifier.open(call)
    served.add(opened.traffic)
    served.reused_tokens = opened.reused_tokens
    served.handover = KVHandover.of(opened)
    return opened


async def _open_drafter(
    served: ServedRequest,
    drafter: DrafterAPI,
    role: DraftRole,
    address: str,
    warms: bool = False,
):
    """`warms`: a DRAFT session on a node that could verify it (the verifier's arithmetic): the
    node may stream the prefix's full KV into its host tier."""
    request = served.plan.request
    call = OpenDrafter(
        served.session_id, role, address, served.plan.prefix_id, served.history,
        request.num_prefix_tokens, served.capacity, sampler=served.opening_sampler,
        warms_host_tier=warms, grammar=served.grammar,
    )  # fmt: skip
    opened = await drafter.open(call)
    served.add(opened.traffic)
    if role is not DraftRole.DRAFT:  # a DRAFT session prefills nothing: its verifier's counts
        served.reused_tokens = opened.reused_tokens
    return opened


async def _alone(served: ServedRequest, worker, opening) -> AsyncIterator[list[int]]:
    """One worker decodes: the first token from its prefill, then calls that each decode up to
    `decode_chunk` tokens, within the budget and the context."""
    resumed = served.is_resumed
    opened = await opening
    if not resumed:
        yield served.commit_decoded([opened.first_token], opened.logprobs)
    seq = served.seq
    while not seq.is_finished:
        num_tokens = seq.decode_target(served.plan.decode_chunk)
        call = DecodeCall(
            served.session_id, served.pending, num_tokens, served.end_ids, seq.sampler(),
            served.grammar,
        )  # fmt: skip
        decoded = await worker.decode(call)
        served.add(decoded.traffic)
        yield served.commit_decoded(list(decoded.tokens), decoded.logprobs)


async def _vericache(
    served: ServedRequest,
    verifier: VerifierAPI,
    drafter: DrafterAPI,
    address: str,
    schedule: Schedule,
) -> AsyncIterator[list[int]]:
    """Its rounds on the verifier's schedule until its drafter node is warm for the prefix, and
    from then on on that node; from its start there where the node is warm already."""
    resumed = served.is_resumed
    served.may_go_local = same_arithmetic(drafter, verifier)
    served.drafter_is_warm = False  # until this drafter says so (it may be a new one)
    if may_verify_on(drafter, verifier, served.plan.prefix_id):
        # Its drafter node is warm for the prefix: the request starts there, no central verifier.
        await _open_drafter(served, drafter, DraftRole.DRAFT, address, warms=True)
        local = await go_local(served, verifier, drafter, None, needs_first_token=not resumed)
        if local is not None:
            if not resumed:
                yield served.commit([local.first_token], local.logprobs)
            async for tokens in local_rounds(served, drafter):
                yield tokens
            return
        opened = await _open_verifier(served, verifier, True)  # evicted since: central after all
    else:
        # The verifier prefills the prompt while the drafter fetches the compressed prefix.
        opened, _ = await asyncio.gather(
            _open_verifier(served, verifier, True),
            _open_drafter(served, drafter, DraftRole.DRAFT, address, served.may_go_local),
        )
    if not resumed:
        yield served.commit([opened.first_token], opened.logprobs)
    while not served.seq.is_finished:
        async with contextlib.aclosing(schedule.rounds(served, drafter)) as rounds:
            async for tokens in rounds:
                yield tokens
        if served.is_leaving_schedule:
            if await go_local(served, verifier, drafter, served.handover.exact) is not None:
                async for tokens in local_rounds(served, drafter):
                    yield tokens
                return
            served.may_go_local = False  # its tier let the prefix go meanwhile: it stays central
