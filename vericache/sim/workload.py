"""What the simulator serves: when requests arrive, how long they are, and how many drafts each
round accepts.

Acceptance replays recorded rounds. A round is recorded at the longest draft, MAX_DRAFT_LEN, as
the position of its first draft that the full KV rejects (MAX_DRAFT_LEN when none is), so that a
round at any x <= MAX_DRAFT_LEN accepts min(first mismatch, x): the drafts before the first
mismatch do not depend on how many follow them. Rounds are drawn independently: a request's
rounds at another x would start at other positions, which the replay treats as a fresh draw from
the same kind of request. Traces come from `bench acceptance` (measured) or from a published
acceptance rate (labelled so); every result says which.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

from vericache.errors import InvalidRequestError

MAX_DRAFT_LEN = 64


@dataclass(frozen=True)
class AcceptanceTrace:
    """Recorded rounds of one kind of request (prompt kind, compressor, context length)."""

    source: str  # "measured: ..." or "published: ..."
    first_mismatch: tuple[int, ...]  # per round, in [0, MAX_DRAFT_LEN]
    # Rounds that kept every draft they made, fewer than the longest (a token budget cut them
    # short): the drafts each kept, a lower bound on where its first mismatch would have been.
    kept_all: tuple[int, ...] = ()

    def __post_init__(self):
        if not self.first_mismatch and not self.kept_all:
            raise InvalidRequestError("an acceptance trace needs at least one round")
        if not all(0 <= p <= MAX_DRAFT_LEN for p in self.first_mismatch + self.kept_all):
            raise InvalidRequestError(f"first mismatches lie in [0, {MAX_DRAFT_LEN}]")

    def accepted(self, draft_len: int, rng: random.Random) -> int:
        """The drafts one round of `draft_len` accepts, a recorded round drawn at random. Past
        MAX_DRAFT_LEN no round tells anything: a round that keeps its first MAX_DRAFT_LEN drafts
        goes on as a fresh round (a staggered scheduler drafts on while a load is under way, and
        can exceed it)."""
        if draft_len < 0:
            raise InvalidRequestError(f"a draft length is >= 0, got {draft_len}")
        kept = 0
        while True:
            wanted = min(draft_len - kept, MAX_DRAFT_LEN)
            drawn = min(self._drawn(wanted, rng), wanted)
            kept += drawn
            if drawn < MAX_DRAFT_LEN or kept == draft_len:
                return kept

    def _drawn(self, draft_len: int, rng: random.Random) -> int:
        """A round drawn at random (without lower bounds, simply one of the first mismatches, the
        same draw as from them alone); one that kept all its c < draft_len drafts goes on as a round
        drawn from those that got past c (its chance passed to the right, as in the Kaplan-Meier
        estimator), until one tells its mismatch or none got further. Leaving such rounds out
        instead keeps only those that rejected a draft: under a small budget, most of them."""
        rounds = self._rounds
        position, is_lower_bound = rng.choice(rounds)
        while is_lower_bound and position < draft_len:
            further = [(p, b) for p, b in rounds if p > position or (p == position and not b)]
            if not further:
                return position
            position, is_lower_bound = rng.choice(further)
        return position

    @cached_property
    def _rounds(self) -> list[tuple[int, bool]]:
        """(position, whether a lower bound) of every round, built once: drawn from per round."""
        return [(p, False) for p in self.first_mismatch] + [(c, True) for c in self.kept_all]

    def mean_accepted(self, draft_len: int) -> float:
        """Per round at `draft_len`, rounds that kept all their drafts counted at those (a lower
        bound)."""
        rounds = self.first_mismatch + self.kept_all
        return sum(min(p, draft_len) for p in rounds) / len(rounds)

    @classmethod
    def from_rate(cls, rate: float, source: str, num_rounds: int = 4096, seed: int = 0):
        """Rounds where each draft is accepted with probability `rate` given the ones before it
        were (a published per-token acceptance rate), drawn with a fixed seed."""
        if not 0 <= rate < 1:
            raise InvalidRequestError(f"an acceptance rate lies in [0, 1), got {rate}")
        rng = random.Random(seed)
        rounds = []
        for _ in range(num_rounds):
            position = 0
            while position < MAX_DRAFT_LEN and rng.random() < rate:
                position += 1
            rounds.append(position)
        return cls(f"published: {source}", tuple(rounds))


def first_mismatches(drafted: list[int], accepted: list[int], draft_len: int) -> list[int]:
    """Each round's first rejected draft (draft_len: none was), where the round tells it: it
    rejected a draft, or drafted all draft_len and kept them."""
    return [a for d, a in zip(drafted, accepted) if a < d or d == draft_len]


def trace_from_rounds(source: str, drafted: list[int], accepted: list[int]) -> AcceptanceTrace:
    """Rounds as a run made them (drafts made, drafts kept; rounds that drafted nothing tell
    nothing): those that rejected a draft tell their first mismatch, those that kept all a lower
    bound."""
    rounds = [(d, a) for d, a in zip(drafted, accepted) if d > 0]
    rejected = tuple(a for d, a in rounds if a < d)
    return AcceptanceTrace(source, rejected, tuple(a for d, a in rounds if a >= d))


def trace_from_bench(result: dict, kind: str, compressor: str, draft_kv: str = "verifier"):
    """The rounds `bench acceptance` recorded for one prompt kind and compressor (its JSON
    result, parsed), as a trace labelled with where it was measured."""
    records = [
        r
        for r in result.get("records", ())
        if (r.get("kind"), r.get("compressor"), r.get("draft_kv")) == (kind, compressor, draft_kv)
        and "first_mismatch" in r
        and not r.get("whole_rounds")  # rounds of their own length, not first mismatches at 64
    ]
    rounds = tuple(p for r in records for p in r["first_mismatch"])
    if not rounds:
        raise InvalidRequestError(
            f"the acceptance result has no first-mismatch rounds of {kind} with {compressor}"
        )
    model = result.get("config", {}).get("model", "?")
    source = (
        f"measured: bench acceptance, {kind} prompts, {compressor}, {model}, "
        f"{len(rounds)} rounds over {len(records)} prompts"
    )
    return AcceptanceTrace(source, rounds)


def rate_for_mean_accepted(mean: float, draft_len: int) -> float:
    """The per-token rate r whose rounds of `draft_len` accept `mean` drafts on average:
    r (1 - r^x) / (1 - r) = mean (solved by bisection)."""
    if not 0 <= mean < draft_len:
        raise InvalidRequestError(f"a mean of {mean} accepted is not below x={draft_len}")

    def expected(rate: float) -> float:
        return sum(rate**k for k in range(1, draft_len + 1))

    low, high = 0.0, 1.0
    for _ in range(100):
        middle = (low + high) / 2
        low, high = (middle, high) if expected(middle) < mean else (low, middle)
    return (low + high) / 2


def poisson_arrivals(rate_per_s: float, num_requests: int, seed: int = 0) -> list[float]:
    """Arrival times of `num_requests` requests at `rate_per_s` on average, from t=0."""
    if not rate_per_s > 0 or num_requests < 0:
        raise InvalidRequestError("arrivals need a rate > 0 and a count >= 0")
    rng, now, times = random.Random(seed), 0.0, []
    for _ in range(num_requests):
        now += -math.log(1.0 - rng.random()) / rate_per_s
        times.append(now)
    return times


def trace_arrivals(times: Sequence[float]) -> list[float]:
    """Arrival times read from a trace, checked to be finite, >= 0 and in order."""
    checked = [float(t) for t in times]
    if any(not math.isfinite(t) or t < 0 for t in checked) or checked != sorted(checked):
        raise InvalidRequestError("trace arrival times must be finite, >= 0 and in order")
    return checked


@dataclass(frozen=True)
class OutputLengths:
    """Output tokens per request: drawn from `lengths` (one value: every request alike)."""

    lengths: tuple[int, ...]

    def __post_init__(self):
        if not self.lengths or min(self.lengths) < 1:
            raise InvalidRequestError("output lengths must be >= 1")

    def draw(self, rng: random.Random) -> int:
        return rng.choice(self.lengths)
