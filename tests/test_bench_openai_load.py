"""`vericache bench openai-load` end to end on the tiny chat model: concurrent streaming clients on
the HTTP API, the same text in both configurations, and the shared system turn registered by
itself and then found."""

from __future__ import annotations

import pytest

from vericache.bench import openai_load
from vericache.cli.bench import parse_benchmark_args


@pytest.mark.slow
@pytest.mark.ray
def test_a_tiny_load_end_to_end(tiny_chat_checkpoint, ray_cluster, tmp_path):
    module, args = parse_benchmark_args(
        "openai-load",
        # Enough decoding after the first two requests for the background registration of their
        # system turn to finish under a loaded machine (the whole suite on two cores).
        ["--quick", "--model", str(tiny_chat_checkpoint), "--clients", "2", "--requests", "4",
         "--max-tokens", "16", "--context-chars", "1500", "--auto-prefix-min-tokens", "16"],
    )  # fmt: skip
    assert module is openai_load
    result = openai_load.run(args)
    summary = result["summary"]
    assert summary["identical"] is True
    vericache, full_local = (result["samples"][name][0] for name in ("vericache", "full_local"))
    assert vericache["requests"] == full_local["requests"] == 8
    assert vericache["output_tokens"] == full_local["output_tokens"] > 0
    # Seen twice, the system turn registered itself; later requests found it.
    assert 0 < vericache["prefix_hit_rate"] < 1
    by = summary["by_configuration"]["vericache"]
    assert by["ttft_p50_s"]["median"] <= by["ttft_p99_s"]["median"]
    assert summary["vericache_over_full_local"]["median"] > 0
    openai_load.plot(result, tmp_path / "load.png")
    assert (tmp_path / "load.png").stat().st_size > 1000
