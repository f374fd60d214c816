"""`bench paper-repro`: the paper's configurations from the committed scenario files, its sweeps,
the planners' best beside them, a markdown table and a figure (a quick run)."""

from __future__ import annotations

import json

import pytest

from vericache.bench import paper_repro
from vericache.cli.bench import parse_benchmark_args


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    folder = tmp_path_factory.mktemp("paper")
    module, args = parse_benchmark_args(
        "paper-repro", ["--quick", "--markdown", str(folder / "table.md")]
    )
    assert module is paper_repro
    return paper_repro.run(args), folder


def test_the_summary_names_both_pipelines_and_the_bands(quick):
    result, _ = quick
    summary = result["summary"]
    for pipeline in ("pipeline1", "pipeline2"):
        speedup = summary[f"{pipeline}_speedup"]
        assert speedup == result[pipeline]["paper_config"]["speedup"] > 0
        low, high = paper_repro.PAPER[pipeline]["band"]
        assert summary[f"{pipeline}_in_band"] == (low <= speedup <= high)
        # The planners search a space that holds the paper's configuration's neighbours.
        assert summary[f"{pipeline}_best_speedup"] > 0
    assert (summary["pipeline2_miss_reason"] is None) == summary["pipeline2_in_band"]
    # bench sim-validate's, from its committed result
    committed = json.loads(paper_repro.SIM_VALIDATE.read_text())["summary"]
    assert summary["cpu_prediction_error"] == committed["cpu_prediction_error"] is not None
    assert result["pipeline1"]["paper_config"]["sources"]["device"].startswith("datasheet")


def test_the_sweeps_move_what_they_name(quick):
    result, _ = quick
    p1 = result["pipeline1"]
    # A faster host link (a lower HBM : link ratio) helps VeriCache and not full KV.
    fast, slow = p1["by_bandwidth_ratio"]["10"], p1["by_bandwidth_ratio"]["60"]
    assert fast["speedup"] > slow["speedup"]
    assert fast["full_kv_tokens_per_s"] == pytest.approx(slow["full_kv_tokens_per_s"])
    # A slower network (more decode times per prefix load) hurts VeriCache's drafters.
    loads = result["pipeline2"]["by_load_ratio"]
    assert loads["10"]["vericache_tokens_per_s"] < loads["0.5"]["vericache_tokens_per_s"]
    assert result["stagger"]["staggered_over_lockstep"] > 1
    # A full-KV load per round cannot outrun the store link.
    variants = result["pipeline2"]["variants"]
    bound = variants["store_link_bound_tokens_per_s"]
    assert variants["staggered"]["vericache_tokens_per_s"] <= 1.05 * bound


def test_pipeline1_runs_again_at_the_measured_frontier_s_best_point(quick):
    result, folder = quick
    runs = result["pipeline1"]["at_measured_frontier"]
    committed = json.loads(paper_repro.ACCEPTANCE_FRONTIER.read_text())["summary"]
    best = committed["best_accepted_at_c_1_8"]
    assert set(runs) == set(best) == {"code", "tools"}
    for kind, run in runs.items():
        assert run["kv_budget"] == best[kind]["c"] <= 1 / 8
        assert run["sources"]["acceptance"].startswith("measured")
    assert result["summary"]["pipeline1_at_measured_frontier"] == {
        kind: run["speedup"] for kind, run in runs.items()
    }
    assert "| Pipeline 1 at the measured c <= 1/8 point, code" in (folder / "table.md").read_text()


def test_the_table_and_the_figure_are_written(quick, tmp_path):
    result, folder = quick
    table = (folder / "table.md").read_text()
    assert "| Pipeline 1: Llama-70B" in table and "| P2 remote per local |" in table
    path = tmp_path / "paper.png"
    paper_repro.plot(result, path)
    assert path.stat().st_size > 1000


def test_the_cpu_prediction_error_is_the_committed_sim_validate_runs(tmp_path, monkeypatch):
    monkeypatch.setattr(paper_repro, "SIM_VALIDATE", tmp_path / "sim_validate.json")
    assert paper_repro.committed_cpu_prediction_error() is None
    paper_repro.SIM_VALIDATE.write_text('{"summary": {"cpu_prediction_error": 0.12}}')
    assert paper_repro.committed_cpu_prediction_error() == 0.12


def test_pipeline2_is_held_to_both_baselines_with_what_binds_each_run(quick):
    result, folder = quick
    summary, held = result["summary"], result["pipeline2_scenarios"]
    assert set(held) == set(paper_repro.SCENARIOS_P2)
    paper = held["paper"]
    assert summary["pipeline2_vs_paper_baseline"] == paper["vericache_vs_paper_baseline"] > 0
    assert summary["pipeline2_vs_strongest"] == {n: c["auto_vs_strongest"] for n, c in held.items()}
    assert summary["agentic_coding_vs_strongest"] == held["agentic_coding"]["auto_vs_strongest"]
    # auto over its own choice among the full-KV paths: what VeriCache's path adds.
    assert summary["auto_vs_full_routed"] == {
        n: c["runs"]["auto"]["tokens_per_s"] / c["runs"]["full_routed"]["tokens_per_s"]
        for n, c in held.items()
    }
    for cell in held.values():
        assert cell["strongest"].removesuffix("_without_recompute") in (
            "full_local",
            "full_remote",
            "full_both",
            "full_routed",
        )
        assert all(run["binds"] for run in cell["runs"].values())
    assert len(summary["targets"]) == 2 + len(held) + 1
    for target in summary["targets"]:
        assert target["met"] == (target["speedup"] >= target["target"])
        # A missed target names the term that binds each side.
        assert (target["why_missed"] is None) == target["met"]
        assert target["met"] or target["why_missed"].count("bound by") == 2
    table = (folder / "table.md").read_text()
    assert "| scenario | paper's baseline | strongest full KV |" in table
    assert "| auto >= 1.5x" in table and "x full_routed; paths" in table


def test_a_missed_target_says_where_the_last_sessions_decide():
    runs = {
        "auto": {"tokens_per_s": 818.0, "binds": "b"},
        "full_both": {"tokens_per_s": 829.0, "binds": "b"},
    }
    near = {"runs": runs, "arrival_bound_tokens_per_s": 837.0}
    target = paper_repro._target("paper", near, "auto", "full_both", 1.0)
    assert not target["met"] and "the last sessions decide" in target["why_missed"]
    far = {"runs": runs, "arrival_bound_tokens_per_s": 2000.0}
    target = paper_repro._target("paper", far, "auto", "full_both", 1.0)
    assert "last sessions" not in target["why_missed"]
