"""Adaptive draft length: each request's next draft length from its acceptance history and the
measured costs of a round (the paper names a static draft length as a limitation).

Model. Each draft token is accepted with probability alpha given that the ones before it were, so
a round of d draft tokens emits E(d) = 1 + alpha + ... + alpha^d = (1 - alpha^(d+1)) / (1 - alpha)
tokens (accepted + the correction or bonus token). A round costs d draft steps and one
verification of d + 1 tokens: a fixed part, a part per token, and the full-KV forward it runs in,
which it shares with whatever other verifications run in the same step (so joining a verification
planned anyway saves that part; batched verification is cheaper per request). Where a full-KV
load precedes the verification, the round lasts at least as long as that load (it overlaps the
drafting). The policy picks the d in [low, high] with the most tokens per second, E(d) / cost(d).

alpha per request: a round with d draft tokens and a accepted is a successes plus one rejection if
a < d; the estimate is accepted / (accepted + rejections) over the request's rounds, recent draft
tokens weighing more (a half-life in draft tokens), plus prior pseudo-counts so that a new request
starts at a sensible rate and its own first rounds soon outweigh it.

Costs are measured, never constants: `MeasuredRoundCosts` takes the time of every batched draft
step (a moving average) and full-KV forward, and splits the latter into the forward's shared part,
a part per verification and a part per token by least squares over forwards of different sizes.
The schedulers' `AdaptiveDraftLen` uses their `CostModel` (iteration time, link bandwidth,
bytes).

Pure Python: the engine and the schedulers both use it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Container, Sequence
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
    """What one round costs, in seconds (or any unit shared by every field)."""

    draft_step_s: float  # one draft token
    verify_fixed_s: float  # a verification, whatever its length
    verify_token_s: float  # each token a verification checks (d draft tokens + 1)
    # The full-KV forward a verification runs in (reading the weights, ...): paid once for all the
    # verifications that share it, so a verification that joins one planned anyway saves it.
    verify_shared_s: float = 0.0
    load_s: float = 0.0  # a full-KV load that overlaps the drafting and precedes the verification

    def round_s(self, draft_len: int, shares_forward: bool = False) -> float:
        drafting = max(draft_len * self.draft_step_s, self.load_s)
        verify = self.verify_fixed_s + (draft_len + 1) * self.verify_token_s
        return drafting + verify + (0.0 if shares_forward else self.verify_shared_s)


def best_draft_len(
    alpha: float,
    costs: RoundCosts,
    low: int,
    high: int,
    shared_draft_lens: Container[int] = (),
) -> int:
    """The d in [low, high] with the most tokens per second; ties go to the shorter draft.

    shared_draft_lens: the draft lengths whose verification would run in a full-KV forward that
    other requests' verifications already hold (so it costs no verify_shared_s)."""
    if not 1 <= low <= high:
        raise InvalidRequestError(
            f"draft length bounds must satisfy 1 <= low <= high: {low}, {high}"
        )

    def tokens_per_s(d: int) -> float:
        return expected_tokens(alpha, d) / costs.round_s(d, d in shared_draft_lens)

    return max(range(low, high + 1), key=lambda d: (tokens_per_s(d), -d))


