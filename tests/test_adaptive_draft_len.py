"""Adaptive draft length: the estimator on hand-built histories and costs, the scheduler policy in
the simulator, and lossless engine output with an adaptive draft length."""

from __future__ import annotations

import json

import pytest

from tests.test_cli import run_cli, tiny_generate_argv
from tests.test_engine_exactness import ScrambledKV, make_prompts
from vericache.compress import StreamingLLM
from vericache.engine.request import DecodeMode, Request, SamplingParams
from vericache.errors import InvalidRequestError
from vericache.scheduler import SchedulerRequest, StaggeredScheduler
from vericache.scheduler.adaptive import (
    AcceptancePrior,
    AdaptiveDraftLen,
    MeasuredRoundCosts,
    RoundCosts,
    acceptance_rate,
    best_draft_len,
    expected_tokens,
)
from vericache.scheduler.simulate import SimHardware, SimRequest, simulate

# A CPU-like round: a verification costs 1.6 draft steps plus 0.2 per token it checks.
CPU_COSTS = RoundCosts(draft_step_s=1.0, verify_fixed_s=1.6, verify_token_s=0.2)


def test_expected_tokens_of_a_round():
    assert expected_tokens(0.0, 30) == 1.0  # only the correction token
    assert expected_tokens(1.0, 30) == 31.0  # every draft token and the bonus token
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)


def test_rate_counts_a_rejection_only_when_a_round_stops_early():
    prior = AcceptancePrior(accepted=0.0, rejected=1e-9, half_life_tokens=1e9)
    # 8 of 8 accepted (no rejection) and 2 of 8 accepted (one rejection): 10 / 11.
    assert acceptance_rate([8, 8], [8, 2], prior) == pytest.approx(10 / 11)


def test_new_request_starts_at_the_prior():
    prior = AcceptancePrior(accepted=9.0, rejected=1.0)
    assert acceptance_rate([], [], prior) == pytest.approx(0.9)
    assert 1 < best_draft_len(0.9, CPU_COSTS, 1, 64) < 64


def test_own_rounds_outweigh_the_prior():
    assert acceptance_rate([30] * 4, [30] * 4) > 0.99
    assert acceptance_rate([4] * 6, [0] * 6) < 0.5


def test_recent_rounds_weigh_more():
    rounds = [16] * 8
    improving = acceptance_rate(rounds, [0] * 4 + [16] * 4)
    worsening = acceptance_rate(rounds, [16] * 4 + [0] * 4)
    assert improving > worsening


def test_high_acceptance_drafts_long_low_acceptance_short():
    high = best_draft_len(acceptance_rate([30] * 4, [30] * 4), CPU_COSTS, 1, 48)
    low = best_draft_len(acceptance_rate([8] * 4, [1] * 4), CPU_COSTS, 1, 48)
    assert high >= 20
    assert low <= 3


def test_costly_verification_lengthens_drafts():
    cheap = RoundCosts(draft_step_s=1.0, verify_fixed_s=0.5, verify_token_s=0.0)
    costly = RoundCosts(draft_step_s=1.0, verify_fixed_s=8.0, verify_token_s=0.0)
    assert best_draft_len(0.9, costly, 1, 64) > best_draft_len(0.9, cheap, 1, 64)


def test_per_token_verification_cost_shortens_drafts():
    per_token = RoundCosts(draft_step_s=1.0, verify_fixed_s=1.6, verify_token_s=1.0)
    assert best_draft_len(0.95, per_token, 1, 64) < best_draft_len(0.95, CPU_COSTS, 1, 64)


def test_a_long_load_lengthens_drafts():
    loaded = RoundCosts(draft_step_s=1.0, verify_fixed_s=1.0, verify_token_s=0.0, load_s=20.0)
    unloaded = RoundCosts(draft_step_s=1.0, verify_fixed_s=1.0, verify_token_s=0.0)
    # Drafting is free while the load runs anyway.
    assert best_draft_len(0.9, loaded, 1, 64) >= 20 > best_draft_len(0.9, unloaded, 1, 64)


@pytest.mark.parametrize("alpha", [0.0, 0.5, 0.99, 1.0])
def test_bounds_respected(alpha):
    assert 5 <= best_draft_len(alpha, CPU_COSTS, 5, 7) <= 7
    assert best_draft_len(alpha, CPU_COSTS, 3, 3) == 3
    with pytest.raises(InvalidRequestError):
        best_draft_len(alpha, CPU_COSTS, 0, 3)


def test_measured_costs_split_a_forward_into_shared_fixed_and_per_token_time():
    costs = MeasuredRoundCosts()
    for num_sequences, num_tokens in [(1, 5), (2, 40), (1, 31), (3, 12), (2, 9)] * 4:
        seconds = 0.03 + 0.01 * num_sequences + 0.003 * num_tokens
        costs.observe_verification(seconds, num_sequences, num_tokens)
        costs.observe_draft_step(0.1, 4)
    measured = costs.round_costs()
    assert measured.draft_step_s == pytest.approx(0.025)
    assert measured.verify_shared_s == pytest.approx(0.03, rel=0.01)
    assert measured.verify_fixed_s == pytest.approx(0.01, rel=0.01)
    assert measured.verify_token_s == pytest.approx(0.003, rel=0.01)


