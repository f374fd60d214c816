"""Pipeline 2 as a well-run deployment serves it: shared-prefix attention, background transfers,
host tiers, recomputed prefixes, VeriCache's warm drafter nodes and `mode: auto`'s choice of path
(sequential turns: test_sim_remote_prefix_turns.py)."""

from __future__ import annotations

import dataclasses

import pytest

from tests.sim_scenarios import remote_prefix_scenario
from vericache.scheduler.path_choice import (
    PathEstimate,
    ServingPath,
    Slowed,
    choose_path,
    round_seconds_per_token,
)
from vericache.sim.cost import forward_cost
from vericache.sim.events import BACKGROUND_SLICE_BYTES, Link, Simulation
from vericache.sim.host_tier import HostTier, Source, TieredFetch
from vericache.sim.kv_memory import Session, WorkerMemory
from vericache.sim.remote_prefix import VeriCacheRequest, simulate_vericache
from vericache.sim.remote_prefix_auto import path_estimates, simulate_auto, start_auto
from vericache.sim.remote_prefix_compare import paper_baseline_scenario
from vericache.sim.remote_prefix_full import FullPool, FullRequest, simulate_full
from vericache.sim.remote_prefix_workers import PrefixKey, Run, SessionTurns, binding
from vericache.sim.turn_kv import served_keeps
from vericache.sim.workload import OutputLengths

HOST_TIER = 256 * 10**9


def _warm(**changes):
    """The shared small scenario with a host tier on every node and warm drafter nodes: 2
    prefixes, long replies, so that the drafters' full KV arrives while their sessions run."""
    base = remote_prefix_scenario(
        host_tier_bytes=HOST_TIER, warm_nodes=True, shared_prefix_attention=True,
        num_prefixes=2, arrivals=(0.0,) * 8, output_lengths=OutputLengths((1024,)),
    )  # fmt: skip
    return dataclasses.replace(base, **changes)


def test_rows_over_one_shared_prefix_read_it_once_per_forward():
    scenario = remote_prefix_scenario(shared_prefix_attention=True)
    model, device = scenario.model, scenario.device
    shared = [scenario.row(1, 64, False, prefix_key="a") for _ in range(4)]
    private = [scenario.row(1, 64, False) for _ in range(4)]
    one, four, apart = (forward_cost(model, device, rows) for rows in (shared[:1], shared, private))
    own_bytes = 64 * scenario.kv_bytes_per_token + scenario.kv_bytes_per_token  # and its new one
    assert four.kv_bytes == pytest.approx(one.kv_bytes + 3 * own_bytes)
    assert apart.kv_bytes == pytest.approx(4 * one.kv_bytes)
    assert four.flops == apart.flops  # every row still attends over the whole prefix
    assert four.seconds < apart.seconds
    other = scenario.row(1, 64, False, prefix_key="b")  # another prefix: read once more
    assert forward_cost(model, device, [*shared, other]).kv_bytes == pytest.approx(
        four.kv_bytes + one.kv_bytes
    )


def test_background_transfers_move_only_while_no_foreground_one_waits():
    sim = Simulation()
    link = Link(sim, "network", bytes_per_s=BACKGROUND_SLICE_BYTES)  # a slice a second
    arrived = {}
    link.send(10 * BACKGROUND_SLICE_BYTES, lambda: arrived.setdefault("stream", sim.now), True)
    sim.at(
        1.5, lambda: link.send(BACKGROUND_SLICE_BYTES, lambda: arrived.setdefault("fetch", sim.now))
    )
    sim.run()
    # The fetch waits for the slice under way (until 2 s), not for the stream's 10 s.
    assert arrived == {"fetch": 3.0, "stream": 11.0}
    assert link.background_busy_s == pytest.approx(10.0) and link.busy_s == pytest.approx(11.0)


