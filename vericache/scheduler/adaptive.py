"""Adaptive draft length: each request's next draft length from its acceptance history and the
measured costs of a round (the paper names a static draft length as a limitation).

Model. Each draft token is accepted with probability alpha given that the ones before it were, so
a round of d draft tokens emits E(d) = 1 + alpha + ... + alpha^d = (1 - alpha^(d+1)) / (1 - alpha)
tokens (accepted + the correction or bonus token). A round costs d draft steps and one
verification of d + 1 tokens, and where a full-KV load precedes the verification, the round lasts
at least as long as that load (it overlaps the drafting). The policy picks the d in [low, high]
with the most tokens per second, E(d) / round_s(d).

alpha per request: a round with d draft tokens and a accepted is a successes plus one rejection if
a < d; the estimate is accepted / (accepted + rejections) over the request's rounds, recent draft
tokens weighing more (a half-life in draft tokens), plus prior pseudo-counts so that a new request
starts at a sensible rate and its own first rounds soon outweigh it.

Costs are measured, never constants: `MeasuredRoundCosts` takes the time of every batched draft
step and full-KV forward (an exponential moving average over them) and splits a verification's
time into a fixed part and a per-token part by least squares over forwards of different sizes.
The schedulers' `AdaptiveDraftLen` uses their `CostModel` (iteration time, link bandwidth,
bytes).

Pure Python: the engine and the schedulers both use it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from vericache.errors import InvalidRequestError
from vericache.scheduler.base import BaseScheduler, RequestState


@dataclass(frozen=True)
class AcceptancePrior:
    # Pseudo-counts that stand for what was seen before the request's first round: a new request
    # starts at alpha = accepted / (accepted + rejected) = 0.95 (acceptance is high on most
    # contexts: the paper reports >= 0.8 of 30 draft tokens accepted), worth a quarter of one
    # rejection, so that its own first round or two outweigh it.
    accepted: float = 4.75
    rejected: float = 0.25
    # Draft tokens after which an observation weighs half: acceptance drifts along an output.
    half_life_tokens: float = 64.0

    def __post_init__(self):
        if self.accepted < 0 or self.rejected <= 0:
            raise InvalidRequestError("prior accepted must be >= 0 and prior rejected > 0")
        if self.half_life_tokens <= 0:
            raise InvalidRequestError(f"half_life_tokens must be > 0, got {self.half_life_tokens}")


def acceptance_rate(
    draft_lens: Sequence[int],
    accepted_per_round: Sequence[int],
    prior: AcceptancePrior = AcceptancePrior(),
) -> float:
    """alpha, the chance a draft token is accepted given that the ones before it were."""
    decay = 0.5 ** (1 / prior.half_life_tokens)
    accepted = rejections = 0.0
    tokens_since = 0  # draft tokens in the rounds newer than the one being counted
    for num_drafted, num_accepted in zip(reversed(draft_lens), reversed(accepted_per_round)):
        weight = decay**tokens_since
        accepted += weight * num_accepted
        rejections += weight * (num_accepted < num_drafted)
        tokens_since += num_drafted
    weight = decay**tokens_since  # the prior counts as evidence older than the first round
    accepted += weight * prior.accepted
    rejections += weight * prior.rejected
    return accepted / (accepted + rejections)


def expected_tokens(alpha: float, draft_len: int) -> float:
    """E(d): tokens a round of d draft tokens emits, accepted ones plus the verifier's own."""
    if alpha >= 1.0:
        return draft_len + 1.0
    return (1.0 - alpha ** (draft_len + 1)) / (1.0 - alpha)


@dataclass(frozen=True)
class RoundCosts:
    """What one round costs, in seconds (or any unit shared by all four fields)."""

    draft_step_s: float  # one draft token
    verify_fixed_s: float  # a verification, whatever its length
    verify_token_s: float  # each token a verification checks (d draft tokens + 1)
    load_s: float = 0.0  # a full-KV load that overlaps the drafting and precedes the verification

    def round_s(self, draft_len: int) -> float:
        drafting = max(draft_len * self.draft_step_s, self.load_s)
        return drafting + self.verify_fixed_s + (draft_len + 1) * self.verify_token_s


def best_draft_len(alpha: float, costs: RoundCosts, low: int, high: int) -> int:
    """The d in [low, high] with the most tokens per second; ties go to the shorter draft."""
    if not 1 <= low <= high:
        raise InvalidRequestError(
            f"draft length bounds must satisfy 1 <= low <= high: {low}, {high}"
        )
    return max(
        range(low, high + 1), key=lambda d: (expected_tokens(alpha, d) / costs.round_s(d), -d)
    )


