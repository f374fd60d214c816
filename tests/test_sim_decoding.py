"""Simulated requests decode through the engine's own round (engine/sequence.py): the budget and
the context cut drafts and commits as in every driver, and both pipelines' rounds go through it."""

from __future__ import annotations

import pytest

from tests.sim_scenarios import remote_prefix_scenario
from vericache.engine.sequence import Sequence
from vericache.errors import InvalidRequestError
from vericache.scheduler import StaggeredScheduler
from vericache.sim import long_context, remote_prefix
from vericache.sim.decoding import SimSequence
from vericache.sim.profiles import device_profile, model_profile
from vericache.sim.remote_prefix_scenario import RemotePrefixScenario
from vericache.sim.workload import AcceptanceTrace, OutputLengths, rate_for_mean_accepted

TRACE = AcceptanceTrace.from_rate(rate_for_mean_accepted(12.0, 16), "test: 12 of 16", seed=5)


def test_a_round_is_cut_by_the_budget_and_commits_the_accepted_drafts_and_one_more():
    seq = SimSequence(prompt_tokens=100, max_new_tokens=10, max_positions=1000)
    assert seq.first_token() == 1
    assert seq.begin_round(16) == 8  # 9 tokens left: 8 drafts and the verifier's own
    while seq.wants_draft_step:
        seq.draft_step()
    outcome = seq.verify(accepted=3)
    assert len(outcome.committed) == 4 and seq.num_output_tokens == 5 and not seq.is_finished
    assert seq.begin_round(16) == 4
    for _ in range(4):
        seq.draft_step()
    seq.verify(accepted=4)  # all accepted, and the bonus token
    assert seq.num_output_tokens == 10 and seq.is_finished
    with pytest.raises(InvalidRequestError):
        SimSequence(100, 10, 1000).verify(accepted=1)  # no drafts to accept


def test_the_context_ends_a_request_where_the_engine_would():
    seq = SimSequence(prompt_tokens=990, max_new_tokens=100, max_positions=1000)
    seq.first_token()
    assert seq.begin_round(30) == 9  # 9 positions left: drafts fill them, the last token lands
    decoded = SimSequence(prompt_tokens=990, max_new_tokens=100, max_positions=1000)
    assert decoded.decode_target(100) == 10
    assert sum(decoded.decode_step() for _ in range(12)) == 10 and decoded.is_finished
    with pytest.raises(InvalidRequestError, match="no room"):
        SimSequence(prompt_tokens=1000, max_new_tokens=1, max_positions=1000)


def _count_rounds(monkeypatch) -> list[int]:
    calls = []
    real = Sequence.finish_round

    def counted(self, verified):
        calls.append(len(verified))
        return real(self, verified)

    monkeypatch.setattr(Sequence, "finish_round", counted)
    return calls


def test_both_pipelines_round_through_the_engines_sequence(monkeypatch):
    calls = _count_rounds(monkeypatch)
    scenario = long_context.LongContextScenario(
        model=model_profile("mistral-small-24b"), device=device_profile("h200"),
        prompt_tokens=8192, kv_budget=0.25, draft_len=16, arrivals=(0.0,) * 4,
        output_lengths=OutputLengths((40,)), acceptance=TRACE,
    )  # fmt: skip
    report = long_context.simulate_vericache(scenario, StaggeredScheduler)
    assert len(calls) == len(report.accepted_per_round) > 0
    assert calls == [drafts + 1 for drafts in report.draft_lens]
    calls.clear()
    p2 = _remote_prefix_scenario()
    report = remote_prefix.simulate_vericache(p2)
    assert len(calls) == len(report.accepted_per_round) > 0


def _remote_prefix_scenario(**changes) -> RemotePrefixScenario:
    small = dict(num_drafters=2, prefix_tokens=8192, num_prefixes=2, arrivals=(0.0,) * 6)
    return remote_prefix_scenario(**(small | {"output_lengths": OutputLengths((64,))} | changes))


def test_remote_prefix_requests_stop_at_the_models_context_in_every_configuration():
    # Qwen2.5-32B holds 32768 positions: a prompt of 32668 leaves 100 output tokens.
    scenario = _remote_prefix_scenario(
        prefix_tokens=32768 - 164, output_lengths=OutputLengths((256,))
    )
    result = remote_prefix.compare(scenario)
    for name in ("vericache", "full_local", "full_remote", "full_both"):
        assert result[name].num_output_tokens == 6 * 100, name
    with pytest.raises(InvalidRequestError, match="context of 32768"):
        _remote_prefix_scenario(prefix_tokens=32768)
