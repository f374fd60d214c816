"""`vericache sim --scenario FILE`: a scenario file simulated, and bad files refused clearly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from vericache.cli.main import main
from vericache.errors import InvalidRequestError
from vericache.sim.scenario import build_long_context, load_scenario, run_scenario

SCENARIOS = Path(__file__).parents[1] / "bench" / "scenarios"
EXAMPLE = SCENARIOS / "pipeline1_llama70b.yaml"

SMALL = {
    "pipeline": "long-context", "model": "qwen2.5-32b", "device": "h100-sxm",
    "prompt_tokens": 16384, "kv_budget": 0.2, "draft_len": 16, "scheduler": "staggered",
    "requests": {"count": 6, "rate_per_s": 2.0}, "output_tokens": [32, 64],
    "acceptance": {"mean_accepted": 12, "at_draft_len": 16}, "seed": 1,
}  # fmt: skip


def _write(tmp_path, data) -> Path:
    path = tmp_path / "scenario.yaml"
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


def test_the_example_scenario_runs_from_the_command_line(capsys):
    assert main(["sim", "--scenario", str(EXAMPLE), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["vericache"]["num_output_tokens"] == result["full_kv"]["num_output_tokens"]
    assert result["speedup"] == pytest.approx(
        result["vericache"]["tokens_per_s"] / result["full_kv"]["tokens_per_s"]
    )
    assert result["sources"]["device"].startswith("datasheet")
    assert result["sources"]["acceptance"].startswith("published")


def test_both_schedulers_and_a_recorded_trace_run(tmp_path):
    staggered = run_scenario(load_scenario(_write(tmp_path, SMALL)))
    lockstep = run_scenario({**SMALL, "scheduler": "lockstep"})
    traced = run_scenario({**SMALL, "acceptance": {"first_mismatch": [3, 16, 9, 0]}})
    assert staggered["full_kv"] == lockstep["full_kv"]  # the baseline has no scheduler
    assert staggered["vericache"] != lockstep["vericache"]
    assert traced["sources"]["acceptance"].startswith("measured")
    assert 0 < traced["vericache"]["mean_accepted_per_round"] <= 16


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"colour": "blue"}, "unknown scenario fields for long-context: \\['colour'\\]"),
        ({"drafters": 4}, "unknown scenario fields for long-context: \\['drafters'\\]"),
        ({"requests": {"count": 2, "burst": 3}}, "unknown fields of 'requests'"),
        ({"prompt_tokens": "many"}, "'prompt_tokens' must be an integer"),
        ({"kv_budget": "half"}, "wrong type"),
        ({"kv_budget": 1.5}, "kv_budget"),
        ({"scheduler": "fifo"}, "staggered or lockstep"),
        ({"pipeline": "remote"}, "pipeline must be long-context or remote-prefix"),
        ({"model": "gpt-5"}, "no model profile"),
        ({"acceptance": 0.9}, "'acceptance' must be a mapping"),
    ],
)
def test_a_bad_field_is_refused_with_its_name(change, message):
    with pytest.raises(InvalidRequestError, match=message):
        run_scenario({**SMALL, **change})


def test_a_missing_field_or_a_broken_file_is_refused(tmp_path, capsys):
    without_model = {k: v for k, v in SMALL.items() if k != "model"}
    with pytest.raises(InvalidRequestError, match="lacks the field 'model'"):
        run_scenario(without_model)
    for text in ("{unclosed: [", "- a list"):
        path = _write(tmp_path, text)
        assert main(["sim", "--scenario", str(path)]) == 2
        assert "vericache: error:" in capsys.readouterr().err
    assert main(["sim", "--scenario", str(tmp_path / "absent.yaml")]) == 2


REMOTE = {
    "pipeline": "remote-prefix", "model": "qwen2.5-32b", "device": "h100-sxm", "verifiers": 1,
    "drafters": 2, "prefix_tokens": 8192, "prefixes": 3, "suffix_tokens": 64,
    "compressed_ratio": 0.27, "store_gb_per_s": 40, "network_gb_per_s": 1.2,
    "network_latency_ms": 10, "draft_len": 16, "requests": {"count": 6}, "output_tokens": [48],
    "acceptance": {"mean_accepted": 12, "at_draft_len": 16}, "seed": 2,
}  # fmt: skip


def test_a_remote_prefix_scenario_is_set_against_the_best_full_kv_configuration(capsys):
    result = run_scenario(REMOTE)
    assert result["baselines"] == ["full_local", "full_remote", "full_both"]
    rates = {name: result[name]["tokens_per_s"] for name in ["vericache", *result["baselines"]]}
    assert result["speedup"] == pytest.approx(
        rates["vericache"] / max(rates[name] for name in result["baselines"])
    )
    assert {result[name]["num_output_tokens"] for name in rates} == {6 * 48}
    assert main(["sim", "--scenario", str(SCENARIOS / "pipeline2_qwen32b.yaml")]) == 0
    printed = capsys.readouterr().out
    assert "full_both:" in printed and "best full-KV configuration" in printed


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"kv_budget": 0.2}, "unknown scenario fields for remote-prefix: \\['kv_budget'\\]"),
        ({"drafters": 0}, "needs workers"),
        ({"network_gb_per_s": "fast"}, "wrong type"),
        ({"compressed_ratio": 2}, "compressed_ratio"),
        ({"prefix_tokens": 40000}, "context of 32768"),
        ({"scheduling": "round-robin"}, "per-request, staggered or lockstep"),
        ({"prefix_caching": "no"}, "'prefix_caching' must be true or false"),
        ({"requests": {"count": 4, "concurrency": 2, "rate_per_s": 1}}, "not both"),
        ({"dtype": "int3"}, "dtype must be one of"),
    ],
)
def test_a_bad_remote_prefix_field_is_refused(change, message):
    with pytest.raises(InvalidRequestError, match=message):
        run_scenario({**REMOTE, **change})


def test_a_remote_prefix_scenario_lacking_a_field_names_it():
    with pytest.raises(InvalidRequestError, match="lacks the field 'store_gb_per_s'"):
        run_scenario({k: v for k, v in REMOTE.items() if k != "store_gb_per_s"})


def test_a_remote_prefix_scenario_runs_with_each_scheduling():
    results = {
        name: run_scenario({**REMOTE, "scheduling": name})
        for name in ("per-request", "staggered", "lockstep")
    }
    tokens = {name: r["vericache"]["num_output_tokens"] for name, r in results.items()}
    assert set(tokens.values()) == {6 * 48}
    assert results["staggered"]["vericache"] != results["per-request"]["vericache"]
    assert results["staggered"]["full_local"] == results["per-request"]["full_local"]


def test_a_model_too_big_for_one_device_per_worker_needs_tensor_parallelism():
    llama = {**REMOTE, "model": "llama-3.1-70b", "device": "h100-sxm"}
    with pytest.raises(InvalidRequestError, match="raise tensor_parallel"):
        run_scenario(llama)
    result = run_scenario({**llama, "tensor_parallel": 2})
    assert result["vericache"]["num_output_tokens"] == 6 * 48


def test_acceptance_from_a_bench_acceptance_result(tmp_path):
    records = [
        {"kind": "code", "compressor": "kivi-4bit", "draft_kv": "verifier",
         "first_mismatch": [12, 64, 30]},
        {"kind": "code", "compressor": "kivi-4bit", "draft_kv": "verifier", "first_mismatch": [5]},
        {"kind": "tools", "compressor": "kivi-4bit", "draft_kv": "verifier", "first_mismatch": [0]},
    ]  # fmt: skip
    path = tmp_path / "acceptance.json"
    path.write_text(json.dumps({"records": records, "config": {"model": "smollm2-135m"}}))
    spec = {"bench": str(path), "kind": "code", "compressor": "kivi-4bit"}
    result = run_scenario({**SMALL, "acceptance": spec})
    source = result["sources"]["acceptance"]
    assert source.startswith("measured: bench acceptance, code prompts, kivi-4bit, smollm2-135m")
    assert "4 rounds over 2 prompts" in source
    assert 0 < result["vericache"]["mean_accepted_per_round"] <= 16
    with pytest.raises(InvalidRequestError, match="no first-mismatch rounds of math"):
        run_scenario({**SMALL, "acceptance": {**spec, "kind": "math"}})


def test_the_timeline_follows_the_run_and_plots(tmp_path, capsys):
    result = run_scenario(REMOTE)
    for name in ("vericache", *result["baselines"]):
        timeline = result[name]["timeline"]
        assert timeline["output_tokens"][-1] == result[name]["num_output_tokens"]
        assert timeline["t_s"] == sorted(timeline["t_s"])
        assert len(timeline["t_s"]) <= 201
        assert min(timeline["kv_bytes"]) >= 0 and max(timeline["kv_bytes"]) > 0
    path = tmp_path / "timeline.png"
    example = SCENARIOS / "pipeline1_llama70b.yaml"
    assert main(["sim", "--scenario", str(example), "--plot", str(path)]) == 0
    assert path.stat().st_size > 1000


def test_adaptive_draft_lengths_run_on_the_staggered_scheduler_only():
    adaptive = run_scenario({**SMALL, "adaptive_draft_len": True})
    assert (
        adaptive["vericache"]["num_output_tokens"]
        == run_scenario(SMALL)["vericache"]["num_output_tokens"]
    )
    with pytest.raises(InvalidRequestError, match="needs the staggered scheduler"):
        run_scenario({**SMALL, "adaptive_draft_len": True, "scheduler": "lockstep"})


def test_a_closed_loop_is_for_remote_prefix_scenarios():
    closed = run_scenario({**REMOTE, "requests": {"count": 6, "concurrency": 2}})
    assert closed["vericache"]["num_output_tokens"] == 6 * 48
    with pytest.raises(InvalidRequestError, match="closed loop"):
        run_scenario({**SMALL, "requests": {"count": 6, "concurrency": 2}})


def test_float32_doubles_what_the_weights_and_the_kv_cost():
    h200 = {**REMOTE, "model": "mistral-small-24b", "device": "h200"}  # 94 GB in float32
    half = run_scenario(h200)
    full = run_scenario({**h200, "dtype": "float32"})
    assert full["full_local"]["tokens_per_s"] < 0.7 * half["full_local"]["tokens_per_s"]
    assert full["full_local"]["peak_kv_bytes"] == 2 * half["full_local"]["peak_kv_bytes"]


def test_prefix_budgets_are_scenario_fields_and_the_keys_of_copies_per_session_are_refused():
    """Each role's workers hold the prefixes they share within a budget where the file sets one
    (VerifierConfig.prefix_cache_bytes, DrafterConfig.kv_cache_bytes): with room for one prefix
    in turn with others, a worker fetches again what it evicted."""
    h200 = {**REMOTE, "device": "h200", "prefixes_in_turn": True}  # room for every prefix
    roomy = run_scenario(h200)
    budgets = {"verifier_prefix_cache_gb": 2.5, "drafter_prefix_cache_gb": 2.5}  # for one
    tight = run_scenario({**h200, **budgets})
    for name in ("full_local", "full_remote"):
        assert tight[name]["num_output_tokens"] == roomy[name]["num_output_tokens"]
        assert tight[name]["link_bytes"] > roomy[name]["link_bytes"]
    with pytest.raises(InvalidRequestError, match="must be >= 1"):
        run_scenario({**REMOTE, "drafter_prefix_cache_gb": 0})
    for removed in ("verifier_prefix_lru_gb", "drafter_prefix_lru_gb"):
        with pytest.raises(InvalidRequestError, match=f"unknown scenario fields.*'{removed}'"):
            run_scenario({**REMOTE, removed: 1})


def test_a_narrow_compressed_dtype_is_a_scenario_field():
    narrow = build_long_context({**SMALL, "compressed_dtype": "fp8"})
    wide = build_long_context(SMALL)
    assert 2 * narrow.compressed_kv_bytes(0) == wide.compressed_kv_bytes(0)
    assert narrow.full_kv_bytes(0) == wide.full_kv_bytes(0)
    with pytest.raises(InvalidRequestError, match="compressed_dtype must be one of"):
        run_scenario({**SMALL, "compressed_dtype": "int3"})