class MeasuredRoundCosts:
    """Round costs of an engine, from the time of its batched forwards.

    A draft step costs its forward's time over its batch size (every running request drafts in
    every step, so each bears an equal share). A full-KV forward of V verifications holding T tokens
    in all is fitted as time = V * fixed + T * per_token, by least squares over recent forwards
    (each weighing `1 - alpha` of the one after it); a weak pull toward per_token = fixed * ratio
    settles the split while the forwards seen so far cannot (all of one shape).
    """

    def __init__(
        self,
        alpha: float = 0.2,
        prior_verify_fixed_steps: float = 1.0,
        prior_token_over_fixed: float = 0.125,
        prior_pull: float = 0.05,
    ):
        if not 0 < alpha <= 1:
            raise InvalidRequestError(f"alpha must lie in (0, 1], got {alpha}")
        self.alpha = alpha
        # Before any verification is timed, a verification costs this many draft steps...
        self.prior_verify_fixed_steps = prior_verify_fixed_steps
        # ...and each of its tokens this share of its fixed part.
        self.prior_token_over_fixed = prior_token_over_fixed
        self.prior_pull = prior_pull  # the pull's weight, relative to the data's along per_token
        self.draft_step_s: float | None = None
        # Decayed sums over full-KV forwards: V*V, V*T, T*T, V*time, T*time.
        self._sums = [0.0] * 5

    def observe_draft_step(self, seconds: float, num_sequences: int) -> None:
        share = seconds / num_sequences
        if self.draft_step_s is None:
            self.draft_step_s = share
        else:
            self.draft_step_s += self.alpha * (share - self.draft_step_s)

    def observe_verification(self, seconds: float, num_sequences: int, num_tokens: int) -> None:
        """One full-KV forward: num_sequences verifications (or decode steps), num_tokens in all."""
        v, t = float(num_sequences), float(num_tokens)
        terms = (v * v, v * t, t * t, v * seconds, t * seconds)
        self._sums = [(1 - self.alpha) * s + term for s, term in zip(self._sums, terms)]

    def round_costs(self) -> RoundCosts:
        draft_step_s = self.draft_step_s or 1.0  # nothing timed yet: in units of a draft step
        if self._sums[0] == 0.0:
            fixed = self.prior_verify_fixed_steps * draft_step_s
            return RoundCosts(draft_step_s, fixed, fixed * self.prior_token_over_fixed)
        fixed, per_token = self._fit_verification()
        return RoundCosts(draft_step_s, fixed, per_token)

    def _fit_verification(self) -> tuple[float, float]:
        vv, vt, tt, vy, ty = self._sums
        ratio = self.prior_token_over_fixed
        pull = self.prior_pull * tt  # weight of (per_token - ratio * fixed)^2
        a, b, d = vv + pull * ratio * ratio, vt - pull * ratio, tt + pull
        det = a * d - b * b
        fixed = (vy * d - ty * b) / det
        per_token = (ty * a - vy * b) / det
        if per_token < 0:  # neither part can be negative: refit with the other alone
            return vy / vv, 0.0
        if fixed < 0:
            return 0.0, ty / tt
        return fixed, per_token


class AdaptiveDraftLen:
    """A `DraftLenPolicy` for a scheduler: each admission's preferred draft length from the
    request's rounds so far and the scheduler's cost model, which it refines online (ADMIT then
    tries that length first and shifts it where the link or memory do not fit):

        scheduler = StaggeredScheduler(costs)
        scheduler.choose_draft_len = AdaptiveDraftLen(scheduler, max_draft_len=48)

    Costs, per request: a draft step is an iteration; a verification reads the full KV where a
    draft step reads the compressed KV (each with its share of the weights, read once for every
    running request), so it costs an iteration times the ratio of those bytes; the full-KV load
    overlaps the drafting, so a round lasts at least as long as the load.
    """

    def __init__(
        self,
        scheduler: BaseScheduler,
        max_draft_len: int,
        min_draft_len: int = 1,
        prior: AcceptancePrior = AcceptancePrior(),
    ):
        if not 1 <= min_draft_len <= max_draft_len:
            raise InvalidRequestError(
                f"need 1 <= min_draft_len <= max_draft_len, got {min_draft_len}, {max_draft_len}"
            )
        self.scheduler = scheduler
        self.min_draft_len = min_draft_len
        self.max_draft_len = max_draft_len
        self.prior = prior

    def __call__(self, state: RequestState) -> int:
        metrics = state.metrics
        alpha = acceptance_rate(metrics.draft_lens, metrics.accepted_per_round, self.prior)
        return best_draft_len(
            alpha, self.round_costs(state), self.min_draft_len, self.max_draft_len
        )

    def round_costs(self, state: RequestState) -> RoundCosts:
        costs, request = self.scheduler.costs, state.request
        num_sharing = max(1, self.scheduler.num_running + self.scheduler.num_waiting)
        weights_share = costs.weights_bytes / num_sharing
        draft_bytes = weights_share + request.compressed_kv_bytes
        verify_bytes = weights_share + request.full_kv_bytes
        verify_steps = verify_bytes / draft_bytes if draft_bytes else 1.0
        iteration_s = costs.iteration_s
        load_s = costs.load_s(request.full_kv_bytes)
        return RoundCosts(iteration_s, iteration_s * verify_steps, 0.0, load_s)
