"""The remote-prefix benchmark's plumbing without a server: the stream, the link's calibration, the
FULL_BOTH router, the summary against the best full-KV configuration and the plot; and one small
end to end run on Ray (slow)."""

from __future__ import annotations

import dataclasses

import pytest

from vericache.bench import remote_prefix
from vericache.bench.remote_prefix_cells import (
    FEW,
    MANY,
    Cell,
    auto_groups,
    cell_record,
    many_prefix_full_cells,
    request_stream,
    vericache_cells,
)
from vericache.bench.remote_prefix_reference import ReferenceRun
from vericache.bench.remote_prefix_summary import summarize
from vericache.bench.serving import RoutedPool, Router, stream_record
from vericache.bench.workloads import CONTEXT_PROMPTS
from vericache.cli.bench import parse_benchmark_args
from vericache.client import Result
from vericache.errors import InvalidRequestError


def _args(*argv: str):
    module, args = parse_benchmark_args("remote-prefix", list(argv))
    assert module is remote_prefix
    return args


def test_quick_defaults_shrink_the_sweep_and_explicit_values_win():
    quick = remote_prefix.stream_spec(_args("--quick"))
    full = remote_prefix.stream_spec(_args())
    assert quick.num_requests < full.num_requests and quick.repeats == 1
    assert full.draft_lens == (8, 16, 30) and full.drafter_counts == (1, 2)
    assert full.schedulings == ("per-request", "staggered") and full.repeats == 3
    spec = remote_prefix.stream_spec(_args("--requests", "7", "--draft-lens", "4,9", "--quick"))
    assert spec.num_requests == 7 and spec.draft_lens == (4, 9)
    assert full.rtt_latency_s == pytest.approx(0.02)
    for bad in (["--ratio", "0"], ["--concurrency", "0"], ["--schedulings", "round-robin"]):
        with pytest.raises(InvalidRequestError):
            remote_prefix.stream_spec(_args(*bad))


def test_the_sweep_covers_every_cell_and_the_latency_pair():
    spec = remote_prefix.stream_spec(_args())
    groups = vericache_cells(spec)
    cells = [cell for group in groups for cell in group]
    assert len(groups) == 3 * 2 * 2 and len(cells) == 3 * 2 * 2 + 2
    pairs = [group for group in groups if len(group) == 2]
    assert {far.scheduling for _, far in pairs} == {"per-request", "staggered"}
    for near, far in pairs:  # served in turn: the latency twin of the cell without latency
        assert far.latency_s and far == dataclasses.replace(near, latency_s=far.latency_s)
        assert far.draft_len == 30 and far.num_drafters == 1
    assert len({cell.name for cell in cells}) == len(cells)


def test_auto_is_served_in_turn_with_the_cells_it_is_held_to():
    spec = remote_prefix.stream_spec(_args("--draft-lens", "8,30", "--drafters", "1,2"))
    for workload in (FEW, MANY):
        groups = auto_groups(spec, workload)
        assert len(groups) == 2  # one per drafter count
        for drafters, group in zip((1, 2), groups):
            assert {cell.num_drafters for cell in group} == {drafters}
            assert {cell.workload for cell in group} == {workload}
            assert group[0].mode == "full_both"  # FULL_BOTH once, before the cells set against it
            autos = [cell.draft_len for cell in group if cell.mode == "auto"]
            warm = [cell.draft_len for cell in group if cell.mode == "vericache"]
            assert autos == [8, 30] and warm == ([8, 30] if workload == MANY else [])
    # The many-prefix stream's pools FULL_BOTH routes by come first, each alone.
    assert [c.name for c in many_prefix_full_cells(spec)] == [
        f"{MANY}: full_local d=1", f"{MANY}: full_remote d=1", f"{MANY}: full_remote d=2",
    ]  # fmt: skip


