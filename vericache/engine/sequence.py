"""Per-request decoding state, and the one implementation of a round.

A `Sequence` is a request's committed tokens, when they stop, the round in progress and its
statistics, wherever the request decodes: the engine and the long-context engine hold its caches
too; a coordinator, whose workers hold the caches, holds it alone. Every driver of a round (the
engine, the long-context engine, the coordinator's per-request and scheduled rounds) begins,
accepts and commits it here, so all of them stop at the same token for the same reason:
- `begin_round(x)`: the drafts wanted, x within the token budget and the model's context;
- `finish_round(verified)`: the accepted drafts and the verifier's own token, committed one at a
  time through the stop checks;
- `decode_target(n)` and `commit_decoded(tokens)`: the same for full and lossy decoding.

A cache is owed every token of the sequence past its `num_tokens` (vLLM v1's "no phases, only
debts"): prefill, a decode step, a draft step and a verification all feed `token_ids[cache.
num_tokens:]`, plus the current drafts for a verification.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vericache.engine.request import (
    DecodeMode,
    Request,
    RequestOutput,
    RequestStats,
    TokenLogprob,
)
from vericache.engine.stops import StopChecker

if TYPE_CHECKING:  # rounds stay torch-free: the simulator runs them too (vericache.sim)
    from vericache.engine.sampling import SequenceSampler
    from vericache.kv.cache import KVCache
    from vericache.kv.compressed import CompressedKV


def num_accepted(draft_ids: list[int], verified_ids: list[int]) -> int:
    """Length of the longest draft prefix the verifier agrees with."""
    for index, (draft, verified) in enumerate(zip(draft_ids, verified_ids)):
        if draft != verified:
            return index
    return len(draft_ids)


@dataclass(frozen=True)
class RoundOutcome:
    committed: tuple[int, ...]  # accepted drafts + the correction or bonus token, cut at a stop
    num_drafted: int
    num_accepted: int  # drafts the verifier agreed with (the cache keeps their KV)


@dataclass
class Sequence:
    request: Request
    stop_checker: StopChecker
    token_ids: list[int]  # prompt + committed output
    # Where the request decodes in this process; None where workers hold its caches.
    full_cache: KVCache | None = None
    compressed_cache: CompressedKV | None = None
    draft_ids: list[int] = field(default_factory=list)  # this round's drafts, not yet verified
    num_drafts: int | None = None  # drafts wanted this round; None between rounds
    # Rejection coupling: the distribution [V] each draft was sampled from (opaque here: torch
    # tensors the engine keeps with the round).
    draft_distributions: list = field(default_factory=list)
    # [len(output_ids)] where the request asks for log-probabilities (`SamplingParams.logprobs`)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stats: RequestStats = field(default_factory=RequestStats)
    seed: int | None = None  # the sampling seed: the request's, or one drawn for it
    started_at: float = field(default_factory=time.perf_counter)
    # The grammar state of a constrained request (engine/constraint.py's TokenConstraint: opaque
    # here, as the simulator runs this module without torch); it consumes every committed token.
    constraint: object | None = None
    # Where the request steers its drafter's kept set (compress/steering.py's KeptSetSteering,
    # opaque here as the constraint is): it records the verifications' queries.
    steering: object | None = None

    @classmethod
    def start(
        cls, request: Request, eos_token_ids: tuple[int, ...], max_positions: int, tokenizer=None
    ) -> Sequence:
        checker = StopChecker(request.params, eos_token_ids, max_positions, tokenizer)
        seed = request.params.seed
        if request.params.is_sampled and seed is None:
            seed = secrets.randbits(63)  # reported with the output
        return cls(
            request=request,
            stop_checker=checker,
            token_ids=list(request.prompt_ids),
            seed=seed,
        )

    @property
    def mode(self) -> DecodeMode:
        return self.request.mode

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    def sampler(self, following: tuple[int, ...] | list[int] = ()) -> SequenceSampler | None:
        """How the next tokens are chosen, after the output and `following` (a draft step's
        earlier drafts); None where they are the logits' plain argmax."""
        params = self.request.params
        if not params.needs_sampler:
            return None
        # Imported here: the simulator uses this module, and runs without torch.
        from vericache.engine.sampling import SequenceSampler

        history = (*self.output_ids, *following)
        return SequenceSampler(params, self.seed, self.request.prompt_ids, history)

    @property
    def is_rejection_coupled(self) -> bool:
        """Its drafts are checked by rejection coupling (vericache rounds only)."""
        return self.mode is DecodeMode.VERICACHE and self.request.params.is_rejection_coupled

    @property
    def num_remaining(self) -> int:
        """Output tokens the token budget still allows."""
        return self.request.params.max_new_tokens - len(self.output_ids)

    @property
    def room(self) -> int:
        """Tokens the model's context still has room for."""
        return self.stop_checker.max_total_tokens - len(self.token_ids)

    # -- rounds (vericache) ---------------------------------------------------------------------

    def drafts_wanted(self, draft_len: int) -> int:
        """Drafts worth making in a round of up to `draft_len`: a verification emits one token
        beyond them, and it feeds every draft at a position the context must hold."""
        return max(0, min(draft_len, self.num_remaining - 1, self.room))

    def begin_round(self, draft_len: int) -> int:
        """Starts a round of up to `draft_len` drafts; returns how many it wants (0: the budget
        leaves one token, which the verification alone chooses)."""
        self.draft_ids, self.draft_distributions = [], []
        self.num_drafts = self.drafts_wanted(draft_len)
        return self.num_drafts

    @property
    def wants_draft_step(self) -> bool:
        """The round in progress drafts on: fewer drafts than wanted, no end token yet, and no
        draft known to be rejected (`Request.expected_ids`)."""
        ended = bool(self.draft_ids) and self.draft_ids[-1] in self.stop_checker.end_ids
        return len(self.draft_ids) < self.num_drafts and not ended and not self._diverged

    @property
    def _diverged(self) -> bool:
        """The newest draft differs from the known full-KV output at its position."""
        expected = self.request.expected_ids
        if expected is None or not self.draft_ids:
            return False
        position = len(self.output_ids) + len(self.draft_ids) - 1
        return position < len(expected) and self.draft_ids[-1] != expected[position]

    def finish_round(
        self, verified: list[int], logprobs: tuple[TokenLogprob, ...] = ()
    ) -> RoundOutcome:
        """Commits a verified round. verified: the verifier's choice after each of the round's
        fed tokens, [1 + num drafts]; the accepted drafts and the choice after them (the
        correction, or the bonus after all) are committed one at a time through the stop checks.
        logprobs: the verifier's at each position of `verified`, where the request asks."""
        drafts = self.draft_ids
        accepted = num_accepted(drafts, verified)
        committed = self.commit([*drafts[:accepted], verified[accepted]], logprobs)
        self.stats.rounds += 1
        self.stats.drafted_per_round.append(len(drafts))
        # A stop inside the accepted drafts ends the sequence before the rest is emitted.
        self.stats.accepted_per_round.append(min(accepted, len(committed)))
        self.draft_ids, self.num_drafts, self.draft_distributions = [], None, []
        return RoundOutcome(tuple(committed), len(drafts), accepted)

    # -- decoding (full, lossy) -----------------------------------------------------------------

    def decode_target(self, max_tokens: int) -> int:
        """Tokens a decode call may choose: up to `max_tokens`, within the token budget and the
        context (a finished sequence makes no call)."""
        return max(1, min(max_tokens, self.num_remaining, self.room))

    def commit_decoded(
        self, tokens: list[int], logprobs: tuple[TokenLogprob, ...] = ()
    ) -> list[int]:
        """Commits decoded tokens (one decode step each); returns those the stop checks let in."""
        self.stats.rounds += len(tokens)
        return self.commit(tokens, logprobs)

    # -- both -----------------------------------------------------------------------------------

    def commit(self, tokens: list[int], logprobs: tuple[TokenLogprob, ...] = ()) -> list[int]:
        """Appends output tokens one at a time until a stop condition fires; returns those
        appended. logprobs: each token's (`TokenLogprob`), where the request asks for them."""
        if self.request.params.logprobs is not None and len(logprobs) < len(tokens):
            raise ValueError(f"{len(tokens)} tokens came with {len(logprobs)} log-probabilities")
        appended = []
        for index, token in enumerate(tokens):
            if self.is_finished:
                break
            self.token_ids.append(token)
            appended.append(token)
            if self.request.params.logprobs is not None:
                self.logprobs.append(logprobs[index])
            if self.constraint is not None:
                self.constraint.commit((token,))
            self.stats.num_output_tokens += 1
            reason = self.stop_checker.finish_reason(self.output_ids, len(self.token_ids))
            if reason is not None:
                self.finish(reason)
        return appended

    def finish(self, reason: str) -> None:
        self.finish_reason = reason
        self.stats.total_s = time.perf_counter() - self.started_at
        self.full_cache = self.compressed_cache = None  # release memory now

    def output(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request.request_id,
            prompt_ids=list(self.request.prompt_ids),
            token_ids=self.output_ids,
            text=self.stop_checker.output_text(self.output_ids),
            finish_reason=self.finish_reason,
            stats=self.stats,
            seed=self.seed,
            logprobs=list(self.logprobs) if self.request.params.logprobs is not None else None,
        )

    # -- what the caches are fed ----------------------------------------------------------------

    @property
    def needs_compressed_forward(self) -> bool:
        """A draft step (vericache) or a decode step (lossy) this iteration."""
        if self.mode is DecodeMode.LOSSY:
            return True
        return self.mode is DecodeMode.VERICACHE and self.wants_draft_step

    @property
    def needs_full_forward(self) -> bool:
        """Full mode decodes every iteration; a vericache round verifies once its drafts are in."""
        if self.is_finished or self.mode is DecodeMode.LOSSY:
            return False
        return self.mode is DecodeMode.FULL or not self.needs_compressed_forward

    def compressed_input(self) -> list[int]:
        if self.draft_ids:
            return self.draft_ids[-1:]
        return self.token_ids[self.compressed_cache.num_tokens :]

    def full_input(self) -> list[int]:
        return self.token_ids[self.full_cache.num_tokens :] + self.draft_ids
