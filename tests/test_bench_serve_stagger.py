"""The serve-stagger benchmark's plumbing without a server: its settings, the summary of three
policies' runs (ratios, peak residency in full KVs, exactness) and the plot."""

from __future__ import annotations

import pytest

from vericache.bench import serve_stagger
from vericache.cli.bench import parse_benchmark_args


def _setup(*argv: str) -> serve_stagger.Setup:
    module, args = parse_benchmark_args("serve-stagger", list(argv))
    assert module is serve_stagger
    return serve_stagger.setup(args)


def test_quick_shrinks_the_stream_and_explicit_values_win():
    quick, full = _setup("--quick"), _setup()
    assert quick.num_requests < full.num_requests and quick.max_tokens < full.max_tokens
    assert full.draft_len == 16 and full.resident_full_kvs == 2.0
    assert _setup("--quick", "--requests", "6").num_requests == 6


def _runs(per_request=10.0, lockstep=12.0, staggered=15.0) -> dict:
    rates = {"per-request": per_request, "lockstep": lockstep, "staggered": staggered}
    peaks = {"per-request": 350, "lockstep": 200, "staggered": 210}
    return {
        policy: {"tokens_per_s": rate, "peak_resident_bytes": peaks[policy]}
        for policy, rate in rates.items()
    }


def test_the_summary_compares_staggered_with_both_baselines():
    outputs = {policy: [[1, 2], [3]] for policy in serve_stagger.POLICIES}
    summary = serve_stagger._summary(_runs(), outputs, [[1, 2], [3]], 100, 2e8)
    assert summary["staggered_over_lockstep"] == pytest.approx(1.25)
    assert summary["staggered_over_per_request"] == pytest.approx(1.5)
    assert summary["peak_resident_full_kvs"]["per-request"] == pytest.approx(3.5)
    assert summary["identical"] and summary["load_bandwidth_mb_s"] == pytest.approx(200)


def test_one_differing_output_is_not_identical():
    outputs = {policy: [[1, 2], [3]] for policy in serve_stagger.POLICIES}
    outputs["lockstep"] = [[1, 2], [4]]
    assert not serve_stagger._summary(_runs(), outputs, [[1, 2], [3]], 100, 2e8)["identical"]


def test_the_plot_is_written(tmp_path):
    outputs = {policy: [[1]] for policy in serve_stagger.POLICIES}
    result = {
        "summary": serve_stagger._summary(_runs(), outputs, [[1]], 100, 2e8),
        "config": {
            "resident_full_kvs": 2.0, "num_requests": 8, "num_prefixes": 2, "max_tokens": 96,
            "compressor": "streamingllm-4x", "draft_len": 30,
        },
    }  # fmt: skip
    path = tmp_path / "serve_stagger.png"
    serve_stagger.plot(result, path)
    assert path.stat().st_size > 10_000