def test_a_steered_twin_of_the_headline_is_served_and_set_against_it():
    spec = remote_prefix.stream_spec(_args("--steer-every", "4"))
    (group,) = [g for g in vericache_cells(spec) if any(c.steer_every for c in g)]
    headline, *_, steered = group  # in turn with the headline cell (and its latency twin)
    assert steered == dataclasses.replace(headline, steer_every=4)
    assert steered.name == "vericache x=30 d=1 per-request steer=4"
    plain = _cell(headline, 20, 30)
    twin = _cell(steered, 22, 27)
    for cell, (link_bytes, accepted) in ((plain, (100, 20.0)), (twin, (150, 22.0))):
        for sample in cell["samples"]:
            sample |= {"link_bytes": link_bytes, "mean_accepted_per_round": accepted}
    summary = summarize([*_table()[:5], plain, twin], spec)
    assert summary["steered_over_unsteered"] == pytest.approx((1.1 + 0.9) / 2)
    assert summary["steering_link_bytes_per_token"] == {"unsteered": 10, "steered": 15}
    assert summary["steering_accepted_per_round"] == {"unsteered": 20.0, "steered": 22.0}
    assert "steered_over_unsteered" not in summarize(_table(), remote_prefix.stream_spec(_args()))


def test_streams_that_share_a_prefix_are_refused():
    # A text registered twice is one prefix: its second stream would measure no full-KV bytes.
    remote_prefix._check_disjoint({FEW: [{"prefix_id": "a"}], MANY: [{"prefix_id": "b"}]})
    with pytest.raises(InvalidRequestError, match="share a prefix"):
        remote_prefix._check_disjoint({FEW: [{"prefix_id": "a"}], MANY: [{"prefix_id": "a"}]})


def test_the_stream_cycles_over_prefixes_then_prompts():
    jobs = request_stream(["a", "b"], 5)
    assert [prefix for prefix, _ in jobs] == ["a", "b", "a", "b", "a"]
    assert [prompt for _, prompt in jobs] == [CONTEXT_PROMPTS[i] for i in (0, 0, 1, 1, 2)]


def test_the_link_makes_the_full_kv_transfer_take_ratio_replies():
    assert remote_prefix.bandwidth_for(0.5, 80e6, 4.0) == pytest.approx(40e6)
    assert 80e6 / remote_prefix.bandwidth_for(2.0, 80e6, 4.0) == pytest.approx(8.0)
    with pytest.raises(InvalidRequestError):
        remote_prefix.bandwidth_for(1.0, 0, 4.0)


def test_the_router_fills_each_pool_in_proportion_to_its_throughput():
    pools = [RoutedPool("full_local", 10.0), RoutedPool("full_remote", 30.0, prefix_capacity=1)]
    router = Router(pools, {"a": 0.0}, num_tokens=10)
    chosen = [router.acquire("a") for _ in range(8)]
    assert chosen.count("full_remote") == 6 and chosen.count("full_local") == 2
    router.release("full_remote")
    assert router.acquire("a") == "full_remote"


def test_the_router_counts_the_fetch_of_a_prefix_the_drafters_lack():
    """The drafters hold one prefix at a time: a request on another goes to the verifier, whose
    store holds them all, until the verifier's queue costs more than crossing the link."""
    pools = [RoutedPool("full_local", 10.0), RoutedPool("full_remote", 10.0, prefix_capacity=1)]
    router = Router(pools, {"a": 5.0, "b": 5.0}, num_tokens=10)  # a fetch: 5 requests' time
    assert router.acquire("a") == "full_local"  # equal queues: the fetch decides
    assert [router.acquire("b") for _ in range(5)] == ["full_local"] * 5
    assert router.acquire("b") == "full_remote"  # 7 s of queue against 5 s of fetch + 1 s
    assert router.acquire("b") == "full_remote"  # b is held there now: no fetch
    assert router.acquire("a") == "full_local"  # a would push b out, and wait for its fetch


def _result(token_ids, accepted=(), link_bytes=0) -> Result:
    stats = dict(
        link_bytes=link_bytes, store_bytes=10, link_wait_s=0.5, store_wait_s=0.1, ttft_s=0.2,
        total_s=1.0,
        rounds=len(accepted) or len(token_ids), accepted_per_round=list(accepted),
    )  # fmt: skip
    return Result("", list(token_ids), "length", stats)


def test_a_stream_record_sums_its_requests():
    results = [_result([1, 2, 3], [2, 0], 100), _result([4, 5], [1], 50)]
    record = stream_record(2.0, results)
    assert record["tokens_per_s"] == pytest.approx(2.5)
    assert record["link_bytes"] == 150 and record["rounds"] == 3
    assert record["mean_accepted_per_round"] == pytest.approx(1.0)
    assert stream_record(1.0, [_result([1])])["mean_accepted_per_round"] is None


