"""The remote-prefix benchmark's plumbing without a server: the stream, the bandwidths chosen from
the calibration, each point's speedup and exactness, the summary and the plot; and one small end
to end run on Ray (slow)."""

from __future__ import annotations

import pytest

from vericache.bench import remote_prefix
from vericache.bench.workloads import CONTEXT_PROMPTS
from vericache.cli.bench import parse_benchmark_args
from vericache.client import Result
from vericache.errors import InvalidRequestError


def _args(*argv: str):
    module, args = parse_benchmark_args("remote-prefix", list(argv))
    assert module is remote_prefix
    return args


def test_quick_defaults_shrink_the_stream_and_explicit_values_win():
    quick = remote_prefix.stream_spec(_args("--quick"))
    full = remote_prefix.stream_spec(_args())
    assert quick.num_requests < full.num_requests and quick.ratios == (1.0,)
    assert full.ratios == (0.25, 1.0, 4.0) and full.prefix_tokens == (3000, 4000)
    spec = remote_prefix.stream_spec(_args("--requests", "7", "--ratios", "0.5,2", "--quick"))
    assert spec.num_requests == 7 and spec.ratios == (0.5, 2.0)
    assert remote_prefix.stream_spec(_args("--latency-ms", "2")).latency_s == pytest.approx(0.002)
    for bad in (["--ratios", "0"], ["--concurrency", "0"], ["--max-attempts", "0"]):
        with pytest.raises(InvalidRequestError):
            remote_prefix.stream_spec(_args(*bad))


def test_the_stream_cycles_over_prefixes_then_prompts():
    jobs = remote_prefix.request_stream(["a", "b"], 5)
    assert [prefix for prefix, _ in jobs] == ["a", "b", "a", "b", "a"]
    assert [prompt for _, prompt in jobs] == [CONTEXT_PROMPTS[i] for i in (0, 0, 1, 1, 2)]


def test_bandwidths_make_the_full_kv_transfer_take_ratio_replies():
    bandwidths = remote_prefix.bandwidths_for([0.5, 1.0, 4.0], 80e6, seconds_per_reply=4.0)
    assert bandwidths == pytest.approx([40e6, 20e6, 5e6])
    for ratio, bandwidth in zip([0.5, 1.0, 4.0], bandwidths):
        assert 80e6 / bandwidth == pytest.approx(ratio * 4.0)
    with pytest.raises(InvalidRequestError):
        remote_prefix.bandwidths_for([1.0], 0, seconds_per_reply=4.0)


def _result(token_ids, accepted=(), link_bytes=0) -> Result:
    stats = dict(
        link_bytes=link_bytes, store_bytes=10, link_wait_s=0.5, store_wait_s=0.1, ttft_s=0.2,
        total_s=1.0,
        rounds=len(accepted) or len(token_ids), accepted_per_round=list(accepted),
    )  # fmt: skip
    return Result("", list(token_ids), "length", stats)


def test_a_stream_record_sums_its_requests():
    results = [_result([1, 2, 3], [2, 0], 100), _result([4, 5], [1], 50)]
    record = remote_prefix.stream_record(2.0, results)
    assert record["tokens_per_s"] == pytest.approx(2.5)
    assert record["link_bytes"] == 150 and record["rounds"] == 3
    assert record["mean_accepted_per_round"] == pytest.approx(1.0)
    assert remote_prefix.stream_record(1.0, [_result([1])])["mean_accepted_per_round"] is None


def _point(ratio, rates: dict, outputs: dict, reference=((1, 2), (3, 4))):
    runs = {mode: {"tokens_per_s": rate} for mode, rate in rates.items() if mode != "full_local"}
    full_local = {"tokens_per_s": rates["full_local"]}
    reference = [list(ids) for ids in reference]
    outputs = {mode: [list(ids) for ids in out] for mode, out in outputs.items()}
    return remote_prefix.make_point(ratio, 10e6, 20e6, full_local, runs, reference, outputs)


SAME = {"vericache": ((1, 2), (3, 4)), "full_remote": ((1, 2), (3, 4))}


def test_a_point_compares_vericache_with_the_better_full_kv_baseline():
    slow_link = _point(4.0, {"vericache": 30, "full_remote": 5, "full_local": 15}, SAME)
    assert slow_link["vericache_over_best_full"] == pytest.approx(2.0)  # over FULL_LOCAL
    assert slow_link["full_kv_transfer_s"] == pytest.approx(2.0)
    fast_link = _point(0.25, {"vericache": 30, "full_remote": 20, "full_local": 15}, SAME)
    assert fast_link["vericache_over_best_full"] == pytest.approx(1.5)  # over FULL_REMOTE
    assert fast_link["vericache_over_full_local"] == pytest.approx(2.0)
    assert fast_link["identical"] and fast_link["mismatched_requests"] == {
        "vericache": 0,
        "full_remote": 0,
    }


def test_one_differing_request_in_any_mode_is_not_identical():
    rates = {"vericache": 30, "full_remote": 5, "full_local": 15}
    drifted = SAME | {"full_remote": ((1, 2), (3, 5))}
    point = _point(1.0, rates, drifted)
    assert not point["identical"] and point["mismatched_requests"]["full_remote"] == 1
    shorter = SAME | {"vericache": ((1, 2), (3,))}
    assert not _point(1.0, rates, shorter)["identical"]


def test_the_summary_reports_the_point_nearest_the_balanced_ratio(tmp_path):
    rates = {"vericache": 24, "full_remote": 8, "full_local": 15}
    points = [
        _point(0.25, rates | {"full_remote": 14}, SAME),
        _point(0.8, rates, SAME),
        _point(4.0, rates | {"full_remote": 3}, SAME | {"vericache": ((1, 2), (9, 9))}),
    ]
    summary = remote_prefix.summarize(points)
    assert summary["ratio"] == 0.8
    assert summary["vericache_over_best_full"] == pytest.approx(1.6)
    assert summary["meets_target"] is True
    assert summary["identical"] is False  # the slowest link's point differed
    assert summary["vericache_over_best_full_by_ratio"]["0.25"] == pytest.approx(24 / 15)
    config = dict(
        num_requests=4, num_prefixes=2, concurrency=2, max_tokens=8, compressor="c", draft_len=8
    )
    path = tmp_path / "remote_prefix.png"
    remote_prefix.plot({"points": points, "config": config}, path)
    assert path.stat().st_size > 1000


@pytest.mark.slow
def test_a_tiny_run_end_to_end(tiny_chat_checkpoint):
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        pytest.skip("another Ray session is running in this process")
    args = _args(
        "--quick", "--model", str(tiny_chat_checkpoint), "--prefix-tokens", "150,300",
        "--requests", "2", "--max-tokens", "6", "--max-attempts", "1",
    )  # fmt: skip
    result = remote_prefix.run(args)
    assert result["summary"]["identical"] is True
    (point,) = result["points"]
    assert point["ratio"] == 1.0
    assert point["runs"]["full_remote"]["link_bytes"] > 0
    assert result["full_local"]["link_bytes"] == 0