def test_a_host_tier_keeps_what_the_device_evicts_least_recent_out_first():
    tier = HostTier(capacity_bytes=2000)
    for prefix in ("a", "b"):
        assert tier.put(prefix, 1000)
    tier.touch("a")
    assert tier.put("c", 1000) and tier.num_evictions == 1
    assert (tier.holds("a"), tier.holds("b"), tier.holds("c")) == (True, False, True)
    assert not tier.put("huge", 3000) and tier.used_bytes == 2000

    sim = Simulation()
    network, pcie = Link(sim, "network", 100.0), Link(sim, "pcie", 1000.0)
    fetches = TieredFetch(network, pcie, HostTier(10_000), recompute=None)
    memory = WorkerMemory(1100, network, source=fetches)  # room for one prefix's KV
    for prefix in (1, 2, 1):  # 1 is evicted for 2, then comes back from the host tier
        session = Session(prefix, 1000, 10)
        memory.admit(session, lambda: None)
        sim.run()
        memory.release(session)
    assert network.bytes_delivered == 2000 and pcie.bytes_delivered == 1000
    assert (fetches.counts[Source.LINK], fetches.counts[Source.HOST_TIER]) == (2, 1)
    assert sim.now == pytest.approx(20.0 + 1.0)  # two fetches at 10 s, one load at 1 s
    # A prefix that reached the device without landing in the tier (read through it for a
    # verification) goes there when the device evicts it.
    tier = HostTier(10_000)
    memory = WorkerMemory(1100, network, source=TieredFetch(network, pcie, tier, None))
    memory.offer("read", 1000)
    assert memory.holds("read") and not tier.holds("read")
    memory.admit(Session("other", 1000, 10), lambda: None)
    assert not memory.holds("read") and tier.holds("read")


class _Prefill:
    def __init__(self, seconds: float):
        self.prefill_s, self.num_runs = seconds, 0

    def seconds(self, prefix):
        return self.prefill_s

    def run(self, prefix, done):
        self.num_runs += 1
        done()


@pytest.mark.parametrize(
    "prefill_s, num_jobs, recomputes",
    [(1.0, None, True), (20.0, None, False), (4.0, 1, True), (4.0, 3, False)],
)
def test_a_prefix_is_recomputed_where_its_prefill_beats_its_fetch(prefill_s, num_jobs, recomputes):
    # Where the choice weighs the jobs on the device (`mode: auto`), each waits out the prefill
    # too: 4 s held up for 2 sessions beats a 10 s fetch, for 4 it does not.
    sim = Simulation()
    network = Link(sim, "network", 100.0)  # a 1000-byte prefix in 10 s
    prefill = _Prefill(prefill_s)
    holds_up = None if num_jobs is None else (lambda: num_jobs)
    fetches = TieredFetch(network, Link(sim, "pcie", 1e6), None, prefill, holds_up=holds_up)
    fetches.fetch("p", 1000, lambda: None)
    sim.run()
    assert (prefill.num_runs == 1, network.bytes_sent == 0) == (recomputes, recomputes)


def test_over_a_slow_network_full_kv_drafters_recompute_prefixes_and_serve_sooner():
    slow = remote_prefix_scenario(network_bytes_per_s=0.3e9, arrivals=(0.0,) * 8, num_prefixes=4)
    fetched = simulate_full(slow, FullPool.REMOTE)
    recomputed = simulate_full(dataclasses.replace(slow, recompute_prefixes=True), FullPool.REMOTE)
    assert (
        recomputed.prefix_sources["recomputed"] > 0 and recomputed.link_bytes < fetched.link_bytes
    )
    assert recomputed.num_output_tokens == fetched.num_output_tokens
    assert recomputed.tokens_per_s > fetched.tokens_per_s