class MeasuredRoundCosts:
    """Round costs of an engine, from the time of its batched forwards.

    A draft step costs its forward's time over its batch size (every running request drafts in
    every step, so each bears an equal share). A full-KV forward of V verifications holding T tokens
    in all is fitted as time = shared + V * fixed + T * per_token, by least squares with every part
    >= 0, over recent forwards (each weighing `forward_decay` of the one after it). Until the first
    full-KV forward is timed, the parts are a prior in draft steps (replaced by the first data).
    """

    def __init__(
        self,
        draft_alpha: float = 0.2,
        forward_decay: float = 0.95,
        prior_steps: tuple[float, float, float] = (1.0, 0.5, 0.125),
    ):
        if not 0 < draft_alpha <= 1 or not 0 < forward_decay < 1:
            raise InvalidRequestError("draft_alpha must lie in (0, 1] and forward_decay in (0, 1)")
        self.draft_alpha = draft_alpha  # weight of each draft step in the moving average
        self.forward_decay = forward_decay
        # (shared, fixed, per_token) of a verification in draft steps, before any is timed: a
        # full-KV forward costs about two draft steps at 4x on CPU (the decode-speed benchmark).
        self.prior_steps = prior_steps
        self.draft_step_s: float | None = None
        # Decayed normal equations of time ~ [1, V, T]: X^T X, X^T y and y^T y.
        self._xtx = [[0.0] * 3 for _ in range(3)]
        self._xty = [0.0] * 3
        self._yty = 0.0

    def observe_draft_step(self, seconds: float, num_sequences: int) -> None:
        share = seconds / num_sequences
        if self.draft_step_s is None:
            self.draft_step_s = share
        else:
            self.draft_step_s += self.draft_alpha * (share - self.draft_step_s)

    def observe_verification(self, seconds: float, num_sequences: int, num_tokens: int) -> None:
        """One full-KV forward: num_sequences verifications (or decode steps), num_tokens in all."""
        x, keep = (1.0, float(num_sequences), float(num_tokens)), self.forward_decay
        for i in range(3):
            for j in range(3):
                self._xtx[i][j] = keep * self._xtx[i][j] + x[i] * x[j]
            self._xty[i] = keep * self._xty[i] + x[i] * seconds
        self._yty = keep * self._yty + seconds * seconds

    def round_costs(self) -> RoundCosts:
        draft_step_s = self.draft_step_s or 1.0  # nothing timed yet: in units of a draft step
        if self._xtx[0][0] == 0.0:
            shared, fixed, per_token = (draft_step_s * steps for steps in self.prior_steps)
        else:
            shared, fixed, per_token = _nonnegative_least_squares(self._xtx, self._xty, self._yty)
        return RoundCosts(draft_step_s, fixed, per_token, verify_shared_s=shared)


def _nonnegative_least_squares(xtx: list[list[float]], xty: list[float], yty: float) -> list[float]:
    """argmin |y - X b|^2 over b >= 0, from the normal equations: the best of the unconstrained
    fits over each subset of the columns that comes out >= 0 (few columns: try them all)."""
    num_columns = len(xty)
    ridge = 1e-9 * sum(xtx[i][i] for i in range(num_columns))  # collinear columns stay solvable
    best, best_residual = [0.0] * num_columns, yty
    for size in range(num_columns, 0, -1):
        for subset in itertools.combinations(range(num_columns), size):
            matrix = [[xtx[i][j] + (ridge if i == j else 0.0) for j in subset] for i in subset]
            solved = _solve(matrix, [xty[i] for i in subset])
            if solved is None or min(solved) < 0:
                continue
            coefficients = [0.0] * num_columns
            for index, value in zip(subset, solved):
                coefficients[index] = value
            residual = (
                yty - 2 * _dot(coefficients, xty) + _dot(coefficients, _mat_vec(xtx, coefficients))
            )
            if residual < best_residual - 1e-12 * max(yty, 1e-300):
                best, best_residual = coefficients, residual
    return best


def _solve(matrix: list[list[float]], vector: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None if the matrix is singular."""
    size = len(vector)
    rows = [row[:] + [value] for row, value in zip(matrix, vector)]
    for col in range(size):
        pivot = max(range(col, size), key=lambda r: abs(rows[r][col]))
        if rows[pivot][col] == 0.0:
            return None
        rows[col], rows[pivot] = rows[pivot], rows[col]
        for r in range(col + 1, size):
            factor = rows[r][col] / rows[col][col]
            rows[r] = [a - factor * b for a, b in zip(rows[r], rows[col])]
    solution = [0.0] * size
    for r in range(size - 1, -1, -1):
        known = sum(rows[r][c] * solution[c] for c in range(r + 1, size))
        solution[r] = (rows[r][size] - known) / rows[r][r]
    return solution


def _dot(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b))


def _mat_vec(matrix: list[list[float]], vector: list[float]) -> list[float]:
    return [_dot(row, vector) for row in matrix]


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
        return RoundCosts(iteration_s, iteration_s * verify_steps, 0.0, load_s=load_s)


def bounded_adaptive_draft_len(scheduler: BaseScheduler) -> Callable[[RequestState], int]:
    """A scheduler's draft-length policy for adaptive requests: the length their acceptance and
    the scheduler's costs favour, at most the request's preferred one (its upper bound). Tokens
    per second of a round is unimodal in its length, so the best within the bound is the bound
    or the unbounded best, whichever is shorter. ADMIT places a round within the window: no draft
    is longer than it allows."""
    adaptive = AdaptiveDraftLen(scheduler, scheduler.config.window - 1)

    def choose(state: RequestState) -> int:
        return min(adaptive(state), state.draft_len)

    return choose
