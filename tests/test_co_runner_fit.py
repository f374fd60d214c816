"""The co-runner slowdown `auto` fits to its measured requests (serve/backends/co_runner_fit.py):
told apart from each path's own correction where a path's requests ran beside different numbers
of co-runners, the profile's where none did, and priced in every later choice."""

from __future__ import annotations

import dataclasses
import math

import pytest

from tests.test_auto_path import KV_BYTES_PER_TOKEN, LINK, MODEL, SHAPE, summary
from vericache.scheduler.path_choice import ServingPath
from vericache.serve.backends.auto_path import AutoPaths
from vericache.serve.backends.co_runner_fit import MAX_SLOWDOWN, CoRunnerFit
from vericache.serve.backends.co_runners import StartedBeside
from vericache.serve.backends.path_costs import PathCosts, PathOption, default_device_profile

LOCAL, REMOTE, WARM = ServingPath.FULL_LOCAL, ServingPath.FULL_REMOTE, ServingPath.FULL_WARM


def _log_ratio(correction: float, slowdown: float, co_runners: float) -> float:
    return math.log(correction * (1 + (slowdown - 1) * co_runners))


def test_requests_beside_different_co_runners_tell_the_slowdown_from_the_path():
    fit = CoRunnerFit(prior_slowdown=1.2)
    for co_runners in (0.0, 0.25, 0.5, 0.75, 1.0) * 3:
        fit.observe(LOCAL, co_runners, _log_ratio(2.5, 1.6, co_runners))
    for _ in range(4):  # always beside the verifier: its correction alone, given the slowdown
        fit.observe(REMOTE, 1.0, _log_ratio(3.0, 1.6, 1.0))
    assert fit.slowdown == pytest.approx(1.6, rel=0.05)  # the prior's pull: a little lower
    assert math.exp(fit.log_correction(LOCAL)) == pytest.approx(2.5, rel=0.05)
    assert math.exp(fit.log_correction(REMOTE)) == pytest.approx(3.0, rel=0.05)
    assert fit.log_correction(WARM) is None


def test_without_a_spread_of_co_runners_the_profile_s_slowdown_stays():
    fit = CoRunnerFit(prior_slowdown=1.2)
    for _ in range(8):
        fit.observe(REMOTE, 1.0, math.log(5.0))
    assert fit.slowdown == pytest.approx(1.2, rel=1e-3)
    assert math.exp(fit.log_correction(REMOTE)) == pytest.approx(5.0 / 1.2, rel=1e-3)


def test_a_few_noisy_requests_move_it_little_and_it_stays_bounded():
    fit = CoRunnerFit(prior_slowdown=1.2)
    fit.observe(LOCAL, 0.0, 0.0)
    fit.observe(LOCAL, 0.1, math.log(3.0))  # a stall beside a tenth of a co-runner
    assert 1.2 < fit.slowdown < 2.0
    for co_runners in (0.0, 1.0) * 8:
        fit.observe(LOCAL, co_runners, _log_ratio(1.0, 50.0, co_runners))
    assert fit.slowdown == pytest.approx(MAX_SLOWDOWN, rel=1e-3)


def test_auto_stops_starting_a_second_worker_once_its_requests_show_the_cost():
    profile = dataclasses.replace(
        default_device_profile("cpu:avx512:float32"), co_runner_slowdown=1.05
    )
    auto = AutoPaths(PathCosts(MODEL, profile, KV_BYTES_PER_TOKEN, 4))
    verifier = PathOption(LOCAL, "verifier-0", 2)
    beside = (StartedBeside(2, 1, 1),)
    drafter = PathOption(WARM, "drafter-0", 0, link=LINK, co_runners=1, started_beside=beside)
    assert auto.choose([verifier, drafter], SHAPE).path is WARM
    # The verifier's requests: at the prior's speed alone, 1.8 times slower beside the drafter.
    prior = auto.estimate(dataclasses.replace(verifier, load=0), SHAPE).seconds_per_token
    for co_runners in (0.0, 1.0, 0.5) * 3:
        choice = auto.choose([dataclasses.replace(verifier, load=0)], SHAPE)
        per_token = prior * (1 + 0.8 * co_runners)
        auto.observe(choice, summary(0.1, 1 / per_token), load=1, co_runners=co_runners)
        auto.finished(choice)
    assert auto.co_runner_slowdown == pytest.approx(1.8, rel=0.1)
    assert auto.choose([verifier, drafter], SHAPE).path is LOCAL