def test_a_warm_node_takes_its_sessions_verification_from_the_central_verifier():
    warm = simulate_vericache(_warm())
    cold = simulate_vericache(_warm(warm_nodes=False))
    assert warm.num_output_tokens == cold.num_output_tokens == 8 * 1024
    assert warm.num_warm_streams == 2 and warm.num_warm_switches == 8
    assert warm.num_local_verifications > 0
    rounds = len(warm.accepted_per_round)
    assert warm.num_central_verifications + warm.num_local_verifications == rounds
    assert cold.num_central_verifications == len(cold.accepted_per_round)
    assert warm.num_central_verifications < rounds / 2  # the central verifier let them go
    # The stream moved each prefix's full KV to its drafter once, behind the foreground.
    assert warm.link_bytes >= 2 * _warm().prefix_bytes(compressed=False)


def test_a_session_arriving_at_a_warm_node_never_visits_the_central_verifier():
    scenario = _warm(num_prefixes=1, arrivals=(0.0, 60.0), output_lengths=OutputLengths((512,)))
    run = Run(scenario)
    report = run.serve(VeriCacheRequest.start)
    assert report.num_warm_switches == 1  # the first; the second started local
    verifier = run.verifiers[0]
    assert verifier.num_requests == 0 and verifier.memory.used_bytes <= verifier.memory.peak_bytes
    assert report.num_local_verifications > report.num_central_verifications


def test_placement_prefers_a_node_whose_host_tier_holds_the_full_kv():
    run = Run(_warm(num_drafters=4))
    rendezvous = run.choose(run.drafters, 0)
    other = next(w for w in run.drafters if w is not rendezvous)
    other.host_tier.put(PrefixKey(0, False), 1)
    assert run.choose(run.drafters, 0) is other
    assert run.choose(run.drafters, 1) is not None  # others' placement unchanged by it


def test_auto_chooses_the_path_that_finishes_first():
    slow = PathEstimate(ServingPath.FULL_REMOTE, "d", setup_s=3.6, seconds_per_token=0.02)
    fast_start = PathEstimate(ServingPath.VERICACHE, "d", setup_s=1.0, seconds_per_token=0.04)
    waiting = PathEstimate(ServingPath.FULL_LOCAL, "v", 0.1, 0.02, memory_wait_s=30.0)
    assert choose_path([slow, fast_start, waiting], 64) is fast_start
    assert choose_path([slow, fast_start, waiting], 512) is slow
    assert round_seconds_per_token(40, 0.02, 0.03, 0.0, 19.0) == pytest.approx(0.0415)
    # On an idle cluster the verifier beside the store starts first and decodes as fast.
    run = Run(_warm())
    estimates = {e.path: e for e in path_estimates(run, 0, SessionTurns((256,)))}
    assert choose_path(list(estimates.values()), 256).path is ServingPath.FULL_LOCAL
    assert estimates[ServingPath.FULL_REMOTE].setup_s > estimates[ServingPath.FULL_LOCAL].setup_s
    run.serve(start_auto)
    assert sum(run.report.paths.values()) == 8


def test_auto_weighs_the_delay_a_path_adds_to_the_requests_running_now():
    # Four requests slowed 1.25x while a 100-token request decodes beside them: over half its
    # decoding (1 s) each makes 0.8 of its progress, so each finishes 0.2 s later.
    assert Slowed(4, 1.25).delay_s(1.0) == pytest.approx(0.8)
    joins = PathEstimate(ServingPath.FULL_LOCAL, "v", 0.0, 0.021, slowed=(Slowed(4, 1.1),))
    idle = PathEstimate(ServingPath.FULL_REMOTE, "d", 0.0, 0.02, slowed=(Slowed(4, 1.25),))
    assert idle.finish_s(100) < joins.finish_s(100)  # by its own finish alone: the idle worker
    assert joins.delay_to_others_s(100) == pytest.approx(4 * 1.05 * (1 - 1 / 1.1))
    assert choose_path([idle, joins], 100) is joins  # by what it costs everyone: not
    # The simulator's estimates carry what they slow: on a busy verifier, its batch-mates.
    run = Run(_warm())
    verifier = run.verifiers[0]
    for _ in range(3):
        FullRequest.open_on(run, 0, SessionTurns((256,)), 0.0, verifier, served_keeps(verifier))
        verifier.num_requests += 1
    run.sim.run(until=1.0)  # their prefix loaded, their decoding under way
    assert len(verifier.loop.steady_rows()) == 3
    estimates = {e.path: e for e in path_estimates(run, 0, SessionTurns((256,)))}
    (batch,) = estimates[ServingPath.FULL_LOCAL].slowed
    assert batch.num_requests >= 1 and batch.factor > 1


