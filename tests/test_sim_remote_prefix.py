"""Pipeline 2 simulated: accounts, the drafters' prefix LRU, the slow link's effect, and a golden
result."""

from __future__ import annotations

import pytest

from tests.sim_scenarios import remote_prefix_scenario
from vericache.errors import InvalidRequestError
from vericache.sim.events import Link, Simulation
from vericache.sim.remote_prefix import (
    FullPool,
    PrefixCache,
    compare,
    simulate_full,
    simulate_vericache,
)

_scenario = remote_prefix_scenario


def test_every_configuration_serves_every_token():
    scenario = _scenario()
    result = compare(scenario)
    totals = {name: result[name].num_output_tokens for name in ("vericache", "full_local")}
    totals |= {name: result[name].num_output_tokens for name in ("full_remote", "full_both")}
    assert len(set(totals.values())) == 1 and totals["vericache"] > 32 * 64
    vericache = result["vericache"]
    assert len(vericache.latencies_s) == 32
    rounds = zip(vericache.accepted_per_round, vericache.draft_lens, strict=True)
    assert all(0 <= accepted <= drafts <= 40 for accepted, drafts in rounds)
    # The verifier loads each request's full prefix from the store, once.
    local = simulate_full(scenario, FullPool.LOCAL)
    assert local.link_bytes == 32 * scenario.prefix_bytes(compressed=False)
    assert result["vericache_over_best_full"] == pytest.approx(
        vericache.tokens_per_s
        / max(result[name].tokens_per_s for name in ("full_local", "full_remote", "full_both"))
    )


def test_a_drafters_prefixes_are_fetched_once_at_a_time_and_evicted_least_recent_first():
    sim = Simulation()
    link, cache, ready = Link(sim, "network", 100.0), PrefixCache(capacity_bytes=250), []
    for prefix in (1, 1, 2):
        cache.ensure(prefix, 100, link, lambda p=prefix: ready.append((p, sim.now)))
    sim.run()
    assert ready == [(1, 1.0), (1, 1.0), (2, 2.0)] and link.bytes_sent == 200
    cache.ensure(1, 100, link, lambda: ready.append((1, sim.now)))  # a hit: now the most recent
    cache.ensure(3, 100, link, lambda: ready.append((3, sim.now)))  # 300 > 250: evicts 2
    sim.run()
    cache.ensure(2, 100, link, lambda: ready.append((2, sim.now)))
    sim.run()
    assert link.bytes_sent == 400 and ready[-1] == (2, 4.0)


def test_a_slower_network_hurts_full_kv_on_the_drafters_more_than_vericache():
    fast, slow = (compare(_scenario(network_bytes_per_s=bandwidth)) for bandwidth in (12e9, 0.6e9))
    assert slow["full_remote"].tokens_per_s < 0.7 * fast["full_remote"].tokens_per_s
    assert slow["vericache_over_best_full"] > fast["vericache_over_best_full"]


def test_a_small_scenario_gives_its_golden_result_and_bad_input_is_refused():
    result = compare(_scenario())
    got = {name: result[name].tokens_per_s for name in GOLDEN}
    assert got == pytest.approx(GOLDEN, rel=1e-9)
    with pytest.raises(InvalidRequestError, match="rate"):
        simulate_full(_scenario(), FullPool.BOTH)
    with pytest.raises(InvalidRequestError):
        _scenario(compressed_ratio=0.0)
    assert simulate_vericache(_scenario(arrivals=(0.0,))).num_output_tokens in (64, 256)


# Pinned: a change to the event core, the batch loop, the cost model or the engine's round
# (engine/sequence.py, which decodes every simulated request) moves these on purpose.
GOLDEN = {
    "vericache": 268.6089207893294,
    "full_local": 329.6278657397559,
    "full_remote": 208.06128643891407,
    "full_both": 336.9114889219232,
}