def _cell(
    cell: Cell, *rates: float, calls=0, rounds=1, cpu=1.0, match=True, reference=0.1, cpus=()
) -> dict:
    """A cell's record; a VERICACHE cell without latency has its reference (CPU s per token), as
    the benchmark measures it beside the samples. `cpus`: each sample's verifier CPU s."""
    samples = [
        {"tokens_per_s": r, "round_calls": calls, "verified_rounds": rounds, "num_tokens": 10,
         "cpu_s": {"verifiers": c}, "verifiers_forward_cpu_s": 0.75 * c}
        for r, c in zip(rates, cpus or [cpu] * len(rates))
    ]  # fmt: skip
    record = cell_record(cell, samples) | {"outputs_match": match}
    if cell.mode == "vericache" and not cell.latency_s:
        record["reference"] = {
            "draft_len": cell.draft_len, "cpu_s_per_token": reference,
            "suffix_prefill_cpu_s": 0.5, "parts_cpu_s_per_token": [reference, 1.5 * reference],
        }  # fmt: skip
        record["reference_outputs_match"] = [match] * len(samples)
    return record


def _table(vericache_per_request=30.0, full_both=20.0, match=True) -> list[dict]:
    return [
        _cell(Cell("full_local", 1), 15, 16, 14),
        _cell(Cell("full_remote", 1), 10),
        _cell(Cell("full_both", 1), full_both),
        _cell(Cell("full_remote", 2), 12),
        _cell(Cell("full_both", 2), 25),
        _cell(Cell("vericache", 1, 30), vericache_per_request, calls=20, rounds=10, cpu=2.0),
        _cell(Cell("vericache", 1, 30, "staggered"), 24, calls=18, rounds=10, match=match),
        _cell(Cell("vericache", 2, 30), 50, calls=19, rounds=10),
        _cell(Cell("vericache", 1, 30, latency_s=0.02), 27, calls=20, rounds=10),
        _cell(Cell("vericache", 1, 30, "staggered", 0.02), 18, calls=20, rounds=10),
    ]


def test_a_cells_samples_together_are_set_against_its_reference():
    spec = remote_prefix.stream_spec(_args("--draft-lens", "30"))
    drifting = _cell(Cell("vericache", 1, 30), 1, 2, 3, cpus=(1.0, 2.0, 3.0), reference=0.1)
    summary = summarize([*_table()[:5], drifting], spec)
    # 6 CPU s over 30 tokens: 0.2 s/token, against the reference's 0.1.
    assert summary["verifier_overhead"] == pytest.approx(2.0)
    assert summary["reference_cpu_s_per_token_range"] == {"30": pytest.approx([0.1, 0.15])}
    disagreeing = _cell(Cell("vericache", 1, 30), 1, 2, cpu=2.0)
    disagreeing["reference_outputs_match"] = [True, False]
    assert not summarize([*_table()[:5], disagreeing], spec)["identical"]


def test_latency_is_set_against_the_sample_served_just_before_it():
    spec = remote_prefix.stream_spec(_args("--draft-lens", "30", "--schedulings", "per-request"))
    near = _cell(Cell("vericache", 1, 30), 40, 20, 30)  # the machine slowed down, then recovered
    far = _cell(Cell("vericache", 1, 30, latency_s=0.02), 36, 19, 24)
    summary = summarize([*_table()[:5], near, far], spec)
    assert summary["rtt20_over_rtt0"] == pytest.approx(0.9)  # 0.9, 0.95, 0.8: the median


