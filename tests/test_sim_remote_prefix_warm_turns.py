"""Sequential turns on a warm drafter node, as served (serve/workers/warm_node.py): the node keeps
the full KV of each VeriCache session it verified in its one turn cache, beside its full-KV
sessions' turns, and a session that opens its verification there (arriving warm, or moving there
between rounds) prefills only what a kept turn lacks; `mode: auto` prices that."""

from __future__ import annotations

import pytest

from tests.test_sim_remote_prefix_turns import (
    ONLY_SUFFIXES,
    OUTPUT,
    SUFFIX,
    TURNS,
    _prefills,
    _recorded,
    _turn_keys,
    _turns,
)
from vericache.scheduler.path_choice import ServingPath
from vericache.sim.remote_prefix import VeriCacheRequest
from vericache.sim.remote_prefix_auto import path_estimates
from vericache.sim.remote_prefix_full import FullRequest
from vericache.sim.remote_prefix_workers import PrefixKey, Run, SessionTurns
from vericache.sim.turn_kv import TurnKey, keep, served_keeps


def _warm_run(**changes) -> Run:
    """One drafter, warm for the one prefix from the start: its host tier holds the full KV."""
    scenario = _turns(warm_nodes=True, num_drafters=1, num_prefixes=1, **changes)
    run = Run(scenario)
    run.drafters[0].host_tier.put(PrefixKey(0, False), scenario.prefix_bytes(compressed=False))
    return run


def _second_turn() -> SessionTurns:
    turns = SessionTurns((OUTPUT,) * TURNS)
    turns.advance(SUFFIX, OUTPUT)
    return turns


def test_a_warm_node_keeps_the_turns_it_verified_and_prefills_only_each_turns_new_tokens():
    run = _warm_run()
    rows, kept = _recorded(run), []

    def start(run: Run, prefix: int, turns: SessionTurns, arrival_s: float) -> None:
        kept.append([key.num_tokens for key in _turn_keys(run, run.drafters)])
        VeriCacheRequest.start(run, prefix, turns, arrival_s)

    report = run.serve(start)
    assert report.num_central_verifications == 0
    assert kept == [[], [SUFFIX + OUTPUT], [2 * (SUFFIX + OUTPUT)]]
    assert _prefills(run, rows) == ONLY_SUFFIXES
    # Each turn read its turn before's KV in place and let it go; the last keeps none.
    assert not _turn_keys(run, run.workers)


@pytest.mark.parametrize(
    "first, second", [("vericache", "full"), ("full", "vericache")], ids=["then-full", "then-vc"]
)
def test_a_drafters_one_turn_cache_serves_its_full_kv_and_its_warm_vericache_turns(first, second):
    run = _warm_run(turns_per_session=2)
    rows, drafter = _recorded(run), run.drafters[0]

    def start(run: Run, prefix: int, turns: SessionTurns, arrival_s: float) -> None:
        drafter.num_requests += 1
        if (first, second)[turns.index] == "vericache":
            VeriCacheRequest.start(run, prefix, turns, arrival_s, drafter=drafter)
        else:
            FullRequest.open_on(run, prefix, turns, arrival_s, drafter, served_keeps(drafter))

    run.serve(start)
    assert _prefills(run, rows) == ONLY_SUFFIXES[:2]


@pytest.mark.parametrize("kept_in", ["device", "host-tier"])
def test_a_session_moving_onto_its_warm_node_reuses_the_turn_the_node_kept(kept_in):
    # A fast network: the node's full KV arrives while the second turn decodes centrally.
    scenario = _turns(warm_nodes=True, num_drafters=1, num_prefixes=1, network_bytes_per_s=12e9)
    run = Run(scenario)
    rows, drafter = _recorded(run), run.drafters[0]
    turns = SessionTurns((OUTPUT, 1024))
    turns.advance(SUFFIX, OUTPUT)
    key = TurnKey.of(turns)
    nbytes = key.num_tokens * scenario.kv_bytes_per_token
    if kept_in == "device":
        drafter.memory.offer(key, nbytes)
    else:
        drafter.host_tier.put(key, nbytes)
    run.sim.at(0.0, lambda: VeriCacheRequest.start(run, 0, turns, 0.0))
    run.sim.run()
    assert run.report.num_warm_switches == 1
    # The central verifier prefilled all after the prefix; the node, past the kept turn alone.
    (central, central_after), (_, node_after) = _prefills(run, rows)
    assert (central, central_after) == (2 * SUFFIX + OUTPUT, 0)
    assert node_after == key.num_tokens
    loaded = drafter.host_link.bytes_delivered - scenario.prefix_bytes(compressed=False)
    assert loaded == (nbytes if kept_in == "host-tier" else 0)


@pytest.mark.parametrize("kept_in", ["device", "host-tier"])
def test_auto_prices_a_warm_nodes_vericache_with_the_turn_its_node_keeps(kept_in):
    turns = _second_turn()
    cold, kept = _warm_run(), _warm_run()
    drafter = kept.drafters[0]
    nbytes = turns.history_tokens * kept.scenario.kv_bytes_per_token
    if kept_in == "device":
        keep(drafter, turns, turns.history_tokens, served_keeps(drafter))
        load_s = 0.0
    else:
        drafter.host_tier.put(TurnKey.of(turns), nbytes)
        load_s = drafter.host_link.seconds_for(nbytes)
    spared_s = {}
    for far, near in zip(path_estimates(cold, 0, turns), path_estimates(kept, 0, turns)):
        assert (far.path, far.worker) == (near.path, near.worker)
        spared_s[far.path] = far.setup_s - near.setup_s
    # The node prefills both paths' prompts alike: the same prefill spared, less the same load.
    warm = (ServingPath.VERICACHE, ServingPath.FULL_WARM)
    assert spared_s[ServingPath.VERICACHE] == pytest.approx(spared_s[ServingPath.FULL_WARM])
    assert all(spared_s[path] > 0 for path in warm)
    assert spared_s[ServingPath.FULL_LOCAL] == 0
    if kept_in == "host-tier":
        on_device = _warm_run()
        keep(on_device.drafters[0], turns, turns.history_tokens, served_keeps(drafter))
        near = {e.path: e.setup_s for e in path_estimates(on_device, 0, turns)}
        loaded = {e.path: e.setup_s for e in path_estimates(kept, 0, turns)}
        for path in warm:
            assert loaded[path] - near[path] == pytest.approx(load_s)
