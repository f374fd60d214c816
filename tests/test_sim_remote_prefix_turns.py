"""Sequential turns as served: each turn a request of its own, arriving when the one before it ends.
VeriCache and `mode: auto` place (and auto chooses) each turn anew; their verifiers keep a
finished session's KV for its next turn, their drafters a full-KV turn's (auto's FULL_REMOTE,
FULL_WARM) and a VeriCache session's that their warm node verified
(test_sim_remote_prefix_warm_turns.py), never one a central verifier verified; a full-KV
deployment with prefix caching keeps a finished turn's KV for the next on any worker, as vLLM's
and SGLang's do; both on the device where memory allows, into the host tier after; the paper's
baseline keeps nothing."""

from __future__ import annotations

import dataclasses

import pytest

from tests.sim_scenarios import remote_prefix_scenario
from vericache.scheduler.path_choice import ServingPath
from vericache.sim.cost import Row
from vericache.sim.remote_prefix import VeriCacheRequest
from vericache.sim.remote_prefix_auto import path_estimates, start_auto
from vericache.sim.remote_prefix_compare import paper_baseline_scenario
from vericache.sim.remote_prefix_full import FullPool, FullRequest, full_start
from vericache.sim.remote_prefix_workers import PrefixKey, Run, SessionTurns
from vericache.sim.turn_kv import KeptTurns, TurnKey, keep, served_keeps
from vericache.sim.workload import OutputLengths

SUFFIX, OUTPUT, TURNS = 256, 32, 3


def _turns(**changes):
    """One session of 3 turns by default: a 256-token suffix (more than a verification's x + 1
    tokens, so a prefill's rows stand apart) and 32 output tokens a turn."""
    base = remote_prefix_scenario(
        turns_per_session=TURNS, arrivals=(0.0,), suffix_tokens=SUFFIX,
        output_lengths=OutputLengths((OUTPUT,)), host_tier_bytes=10**11,
    )  # fmt: skip
    return dataclasses.replace(base, **changes)


def _recorded(run: Run) -> list[Row]:
    """Every row of every forward `run`'s workers run, in order."""
    rows: list[Row] = []
    for worker in run.workers:
        forward_s = worker.loop.forward_s

        def recorded(batch: list[Row], forward_s=forward_s) -> float:
            rows.extend(batch)
            return forward_s(batch)

        worker.loop.forward_s = recorded
    return rows


def _prefills(run: Run, rows: list[Row]) -> list[tuple[int, int]]:
    """Each prefill chunk's tokens, and the exact tokens past the prefix that it follows."""
    scenario = run.scenario
    return [
        (row.num_new_tokens, row.context_tokens - scenario.prefix_tokens)
        for row in rows
        if row.num_new_tokens > scenario.draft_len + 1
    ]


# Every token after the prefix, each turn: the suffixes and outputs of the turns before it too.
ALL_AFTER_PREFIX = [(SUFFIX, 0), (2 * SUFFIX + OUTPUT, 0), (3 * SUFFIX + 2 * OUTPUT, 0)]
# Each turn's suffix alone, after the turns before it, whose KV its worker kept.
ONLY_SUFFIXES = [(SUFFIX, n * (SUFFIX + OUTPUT)) for n in range(TURNS)]


def _turn_keys(run: Run, workers) -> list[TurnKey]:
    """The kept turns every worker of `workers` holds on its device or in its host tier."""
    return [
        key
        for worker in workers
        for held in (worker.memory._held, worker.host_tier._held)
        for key in held
        if isinstance(key, TurnKey)
    ]


@pytest.mark.parametrize("warm_nodes", [False, True], ids=["central", "warm-nodes"])
def test_vericache_keeps_a_sessions_kv_between_its_turns_on_its_verifier_alone(warm_nodes):
    scenario = _turns(warm_nodes=warm_nodes)
    run = Run(scenario)
    rows, kept = _recorded(run), []

    def start(run: Run, prefix: int, turns: SessionTurns, arrival_s: float) -> None:
        kept.append((_turn_keys(run, run.verifiers), _turn_keys(run, run.drafters)))
        VeriCacheRequest.start(run, prefix, turns, arrival_s)

    report = run.serve(start)
    assert report.num_output_tokens == TURNS * OUTPUT and len(report.latencies_s) == 1
    # Each later turn finds the turn before's KV on the verifier's device, none on a drafter.
    assert [drafters for _, drafters in kept] == [[]] * TURNS
    assert [[k.num_tokens for k in verifier] for verifier, _ in kept] == [
        [], [SUFFIX + OUTPUT], [2 * (SUFFIX + OUTPUT)]
    ]  # fmt: skip
    assert report.num_warm_switches == 0 and _prefills(run, rows) == ONLY_SUFFIXES
    # The verifier still hands each turn's prompt after the prefix to the drafter as exact KV.
    handed = sum(num_tokens + 1 for num_tokens, _ in ALL_AFTER_PREFIX)
    compressed = scenario.prefix_bytes(compressed=True)
    assert run.drafters[0].link.bytes_delivered >= compressed + (
        handed * scenario.kv_bytes_per_token
    )


