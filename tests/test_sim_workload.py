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
    replayed_rounds,
    trace_arrivals,
)


def test_recorded_rounds_replay_in_order_at_any_draft_length():
    # Positions: a break at 0; 3 matches and a break; 10 matches and a break; 64 matches and the
    # verifier's token (a match: the run goes on). At x=5 the run of 10 gives a round of 5, the
    # verifier's token, then the 4 left; the run of 65 gives thirteen rounds of 5.
    trace = AcceptanceTrace("measured: test", (0, 3, 10, MAX_DRAFT_LEN))
    assert replayed_rounds(trace.first_mismatch, 5) == [0, 3, 5, 4] + [5] * 11
    assert replayed_rounds(trace.first_mismatch, MAX_DRAFT_LEN) == [0, 3, 10, 64]
    assert trace.mean_accepted(5) == pytest.approx(67 / 15)
    assert trace.mean_accepted(64) == (0 + 3 + 10 + 64) / 4
    rng = random.Random(1)
    drawn = {trace.accepted(5, rng) for _ in range(200)}
    assert drawn == {0, 3, 4, 5}
    with pytest.raises(InvalidRequestError):
        trace.accepted(-1, rng)


def test_a_long_run_is_several_rounds_at_a_shorter_draft_length_not_one():
    """A run of 75 matches (64 kept, then 10) is two rounds of 30 and one of 13 at x=30; drawn
    one recorded round at a time it read as 30 and 10."""
    assert replayed_rounds([MAX_DRAFT_LEN, 10], 30) == [30, 30, 13]
    # The last round, cut by the record's end before a break or x, tells nothing.
    assert replayed_rounds([MAX_DRAFT_LEN], 30) == [30, 30]


def test_a_round_past_the_recorded_length_goes_on_along_the_run():
    """A staggered scheduler may draft past MAX_DRAFT_LEN: a run goes on across recorded rounds
    that kept all their drafts, to its break or x."""
    trace = AcceptanceTrace("measured: test", (MAX_DRAFT_LEN, 5))
    rng = random.Random(2)
    assert {trace.accepted(100, rng) for _ in range(50)} == {MAX_DRAFT_LEN + 1 + 5}
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