def test_the_summary_compares_with_the_best_full_kv_configuration_on_the_same_workers():
    spec = remote_prefix.stream_spec(_args("--draft-lens", "30"))
    summary = summarize(_table(), spec)
    assert summary["headline_cell"] == "vericache x=30 d=1 per-request"
    assert summary["vericache_over_best_full"] == pytest.approx(30 / 20)  # over FULL_BOTH
    assert summary["vericache_over_best_full_by_cell"]["vericache x=30 d=2 per-request"] == (
        pytest.approx(2.0)  # over the two-drafter FULL_BOTH, not the one-drafter one
    )
    assert summary["best_full_tokens_per_s"] == {1: 20, 2: 25}
    assert summary["rpcs_per_round"] == pytest.approx(2.0)
    assert summary["rtt20_over_rtt0"] == pytest.approx(18 / 24)  # the lower scheduling
    assert summary["verifier_overhead"] == pytest.approx(0.2 / 0.1)
    serving = summary["verifier_serving_overhead_by_cell"]
    assert serving["vericache x=30 d=1 per-request"] == pytest.approx(2.0 / (1.5 + 0.5))
    assert serving["vericache x=30 d=2 per-request"] == pytest.approx(1.0 / (0.75 + 0.5))
    assert summary["identical"] is True
    assert summary["meets_targets"] == {
        "rpcs_per_round": True, "rtt20_over_rtt0": False, "verifier_overhead": False,
        "auto_over_best_full_many_prefixes": False, "auto_over_best_everywhere": False,
    }  # fmt: skip
    assert summary["auto_over_best_everywhere"] is None  # no AUTO cell in this table
    # FULL_LOCAL the best: one full-KV cell beats the others on the same workers.
    slow_both = summarize(_table(full_both=5), spec)
    assert slow_both["vericache_over_best_full"] == pytest.approx(30 / 15)


def test_auto_is_set_against_the_better_of_vericache_and_full_kv_in_its_own_stream():
    spec = remote_prefix.stream_spec(_args("--draft-lens", "30"))
    many = [
        _cell(Cell("full_local", 1, workload=MANY), 10),
        _cell(Cell("full_remote", 1, workload=MANY), 12),
        _cell(Cell("full_both", 1, workload=MANY), 16),
        _cell(Cell("vericache", 1, 30, workload=MANY), 20),
        _cell(Cell("auto", 1, 30, workload=MANY), 24),
    ]
    few_auto = _cell(Cell("auto", 1, 30), 27)  # the few-prefix stream: VERICACHE there is 30
    few_auto["samples"][0]["paths"] = {"vericache": 3, "full_local": 1}
    summary = summarize([*_table(), few_auto, *many], spec)
    assert summary["auto_over_best_full_many_prefixes"] == pytest.approx(24 / 16)
    assert summary["vericache_over_best_full_many_prefixes_by_cell"] == {
        "many-prefixes: vericache x=30 d=1 per-request": pytest.approx(20 / 16)
    }
    assert summary["auto_over_best_by_cell"] == {
        "auto x=30 d=1": pytest.approx(27 / 30),
        "many-prefixes: auto x=30 d=1": pytest.approx(24 / 20),
    }
    assert summary["auto_over_best_everywhere"] == pytest.approx(0.9)
    assert summary["auto_paths"]["auto x=30 d=1"] == {"vericache": 3, "full_local": 1}
    targets = summary["meets_targets"]
    assert targets["auto_over_best_full_many_prefixes"] and not targets["auto_over_best_everywhere"]
    # The many-prefix stream's cells leave the few-prefix comparisons as they were.
    assert summary["vericache_over_best_full"] == pytest.approx(30 / 20)


class _Reference:
    """The in-process reference's stand-in over a stream of three requests: records the parts it
    was asked for, each request's output is (its index,), each part's CPU s per token 0.1."""

    def __init__(self):
        self.asked = []

    def measure(self, draft_len, part=0, parts=1):
        self.asked.append((draft_len, part, parts))
        outputs = tuple((i, (i,)) for i in range(part, 3, parts))
        return ReferenceRun(draft_len, 0.1 * len(outputs), 0.0, len(outputs), outputs)


def test_a_cells_reference_is_measured_in_parts_beside_its_samples(monkeypatch, tmp_path):
    spec = remote_prefix.stream_spec(_args("--draft-lens", "8", "--repeats", "3"))
    stream = remote_prefix.Stream([], [], 0)
    bench = remote_prefix.Bench("m", tmp_path, spec, {FEW: stream}, reference=_Reference())
    order = []
    served = iter([[[0], [1], [2]], [[0], [9], [2]], [[0], [1], [2]]] * 2)  # one went wrong

    def serve_once(cell):
        order.append(cell.latency_s)
        return {"tokens_per_s": 1.0}, next(served)

    monkeypatch.setattr(bench, "_serve_once", serve_once)
    near, far = Cell("vericache", 1, 8), Cell("vericache", 1, 8, latency_s=0.02)
    (record, outputs), (far_record, _) = bench.serve(near, far)
    assert order == [0.0, 0.02] * 3  # the pair in turn, sample by sample
    assert bench.reference.asked == [(8, 0, 3), (8, 1, 3), (8, 2, 3)]  # the latency twin: none
    assert record["reference"]["cpu_s_per_token"] == pytest.approx(0.1)
    assert record["reference"]["parts_cpu_s_per_token"] == pytest.approx([0.1] * 3)
    assert record["reference_outputs_match"] == [True, True, False]
    assert outputs[2] == [[0], [9], [2]] and "reference" not in far_record


