"""`mode: auto` held to a full-KV deployment routed as well as itself (FULL_ROUTED: auto's choice
among the full-KV paths alone) and to the arrivals' bound; auto's estimate of a round verified
centrally: the drafter's link moves one transfer at a time, and the drafter fetches once the
verifier's full KV is in."""

from __future__ import annotations

import dataclasses

import pytest

from tests.sim_scenarios import remote_prefix_scenario
from vericache.scheduler.path_choice import ServingPath
from vericache.sim.remote_prefix_auto import path_estimates, simulate_auto
from vericache.sim.remote_prefix_compare import (
    FULL_ROUTED,
    arrival_bound_tokens_per_s,
    compare_deployments,
)
from vericache.sim.remote_prefix_workers import PrefixKey, Run, SessionTurns
from vericache.sim.workload import OutputLengths

HOST_TIER = 256 * 10**9


def _central_estimate(run: Run, turns: SessionTurns):
    return next(e for e in path_estimates(run, 0, turns) if e.path is ServingPath.VERICACHE)


def test_the_routed_full_kv_deployment_chooses_among_the_full_kv_paths_alone():
    scenario = remote_prefix_scenario(
        host_tier_bytes=HOST_TIER, num_prefixes=4, arrivals=(0.0,) * 32,
        output_lengths=OutputLengths((256,)),
    )  # fmt: skip
    run = Run(scenario)
    paths = {e.path for e in path_estimates(run, 0, SessionTurns((256,)), with_vericache=False)}
    assert ServingPath.VERICACHE not in paths and ServingPath.FULL_LOCAL in paths
    routed = simulate_auto(scenario, full_kv_only=True)
    auto = simulate_auto(dataclasses.replace(scenario, warm_nodes=True))
    assert "vericache" not in routed.paths and sum(routed.paths.values()) == 32
    assert routed.num_output_tokens == auto.num_output_tokens == 32 * 256


def test_auto_is_held_to_the_routed_full_kv_deployment_among_the_strongest():
    scenario = remote_prefix_scenario(
        host_tier_bytes=HOST_TIER, num_prefixes=4, arrivals=(0.0,) * 16,
        output_lengths=OutputLengths((128,)),
    )  # fmt: skip
    compared = compare_deployments(scenario)
    runs = compared["runs"]
    assert FULL_ROUTED in runs
    assert compared["arrival_bound_tokens_per_s"] == arrival_bound_tokens_per_s(scenario)
    strongest = runs[compared["strongest"]].tokens_per_s
    assert strongest >= runs[FULL_ROUTED].tokens_per_s
    assert compared["auto_vs_strongest"] == pytest.approx(runs["auto"].tokens_per_s / strongest)


def test_a_central_rounds_estimate_waits_out_the_transfers_queued_on_the_drafters_link():
    # A round's exact KV crosses the drafter's link behind the prefixes fetched ahead of it.
    run = Run(remote_prefix_scenario(num_drafters=1))
    turns = SessionTurns((256,))
    idle = _central_estimate(run, turns).seconds_per_token
    link = run.drafters[0].link
    link.send(int(4.8e9), lambda: None)  # 4 s of a prefix fetch queued ahead
    busy = _central_estimate(run, turns).seconds_per_token
    per_round = link.foreground_wait_s() / (run.mean_accepted + 1)
    assert busy - idle == pytest.approx(per_round, rel=0.05)


def test_a_central_sessions_setup_fetches_its_compressed_kv_after_the_verifiers_full_kv():
    # Memory in one order: the drafter admits the session once the verifier's prefix is in.
    run = Run(remote_prefix_scenario(num_drafters=1))
    scenario, drafter, verifier = run.scenario, run.drafters[0], run.verifiers[0]
    full_s = verifier.fetches.ready_s(PrefixKey(0, False), scenario.prefix_bytes(False))
    compressed_s = drafter.fetches.ready_s(PrefixKey(0, True), scenario.prefix_bytes(True))
    setup = _central_estimate(run, SessionTurns((256,))).setup_s
    assert setup > full_s + compressed_s


def test_no_deployment_passes_the_arrivals_bound():
    scenario = remote_prefix_scenario(
        host_tier_bytes=HOST_TIER, arrivals=(0.0, 5.0), output_lengths=OutputLengths((256,)),
    )  # fmt: skip
    bound = arrival_bound_tokens_per_s(scenario)
    step_s = scenario.forward_s([scenario.row(1, scenario.suffix_tokens, compressed=False)])
    assert bound == pytest.approx(512 / (5.0 + 256 * step_s))
    for report in compare_deployments(scenario)["runs"].values():
        assert report.tokens_per_s <= bound
    assert arrival_bound_tokens_per_s(dataclasses.replace(scenario, concurrency=1)) is None
