"""Pipeline 2's scenario files (bench/scenarios): each loads, says where its numbers come from,
and runs against both baselines, scaled down; `mode: auto` runs from a file."""

from __future__ import annotations

from pathlib import Path

import pytest

from vericache.errors import InvalidRequestError
from vericache.sim.remote_prefix_compare import compare_deployments
from vericache.sim.scenario import build_remote_prefix, load_scenario, run_scenario

SCENARIOS = Path(__file__).parents[1] / "bench" / "scenarios"
FILES = (
    "pipeline2_qwen32b.yaml", "rag_llama70b.yaml", "agentic_coding_llama70b.yaml",
    "long_chat_qwen32b.yaml", "many_prefixes_qwen32b.yaml",
)  # fmt: skip


def _small(name: str) -> dict:
    """The file's scenario with 6 requests (closed loops of 6) and at most 2 turns a session."""
    data = load_scenario(SCENARIOS / name)
    requests = {"count": 6} | ({"concurrency": 6} if "concurrency" in data["requests"] else {})
    return data | {
        "requests": requests,
        "turns_per_session": min(data.get("turns_per_session", 1), 2),
    }


@pytest.mark.parametrize("name", FILES)
def test_each_scenario_file_says_its_sources_and_runs_against_both_baselines(name):
    text = (SCENARIOS / name).read_text()
    assert "datasheet" in text and "acceptance" in text  # where its numbers come from
    full = build_remote_prefix(load_scenario(SCENARIOS / name))
    assert full.host_tier_bytes is not None and full.num_drafters == 4
    small = build_remote_prefix(_small(name))
    compared = compare_deployments(small)
    runs = compared["runs"]
    assert len({report.num_output_tokens for report in runs.values()}) == 1
    assert compared["strongest"].removesuffix("_without_recompute") in (
        "full_local",
        "full_remote",
        "full_both",
        "full_routed",
    )
    for report in runs.values():
        assert report.binds and set(report.utilization) == {"verifiers", "drafters"}
    paper = runs["paper_baseline"]
    assert compared["auto_vs_paper_baseline"] == pytest.approx(
        runs["auto"].tokens_per_s / paper.tokens_per_s
    )
    # auto chooses each turn's path: a session's turns are requests of their own.
    assert sum(runs["auto"].paths.values()) == 6 * small.turns_per_session


def test_mode_auto_runs_from_a_scenario_file_and_a_bad_mode_is_refused():
    data = _small("pipeline2_qwen32b.yaml") | {"mode": "auto", "warm_nodes": True}
    result = run_scenario(data)
    assert result["auto"]["num_output_tokens"] == result["vericache"]["num_output_tokens"]
    assert result["auto_speedup"] == pytest.approx(
        result["auto"]["tokens_per_s"] / max(result[n]["tokens_per_s"] for n in result["baselines"])
    )
    assert "auto" not in result["baselines"] and sum(result["auto"]["paths"].values()) == 6
    with pytest.raises(InvalidRequestError, match="mode"):
        run_scenario(data | {"mode": "fastest"})
    with pytest.raises(InvalidRequestError, match="warm nodes need a host tier"):
        build_remote_prefix(data | {"host_tier_gb": None})