def test_one_mismatched_cell_is_not_identical():
    spec = remote_prefix.stream_spec(_args("--draft-lens", "30"))
    assert not summarize(_table(match=False), spec)["identical"]


def test_a_cell_reports_its_median_and_spread(tmp_path):
    record = _cell(Cell("full_local", 1), 15, 16, 14)
    assert record["tokens_per_s"] == 15 and record["tokens_per_s_min"] == 14
    assert record["tokens_per_s_max"] == 16 and record["name"] == "full_local d=1"
    spec = remote_prefix.stream_spec(_args("--draft-lens", "30"))
    cells = [*_table(), _cell(Cell("auto", 1, 30), 17)]
    result = {  # as the run holds it, before JSON turns the drafter counts into strings
        "cells": cells,
        "summary": summarize(cells, spec),
        "config": {"num_requests": 4, "num_prefixes": 2, "concurrency": 2, "max_tokens": 8,
                   "compressor": "c", "repeats": 3},
        "bandwidth_bytes_per_s": 5e6,
    }  # fmt: skip
    path = tmp_path / "remote_prefix.png"
    remote_prefix.plot(result, path)
    assert path.stat().st_size > 1000


@pytest.mark.slow
@pytest.mark.ray
def test_a_tiny_run_end_to_end(tiny_chat_checkpoint, ray_cluster):
    args = _args(
        "--quick", "--model", str(tiny_chat_checkpoint), "--prefix-tokens", "150,300",
        "--requests", "2", "--max-tokens", "6", "--draft-lens", "4",
        "--schedulings", "per-request,staggered", "--rtt-latency-ms", "0", "--many-prefixes",
        "3", "--many-prefix-tokens", "320,400", "--many-requests", "3",
    )  # fmt: skip
    result = remote_prefix.run(args)
    summary = result["summary"]
    assert summary["identical"] is True
    # A draft call and a verifier call, which carries a staggered round's load too; a round the
    # budget leaves no draft makes no draft call.
    calls = summary["rpcs_per_round_by_scheduling"]
    assert 1.5 <= calls["per-request"] <= 2.0
    assert 1.5 <= calls["staggered"] <= 2.0
    assert summary["rpcs_per_round"] == max(calls.values())
    names = {cell["name"] for cell in result["cells"]}
    assert {"full_local d=1", "full_remote d=1", "full_both d=1"} <= names
    assert {"vericache x=4 d=1 per-request", "vericache x=4 d=1 staggered"} <= names
    assert not [cell for cell in result["cells"] if cell["latency_s"]]  # the latency pair: off
    full_remote = next(c for c in result["cells"] if c["name"] == "full_remote d=1")
    assert full_remote["samples"][0]["link_bytes"] > 0
    # Each role's forwards, counted by its workers: full_remote's are the drafter's alone.
    counted = full_remote["samples"][0]
    assert counted["verifiers_forwards"] == 0 < counted["drafters_forwards"]
    assert counted["drafters_forwards"] <= counted["drafters_forward_rows"]
    assert summary["verifier_overhead"] > 0
    # The many-prefix stream: behind a host tier, its full KV crosses the link once per prefix.
    assert {"many-prefixes: auto x=4 d=1", "many-prefixes: full_both d=1"} <= names
    assert summary["auto_over_best_everywhere"] > 0
    assert summary["auto_over_best_full_many_prefixes"] is None  # the headline is x=30
    assert sum(summary["auto_paths"]["many-prefixes: auto x=4 d=1"].values()) == 3
    budgets = result["many_prefix_budgets"]
    assert budgets["host_tier_bytes"] > 3 * budgets["drafter_kv_bytes"] / 2