def test_auto_spreads_to_the_drafters_once_the_verifier_is_loaded():
    # Without shared-prefix attention each row reads its prefix's 4.3 GB: a loaded verifier's
    # steps grow until a drafter's fetch (3.6 s) pays.
    scenario = _warm(
        arrivals=(0.0,) * 64, output_lengths=OutputLengths((256,)), num_prefixes=4,
        shared_prefix_attention=False,
    )  # fmt: skip
    auto = simulate_auto(scenario)
    assert auto.num_output_tokens == 64 * 256
    assert auto.paths.get("full_local", 0) > 0 and len(auto.paths) > 1
    local = simulate_full(dataclasses.replace(scenario, warm_nodes=False), FullPool.LOCAL)
    assert auto.tokens_per_s > local.tokens_per_s


def test_auto_recomputes_a_prefix_only_where_that_beats_its_fetch_for_the_jobs_it_holds_up():
    # 32 clients over 128 prefixes: the drafters are busy, and a prefix's prefill (about 2 s,
    # sooner than its 3.6 s fetch) stalls every session decoding beside it. Chosen for the
    # request alone, as a deployment's rule does, it recomputes most prefixes and serves slower.
    scenario = _warm(
        num_prefixes=128, arrivals=(0.0,) * 128, concurrency=32,
        output_lengths=OutputLengths((256, 512)), recompute_prefixes=True,
    )  # fmt: skip
    weighed = simulate_auto(scenario)
    alone = Run(scenario).serve(start_auto)
    assert weighed.num_output_tokens == alone.num_output_tokens
    assert 0 < weighed.prefix_sources["recomputed"] < alone.prefix_sources["recomputed"] / 2
    assert weighed.tokens_per_s > 1.05 * alone.tokens_per_s


def test_auto_counts_only_the_sessions_a_warm_node_verifies_against_its_pcie_reads():
    # A warm node's VeriCache sessions read the prefix's full KV over PCIe every round; its
    # full-KV sessions read theirs on the device and leave PCIe to them.
    run = Run(_warm(num_drafters=1))
    drafter = run.drafters[0]
    drafter.host_tier.put(PrefixKey(0, False), run.scenario.prefix_bytes(compressed=False))
    turns = SessionTurns((256,))

    def vericache_s() -> float:
        estimates = path_estimates(run, 0, turns)
        return next(e for e in estimates if e.path is ServingPath.VERICACHE).seconds_per_token

    drafter.num_requests = 40
    beside_full_kv = vericache_s()
    drafter.num_local_sessions = 40
    assert vericache_s() > 1.5 * beside_full_kv


def test_the_paper_baseline_moves_every_requests_full_kv_over_the_network():
    scenario = paper_baseline_scenario(_warm(output_lengths=OutputLengths((64,))))
    assert not scenario.prefix_caching and scenario.host_tier_bytes is None
    report = simulate_full(scenario, FullPool.REMOTE)
    assert report.link_bytes == 8 * scenario.prefix_bytes(compressed=False)


def test_what_binds_is_the_busiest_resource_or_else_the_arrivals():
    busy = {"verifiers": {"store_link": 0.3}, "drafters": {"network_link": 0.9, "compute": 0.1}}
    assert binding(busy) == "drafters' network_link (90%), then verifiers' store_link (30%)"
    idle = {"verifiers": {"store_link": 0.3}, "drafters": {"network_link": 0.2}}
    assert binding(idle).startswith("arrivals (busiest: verifiers' store_link (30%)")
