"""The simulator's workloads: replayed acceptance, arrivals and output lengths."""

from __future__ import annotations

import random
import statistics

import pytest

from vericache.errors import InvalidRequestError
from vericache.sim.workload import (
    MAX_DRAFT_LEN,
    AcceptanceTrace,
    OutputLengths,
    poisson_arrivals,
    rate_for_mean_accepted,
    trace_arrivals,
)


def test_a_recorded_round_replays_at_any_shorter_draft_length():
    trace = AcceptanceTrace("measured: test", (0, 3, 10, MAX_DRAFT_LEN))
    assert [trace.mean_accepted(x) for x in (1, 5, 64)] == [0.75, 3.25, (0 + 3 + 10 + 64) / 4]
    rng = random.Random(1)
    drawn = {trace.accepted(5, rng) for _ in range(200)}
    assert drawn == {0, 3, 5}  # a round that matched 10 or 64 accepts all 5 at x=5
    with pytest.raises(InvalidRequestError):
        trace.accepted(-1, rng)


def test_a_round_past_the_recorded_length_goes_on_as_a_fresh_round():
    """A round that kept all MAX_DRAFT_LEN recorded drafts tells nothing of the next: a longer
    round draws again for the rest."""
    trace = AcceptanceTrace("measured: test", (MAX_DRAFT_LEN, 5))
    rng = random.Random(2)
    drawn = {trace.accepted(100, rng) for _ in range(300)}
    assert drawn == {5, MAX_DRAFT_LEN + 5, 100}
    always = AcceptanceTrace("measured: test", (MAX_DRAFT_LEN,))
    assert always.accepted(3 * MAX_DRAFT_LEN + 1, rng) == 3 * MAX_DRAFT_LEN + 1
    for bad in ((), (-1,), (MAX_DRAFT_LEN + 1,)):
        with pytest.raises(InvalidRequestError):
            AcceptanceTrace("measured: bad", bad)


def test_a_published_rate_becomes_rounds_with_that_mean():
    rate = rate_for_mean_accepted(23.0, 30)  # the paper's Llama-70B at x=30, 4x
    assert 0.9 < rate < 1
    trace = AcceptanceTrace.from_rate(rate, "paper, Llama-70B, x=30", num_rounds=20000)
    assert trace.source.startswith("published:")
    assert trace.mean_accepted(30) == pytest.approx(23.0, rel=0.02)
    assert AcceptanceTrace.from_rate(0.0, "never").mean_accepted(30) == 0
    with pytest.raises(InvalidRequestError):
        rate_for_mean_accepted(30, 30)


def test_poisson_arrivals_have_their_rate_and_repeat_with_their_seed():
    times = poisson_arrivals(4.0, 20000, seed=3)
    gaps = [b - a for a, b in zip([0.0, *times], times)]
    assert statistics.mean(gaps) == pytest.approx(0.25, rel=0.03)
    assert times == sorted(times) and times == poisson_arrivals(4.0, 20000, seed=3)
    assert times[:10] != poisson_arrivals(4.0, 10, seed=4)
    with pytest.raises(InvalidRequestError):
        poisson_arrivals(0.0, 3)


def test_trace_arrivals_and_output_lengths_are_checked():
    assert trace_arrivals([0, 0.5, 0.5, 2]) == [0.0, 0.5, 0.5, 2.0]
    for bad in ([1.0, 0.5], [-1.0], [float("nan")]):
        with pytest.raises(InvalidRequestError):
            trace_arrivals(bad)
    lengths = OutputLengths((64, 256))
    assert {lengths.draw(random.Random(seed)) for seed in range(20)} == {64, 256}
    with pytest.raises(InvalidRequestError):
        OutputLengths((0,))