def test_vericache_places_each_turn_when_it_arrives():
    run = Run(_turns(arrivals=(0.0,) * 4, num_prefixes=2))
    placed = []  # whether each placement was a drafter's
    place = run.place

    def counted(workers, prefix, prefer=None):
        placed.append(workers is run.drafters)
        return place(workers, prefix, prefer)

    run.place = counted
    run.serve(VeriCacheRequest.start)
    num_requests = 4 * TURNS
    assert placed.count(True) == placed.count(False) == num_requests  # a drafter, a verifier


def test_auto_chooses_each_turns_path_when_it_arrives():
    scenario = _turns(arrivals=(0.0,) * 4, warm_nodes=True)
    run = Run(scenario)
    chosen: dict[int, list[int]] = {}

    def start(run: Run, prefix: int, turns: SessionTurns, arrival_s: float) -> None:
        chosen.setdefault(id(turns), []).append(turns.index)
        before = sum(run.report.paths.values())
        start_auto(run, prefix, turns, arrival_s)
        assert sum(run.report.paths.values()) == before + 1

    report = run.serve(start)
    assert sorted(chosen.values()) == [list(range(TURNS))] * 4
    assert sum(report.paths.values()) == 4 * TURNS
    # Where no worker kept the turn before, a later turn's estimate prefills the earlier turns'
    # tokens too, on every path.
    first, later = SessionTurns((OUTPUT,) * TURNS), SessionTurns((OUTPUT,) * TURNS)
    for _ in range(TURNS - 1):
        later.advance(SUFFIX, 4096)
    idle = Run(scenario)
    for early, late in zip(path_estimates(idle, 0, first), path_estimates(idle, 0, later)):
        assert (early.path, early.worker) == (late.path, late.worker)
        assert late.setup_s > early.setup_s


@pytest.mark.parametrize("warm_nodes", [False, True], ids=["central", "warm-nodes"])
def test_auto_on_a_verifier_prefills_only_each_turns_new_tokens(warm_nodes):
    run = Run(_turns(turns_per_session=2, warm_nodes=warm_nodes), weighs_recompute=True)
    rows = _recorded(run)
    report = run.serve(start_auto)
    assert report.paths == {ServingPath.FULL_LOCAL.value: 2}
    assert _prefills(run, rows) == ONLY_SUFFIXES[:2]


@pytest.mark.parametrize("warm_nodes", [False, True], ids=["full-remote", "full-warm"])
def test_auto_on_a_drafter_prefills_only_each_turns_new_tokens(warm_nodes):
    # The store is slow: full decoding on the drafter, over the network's copy or its host
    # tier's, comes first.
    scenario = _turns(
        turns_per_session=2, warm_nodes=warm_nodes, store_bytes_per_s=1e8, num_drafters=1,
        num_prefixes=1,
    )  # fmt: skip
    run = Run(scenario, weighs_recompute=True)
    rows, kept = _recorded(run), []
    if warm_nodes:
        run.drafters[0].host_tier.put(PrefixKey(0, False), scenario.prefix_bytes(False))

    def start(run: Run, prefix: int, turns: SessionTurns, arrival_s: float) -> None:
        kept.append([key.num_tokens for key in _turn_keys(run, run.drafters)])
        start_auto(run, prefix, turns, arrival_s)

    report = run.serve(start)
    path = ServingPath.FULL_WARM if warm_nodes else ServingPath.FULL_REMOTE
    assert report.paths == {path.value: 2}
    # The drafter kept the first turn on its device, and the second prefilled its suffix alone.
    assert kept == [[], [SUFFIX + OUTPUT]]
    assert _prefills(run, rows) == ONLY_SUFFIXES[:2]
    assert run.drafters[0].host_link.bytes_delivered <= scenario.prefix_bytes(False)


@pytest.mark.parametrize("role", ["verifiers", "drafters"])
def test_auto_estimates_see_the_shorter_prefill_where_a_worker_keeps_the_turn_before(role):
    scenario = _turns(num_drafters=1)
    turns = SessionTurns((OUTPUT,) * TURNS)
    turns.advance(SUFFIX, OUTPUT)
    cold, kept = Run(scenario), Run(scenario)
    keep(getattr(kept, role)[0], turns, turns.history_tokens, KeptTurns.DEVICE)
    estimates = list(zip(path_estimates(cold, 0, turns), path_estimates(kept, 0, turns)))
    by_path = {far.path: (far.setup_s, near.setup_s) for far, near in estimates}
    # The verifier's prefill is shorter for FULL_LOCAL and VeriCache's, the drafter's for
    # FULL_REMOTE alone: its node is cold, and a central verifier prefills VeriCache's.
    shorter = {
        "verifiers": (ServingPath.FULL_LOCAL, ServingPath.VERICACHE),
        "drafters": (ServingPath.FULL_REMOTE,),
    }[role]
    for path, (far, near) in by_path.items():
        assert near < far if path in shorter else near == far