def test_measured_costs_are_never_negative():
    costs = MeasuredRoundCosts()
    # More sequences, less time: the fit may not credit a verification with negative time.
    for num_sequences, seconds in [(1, 0.05), (2, 0.04), (3, 0.03), (4, 0.02)]:
        costs.observe_verification(seconds, num_sequences, 4 * num_sequences)
    measured = costs.round_costs()
    assert min(measured.verify_shared_s, measured.verify_fixed_s, measured.verify_token_s) >= 0


def test_measured_costs_before_any_timing_are_in_draft_steps():
    costs = MeasuredRoundCosts().round_costs()
    assert costs.draft_step_s == 1.0
    assert costs.verify_shared_s > 0 and costs.verify_fixed_s > 0 and costs.verify_token_s > 0


def test_joining_a_planned_verification_pulls_the_draft_length():
    costs = RoundCosts(1.0, verify_fixed_s=0.5, verify_token_s=0.1, verify_shared_s=3.0)
    alone = best_draft_len(0.95, costs, 1, 48)
    assert best_draft_len(0.95, costs, 1, 48, shared_draft_lens={alone + 6}) == alone + 6
    # Joining is not worth any length: far from the best one, verifying alone wins.
    assert best_draft_len(0.95, costs, 1, 48, shared_draft_lens={48}) == alone


def test_scheduler_policy_follows_each_requests_acceptance():
    # A full KV 4x the compressed one, loaded within one iteration.
    hardware = SimHardware(iteration_s=0.04, link_bytes_per_s=1e9, memory_budget_bytes=10**12)
    scheduler = StaggeredScheduler(hardware.costs())
    scheduler.choose_draft_len = AdaptiveDraftLen(scheduler, max_draft_len=48)
    requests = [
        SimRequest(SchedulerRequest("sure", 4 * 10**6, 10**6), 400, acceptance=0.99),
        SimRequest(SchedulerRequest("unsure", 4 * 10**6, 10**6), 400, acceptance=0.4),
    ]
    result = simulate(scheduler, requests, hardware)
    sure, unsure = result.requests["sure"].draft_lens, result.requests["unsure"].draft_lens
    assert sum(sure) / len(sure) > 10 > 3 > sum(unsure) / len(unsure)


def test_adaptive_requires_vericache_mode():
    with pytest.raises(InvalidRequestError):
        Request((1, 2, 3), mode=DecodeMode.FULL, adaptive_draft_len=True)


def test_adaptive_vericache_equals_full(tiny_engine):
    params = SamplingParams(max_new_tokens=40)
    prompts = make_prompts()
    compressors = [StreamingLLM(ratio=2), StreamingLLM(ratio=8, num_sinks=2), ScrambledKV()]
    engine = tiny_engine()
    full = engine.generate(
        [Request(ids, prefix, params, DecodeMode.FULL) for ids, prefix in prompts]
    )
    batch = [
        Request(ids, prefix, params, DecodeMode.VERICACHE, compressor, 24, adaptive_draft_len=True)
        for compressor in compressors
        for ids, prefix in prompts
    ]
    outputs = engine.generate(batch)
    for index, out in enumerate(outputs):
        assert out.token_ids == full[index % len(prompts)].token_ids
        assert all(0 <= d <= 24 for d in out.stats.drafted_per_round)
    scrambled = [d for out in outputs[-len(prompts) :] for d in out.stats.drafted_per_round]
    assert min(scrambled) < 24  # rejected drafts shorten the next ones


@pytest.mark.parametrize("engine_options", [[], ["--long-context"]], ids=["engine", "long"])
def test_generate_draft_len_auto_equals_full(
    capsys, tmp_path, tiny_chat_checkpoint, engine_options
):
    common = [*tiny_generate_argv(tmp_path, tiny_chat_checkpoint), *engine_options]
    results = {}
    for mode, options in [("full", []), ("vericache", ["--draft-len", "auto"])]:
        code, out, _ = run_cli([*common, "--mode", mode, *options], capsys)
        assert code == 0
        results[mode] = json.loads(out)
    assert results["vericache"]["token_ids"] == results["full"]["token_ids"]
    assert results["vericache"]["draft_len"] == "auto"


def test_generate_draft_len_auto_is_refused_with_a_server(capsys):
    argv = ["generate", "--prompt", "hi", "--draft-len", "auto", "--server", "127.0.0.1:1"]
    code, _, err = run_cli(argv, capsys)
    assert code != 0 and "--draft-len auto runs in this process" in err
