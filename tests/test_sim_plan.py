"""`vericache plan`: every candidate simulated, the fastest within the latency bound recommended,
set against the best full-KV configuration on the same GPUs; bad input refused."""

from __future__ import annotations

import json

import pytest
import yaml

from vericache.cli.main import main
from vericache.errors import InvalidRequestError
from vericache.sim.plan import Hardware, plan

WORKLOAD = {
    "prefix_tokens": 8192, "prefixes": 2, "suffix_tokens": 64, "output_tokens": [64],
    "requests": {"count": 6, "rate_per_s": 8}, "seed": 1,
    "compressors": {
        "kivi-4bit": {"compressed_ratio": 0.27,
                      "acceptance": {"mean_accepted": 19, "at_draft_len": 30}},
        "kivi-2bit": {"compressed_ratio": 0.15,
                      "acceptance": {"mean_accepted": 9, "at_draft_len": 30}},
    },
}  # fmt: skip
HARDWARE = Hardware("h200", local_gpus=2, remote_gpus=2, store_gb_per_s=40, network_gb_per_s=1.2)


def test_every_candidate_is_simulated_and_the_fastest_recommended():
    result = plan("qwen2.5-32b", HARDWARE, WORKLOAD, draft_lens=(4, 16))
    candidates = result["candidates"]
    assert len(candidates) == 2 * 2 * 2 * 2  # compressors x verifiers x draft lengths x schedulings
    assert {c["num_verifiers"] for c in candidates} == {1, 2}
    assert all(c["num_drafters"] == 2 for c in candidates)
    best = result["recommended"]
    assert best["tokens_per_s"] == max(c["tokens_per_s"] for c in candidates)
    assert set(result["baselines"]) == {"full_local", "full_remote", "full_both"}
    assert best["speedup"] == pytest.approx(
        best["tokens_per_s"] / result["best_full_kv_tokens_per_s"]
    )
    assert result["best_full_kv_tokens_per_s"] == max(
        b["tokens_per_s"] for b in result["baselines"].values()
    )
    assert result["sources"]["device"].startswith("datasheet")


def test_a_latency_bound_excludes_slower_candidates():
    unbounded = plan("qwen2.5-32b", HARDWARE, WORKLOAD, draft_lens=(4, 16))
    p99s = sorted(c["p99_latency_s"] for c in unbounded["candidates"])
    bound = p99s[len(p99s) // 2]
    bounded = plan("qwen2.5-32b", HARDWARE, WORKLOAD, (4, 16), max_p99_latency_s=bound)
    assert bounded["recommended"]["p99_latency_s"] <= bound
    assert plan("qwen2.5-32b", HARDWARE, WORKLOAD, (4,), 1e-6)["recommended"] is None


@pytest.mark.parametrize(
    ("workload", "message"),
    [
        ({**WORKLOAD, "colour": 1}, "unknown workload fields"),
        ({**WORKLOAD, "compressors": {}}, "names its compressors"),
        (
            {**WORKLOAD, "compressors": {"kivi": {"compressed_ratio": 0.3}}},
            "needs compressed_ratio",
        ),
    ],
)
def test_a_bad_workload_is_refused(workload, message):
    with pytest.raises(InvalidRequestError, match=message):
        plan("qwen2.5-32b", HARDWARE, workload)


def test_hardware_must_form_whole_workers():
    with pytest.raises(InvalidRequestError, match="multiples"):
        Hardware("h100-sxm", 3, 4, 40, 1.2, tensor_parallel=2)
    with pytest.raises(InvalidRequestError, match="at least one worker"):
        Hardware("h100-sxm", 0, 4, 40, 1.2)


def test_the_command_line_prints_a_recommendation_and_json(tmp_path, capsys):
    path = tmp_path / "workload.yaml"
    path.write_text(yaml.safe_dump(WORKLOAD))
    argv = [
        "plan", "--model", "qwen2.5-32b", "--hardware", "h200", "--local-gpus", "1",
        "--remote-gpus", "2", "--local-link", "40", "--remote-link", "1.2", "--latency-ms", "10",
        "--workload", str(path), "--draft-lens", "8",
    ]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "recommended: kivi-" in printed and "full_both:" in printed
    assert main([*argv, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert len(result["candidates"]) == 2 * 1 * 1 * 2
    assert main([*argv[:-2], "--draft-lens", "0"]) == 2


def test_the_long_context_plan_tries_adaptive_draft_lengths_and_ranks_by_throughput():
    from vericache.sim.plan import plan_long_context

    data = {
        "pipeline": "long-context", "model": "qwen2.5-32b", "device": "h100-sxm",
        "prompt_tokens": 16384, "kv_budget": 0.2, "draft_len": 16, "requests": {"count": 6},
        "output_tokens": [48], "acceptance": {"mean_accepted": 12, "at_draft_len": 16},
    }  # fmt: skip
    result = plan_long_context(data, (8, 16))
    kinds = {
        (c["draft_len"], c["scheduler"], c["adaptive_draft_len"]) for c in result["candidates"]
    }
    assert kinds == {(x, s, False) for x in (8, 16) for s in ("staggered", "lockstep")} | {
        (8, "staggered", True),
        (16, "staggered", True),
    }
    rates = [c["tokens_per_s"] for c in result["candidates"]]
    assert rates == sorted(rates, reverse=True) and result["recommended"] == result["candidates"][0]
    with pytest.raises(InvalidRequestError, match="at_draft_len"):
        plan_long_context({**data, "acceptance": {"mean_accepted": 12}}, (8,))