@pytest.mark.parametrize("role", ["verifiers", "drafters"])
def test_auto_estimates_price_the_pcie_load_of_a_turn_in_the_host_tier(role):
    scenario = _turns(num_drafters=1)
    turns = SessionTurns((OUTPUT,) * TURNS)
    turns.advance(SUFFIX, OUTPUT)
    nbytes = turns.history_tokens * scenario.kv_bytes_per_token
    cold, on_device, in_host = Run(scenario), Run(scenario), Run(scenario)
    keep(getattr(on_device, role)[0], turns, turns.history_tokens, KeptTurns.TIERED)
    spilled = getattr(in_host, role)[0]
    spilled.host_tier.put(TurnKey.of(turns), nbytes)
    assert served_keeps(spilled) is KeptTurns.TIERED
    load_s = spilled.host_link.seconds_for(nbytes)
    shorter = {
        "verifiers": (ServingPath.FULL_LOCAL, ServingPath.VERICACHE),
        "drafters": (ServingPath.FULL_REMOTE,),
    }[role]
    runs = (cold, on_device, in_host)
    for far, near, loaded in zip(*(path_estimates(run, 0, turns) for run in runs)):
        if far.path in shorter:  # the prefill it spares, less the load it costs
            assert near.setup_s < loaded.setup_s < far.setup_s
            assert loaded.setup_s - near.setup_s == pytest.approx(load_s)
        else:
            assert far.setup_s == near.setup_s == loaded.setup_s


def test_a_full_kv_deployment_with_prefix_caching_reuses_the_turn_befores_kv():
    cached = _turns()
    for pool in FullPool:
        run = Run(cached)
        rows = _recorded(run)
        run.serve(full_start(pool, {FullPool.LOCAL: 1.0, FullPool.REMOTE: 1.0}))
        # Each later turn prefills only its suffix, after the turns before it.
        assert _prefills(run, rows) == ONLY_SUFFIXES
    # The paper's baseline keeps nothing: every turn fetches the prefix again and prefills all.
    paper = paper_baseline_scenario(cached)
    run = Run(paper)
    rows = _recorded(run)
    report = run.serve(full_start(FullPool.REMOTE))
    assert _prefills(run, rows) == ALL_AFTER_PREFIX
    assert report.link_bytes == TURNS * paper.prefix_bytes(compressed=False)


def test_a_full_kv_turn_placed_elsewhere_prefills_all_its_prompt_again():
    run = Run(_turns(num_verifiers=2, turns_per_session=2))
    rows = _recorded(run)
    served = []

    def start(run: Run, prefix: int, turns: SessionTurns, arrival_s: float) -> None:
        # The first turn on one verifier, the second on the other.
        worker = run.verifiers[len(served)]
        worker.num_requests += 1
        served.append(worker)
        FullRequest.open_on(run, prefix, turns, arrival_s, worker, KeptTurns.TIERED)

    run.serve(start)
    assert _prefills(run, rows) == [(SUFFIX, 0), (2 * SUFFIX + OUTPUT, 0)]


@pytest.mark.parametrize("host_tier_bytes", [None, 10**12], ids=["no-tier", "host-tier"])
@pytest.mark.parametrize(
    "start", [full_start(FullPool.LOCAL), VeriCacheRequest.start], ids=["full-kv", "vericache"]
)
def test_a_kept_turns_kv_stays_while_memory_allows_then_comes_back_from_the_host_tier(
    start, host_tier_bytes
):
    # 32 sessions over prefixes of their own on one verifier that holds about 14 of them: the
    # sessions waiting for room take it from a finished turn's KV. The baseline's and the served
    # verifier's (`--turn-host-bytes`) alike spill it into the host tier.
    scenario = _turns(
        arrivals=(0.0,) * 32, num_prefixes=32, prefixes_in_turn=True,
        host_tier_bytes=host_tier_bytes,
    )  # fmt: skip
    run = Run(scenario)
    rows = _recorded(run)
    run.serve(start)
    prefilled = sum(num_tokens for num_tokens, _ in _prefills(run, rows))
    only_suffixes = 32 * TURNS * SUFFIX
    host_bytes = run.verifiers[0].host_link.bytes_delivered
    if host_tier_bytes is None:
        assert prefilled > only_suffixes and host_bytes == 0
    else:  # every later turn found its KV, on the device or over PCIe
        prefixes = scenario.prefix_bytes(compressed=False) * run.report.prefix_sources["host_tier"]
        assert prefilled == only_suffixes and host_bytes > prefixes


def test_sequential_turns_run_each_turn_after_the_last_over_a_growing_prompt():
    scenario = remote_prefix_scenario(
        turns_per_session=3, arrivals=(0.0,) * 2, output_lengths=OutputLengths((32,))
    )
    for start in (VeriCacheRequest.start, full_start(FullPool.LOCAL)):
        report = Run(scenario).serve(start)
        assert report.num_output_tokens == 2 * 3 * 32 and len(report.latencies_s) == 2
    turns = SessionTurns((32, 32, 32))
    turns.advance(scenario.suffix_tokens, 32)
    assert (
        Run(scenario).sequence(turns).seq.room
        < Run(scenario).sequence(SessionTurns((32,))).seq.room
    )
