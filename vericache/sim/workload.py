"""What the simulator serves: when requests arrive, how long they are, and how many drafts each
round accepts.

Acceptance replays recorded rounds. A round is recorded at the longest draft, MAX_DRAFT_LEN, as
the position of its first draft that the full KV rejects (MAX_DRAFT_LEN when none is): the drafts
before the first mismatch do not depend on how many follow them. Rounds at another x start at
other positions, so they are replayed in order, position by position (`replayed_rounds`): the
recorded rounds mark, along the output, where a draft would match and where it breaks, and a
round at x starting at any position accepts the matches up to the next break or x, whichever
comes first. Drawing each recorded round as one round at x (min(first mismatch, x)) reads long
runs of matches as one round where they are several, and read a SnapKV 8x drafter's 22.8 accepted
drafts per round at x=30 (measured whole) as 21.0; replayed in order, 22.3. Traces come from
`bench acceptance` (measured) or from a published acceptance rate (labelled so); every result
says which.
"""

from __future__ import annotations

import bisect
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
    first_mismatch: tuple[int, ...]  # per round, in [0, MAX_DRAFT_LEN], in decoding order
    # Rounds served at their own x that kept every draft they made, fewer than the longest (a
    # token budget cut them short): the drafts each kept, a lower bound on where its first
    # mismatch would have been. Such a trace's rounds are out of order and drawn one by one.
    kept_all: tuple[int, ...] = ()

    def __post_init__(self):
        if not self.first_mismatch and not self.kept_all:
            raise InvalidRequestError("an acceptance trace needs at least one round")
        if not all(0 <= p <= MAX_DRAFT_LEN for p in self.first_mismatch + self.kept_all):
            raise InvalidRequestError(f"first mismatches lie in [0, {MAX_DRAFT_LEN}]")

    def accepted(self, draft_len: int, rng: random.Random) -> int:
        """The drafts one round of `draft_len` accepts: one of the rounds the recorded ones replay
        at that length, drawn at random (a staggered scheduler drafts on while a load is under
        way, and can exceed MAX_DRAFT_LEN: runs of matches go on across recorded rounds). With
        lower bounds, a recorded round drawn at random; past MAX_DRAFT_LEN a round that keeps its
        first MAX_DRAFT_LEN drafts goes on as a fresh round."""
        if draft_len < 0:
            raise InvalidRequestError(f"a draft length is >= 0, got {draft_len}")
        if not self.kept_all:
            return rng.choice(self._replayed(draft_len))
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

    def _replayed(self, draft_len: int) -> list[int]:
        """The rounds at `draft_len` the recorded ones replay in order, worked out once a length."""
        replays = self._replays
        if draft_len not in replays:
            replays[draft_len] = replayed_rounds(self.first_mismatch, draft_len)
        return replays[draft_len]

    @cached_property
    def _replays(self) -> dict[int, list[int]]:
        return {}

    def mean_accepted(self, draft_len: int) -> float:
        """Per round at `draft_len`, replayed in order; with lower bounds, per recorded round,
        rounds that kept all their drafts counted at those."""
        if not self.kept_all:
            replayed = self._replayed(draft_len)
            return sum(replayed) / len(replayed)
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


def replayed_rounds(first_mismatch: Sequence[int], draft_len: int) -> list[int]:
    """The drafts each round at `draft_len` accepts, replayed in order over consecutive rounds
    recorded at MAX_DRAFT_LEN (their first mismatches).

    The recorded rounds lay out the output's positions: a round's drafts before its first mismatch
    match, and its mismatch breaks the run; a round that kept all MAX_DRAFT_LEN drafts has its
    verifier's token match too (the drafter, fed the same tokens, would most likely have drafted
    it), so its run goes on into the next round. A round at x starting at position q accepts the
    matches from q up to the next break, at most x; the verifier's token then takes the next
    position, where the next round starts. The last round, cut by the record's end before a break
    or x, tells nothing and is left out; a record that never breaks replays every round whole."""
    if draft_len < 0:
        raise InvalidRequestError(f"a draft length is >= 0, got {draft_len}")
    breaks, end = [], 0  # breaks: positions of mismatches, in order; end: positions known
    for matched in first_mismatch:
        end += matched
        if matched < MAX_DRAFT_LEN:
            breaks.append(end)
        end += 1
    rounds, start = [], 0
    while start < end:
        next_break = bisect.bisect_left(breaks, start)
        run = (breaks[next_break] if next_break < len(breaks) else end) - start
        if run >= draft_len:
            rounds.append(draft_len)
            start += draft_len + 1
        elif next_break < len(breaks):
            rounds.append(run)
            start += run + 1
        else:
            break
    if first_mismatch and not rounds:
        return [draft_len]
    return rounds


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
