"""The paper's tables reproduced in the simulator (vericache/sim), at the scale users run.

Every configuration starts from the committed scenario files, so no constant is tuned per figure:
- Pipeline 1 (bench/scenarios/pipeline1_llama70b.yaml): Llama-3.1-70B over 2 x H100 NVL, KVzip
  at c = 0.2, x = 25, the paper's Llama-70B acceptance. Paper: 1.92-2.73x full-KV throughput.
  Swept: the KV budget 0.74 -> 0.2 (paper 1.61 -> 2.71x), and on to 0.1 at the paper's
  acceptance (what a smaller compressed KV would give), and the ratio of HBM to host-link
  bandwidth 60 -> 10 (paper 1.92 -> 3.01x), the link made faster.
- Pipeline 2 (bench/scenarios/pipeline2_qwen32b.yaml): 1 local + 4 remote GPUs, a 40 GB/s store,
  a 1.2 GB/s network, KIVI 4-bit, x = 40, against the best of FULL_LOCAL, FULL_REMOTE and
  FULL_BOTH. Paper: 1.33-2.11x. Swept: remote GPUs per local GPU 1..8, and the time to move one
  prefix's full KV over the network in units of one reply's decode time (the network's bandwidth
  set to match; the paper: gains vanish past about 5).
- Staggered against lock-step scheduling at the paper's Mistral-24B example: 10 requests with
  1 GB of compressed and 4 GB of full KV each, x = 30, one H100.
- Pipeline 2 held to two baselines (vericache/sim/remote_prefix_compare.py) in five scenarios
  (SCENARIOS_P2, each file saying where its numbers come from): the paper's baseline (the remote
  GPUs, every request's full KV over the slow network, no prefix caching or host tier) and the
  strongest full-KV one (the best pool, with prefix caching, which keeps a finished turn's KV
  for its session's next turn too, placement, a host tier, recomputing and shared-prefix
  attention, or the same deployment routed by auto's cost model among its full-KV paths alone:
  FULL_ROUTED), against VeriCache as served (warm nodes) and `mode: auto`, whose workers keep a
  finished turn's KV for the session's next request as the served ones do
  (serve/workers/turn_cache.py), each run with what binds it. Targets (issue
  40): >= 2.11x the paper's baseline in the paper's scenario; `auto` >= 1.0x the strongest
  everywhere and >= 1.5x in agentic coding.
Beside each paper configuration stands the best the planners find on the same hardware and
workload (vericache/sim/plan.py). Device profiles are datasheets times stated efficiencies until
`vericache calibrate` has measured a GPU; every result names its sources. A band that is missed is
reported with the reason the simulation gives.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import asdict
from pathlib import Path

from vericache.bench.common import environment
from vericache.bench.paper_repro_report import markdown_table, plot  # noqa: F401 - CLI's plot
from vericache.sim.plan import Hardware, plan, plan_long_context
from vericache.sim.profiles import device_profile
from vericache.sim.remote_prefix_compare import compare_deployments
from vericache.sim.scenario import build_remote_prefix, load_scenario, report_summary, run_scenario

SCENARIOS = Path(__file__).parent / "scenarios"
SIM_VALIDATE = Path(__file__).parent / "results" / "sim_validate.json"
# The measured frontier (bench acceptance): its best point at c <= 1/8 stands in for the paper's
# acceptance and KV budget in a Pipeline 1 run of its own.
ACCEPTANCE_FRONTIER = Path(__file__).parent / "results" / "acceptance_steering.json"
PAPER = {
    "pipeline1": {"band": [1.92, 2.73], "kv_budget": {0.74: 1.61, 0.2: 2.71},
                  "bandwidth_ratio": {60: 1.92, 10: 3.01}},
    "pipeline2": {"band": [1.33, 2.11], "gains_vanish_past_load_ratio": 5},
}  # fmt: skip
# Past the paper's 0.2, at the paper's acceptance (an assumption: drafts over a smaller
# compressed KV are accepted less): what a smaller compressed KV would give on the same hardware.
KV_BUDGETS = (0.74, 0.6, 0.4, 0.2, 0.15, 0.1)
BANDWIDTH_RATIOS = (60, 40, 20, 10)
REMOTE_PER_LOCAL = (1, 2, 4, 8)
LOAD_RATIOS = (0.5, 1, 2, 5, 10)
# Pipeline 2's scenarios against both baselines: name -> file under bench/scenarios.
SCENARIOS_P2 = {
    "paper": "pipeline2_qwen32b.yaml",
    "multi_tenant_rag": "rag_llama70b.yaml",
    "agentic_coding": "agentic_coding_llama70b.yaml",
    "long_chat": "long_chat_qwen32b.yaml",
    "many_prefixes": "many_prefixes_qwen32b.yaml",
}
TARGETS = {"paper_baseline": 2.11, "strongest": 1.0, "agentic_coding": 1.5}
# Runs that both serve this share of the arrivals' bound differ in how their last sessions end.
END_DECIDES = 0.95
MISTRAL_EXAMPLE = {
    "pipeline": "long-context", "model": "mistral-small-24b", "device": "h100-sxm",
    "prompt_tokens": 25600, "kv_budget": 0.25, "draft_len": 30, "requests": {"count": 10},
    "output_tokens": [512], "acceptance": {"mean_accepted": 19, "at_draft_len": 30},
}  # fmt: skip


def add_arguments(parser) -> None:
    parser.add_argument("--markdown", type=Path, help="write the table here")


def run(args) -> dict:
    p1_base = load_scenario(SCENARIOS / "pipeline1_llama70b.yaml")
    p2_base = load_scenario(SCENARIOS / "pipeline2_qwen32b.yaml")
    quick = args.quick
    if quick:  # a quarter of the requests, and the sweeps' ends only
        p1_base["requests"] = {**p1_base["requests"], "count": 16}
        p2_base["requests"] = {**p2_base["requests"], "count": 16}
    pipeline1 = _pipeline1(p1_base, quick)
    pipeline2 = _pipeline2(p2_base, quick)
    stagger = _stagger()
    held = {name: _held_to_baselines(name, quick) for name in SCENARIOS_P2}
    summary = {
        "pipeline1_speedup": pipeline1["paper_config"]["speedup"],
        "pipeline1_in_band": _in_band(pipeline1["paper_config"]["speedup"], "pipeline1"),
        "pipeline1_best_speedup": pipeline1["best"]["speedup"],
        "pipeline1_at_measured_frontier": {
            kind: run["speedup"] for kind, run in (pipeline1["at_measured_frontier"] or {}).items()
        },
        "pipeline2_speedup": pipeline2["paper_config"]["speedup"],
        "pipeline2_in_band": _in_band(pipeline2["paper_config"]["speedup"], "pipeline2"),
        "pipeline2_best_speedup": pipeline2["best"]["speedup"],
        "pipeline2_speedup_by_variant": {
            name: run["speedup"]
            for name, run in pipeline2["variants"].items()
            if isinstance(run, dict)
        },
        "pipeline2_miss_reason": _pipeline2_miss_reason(pipeline2),
        "staggered_over_lockstep": stagger["staggered_over_lockstep"],
        "cpu_prediction_error": committed_cpu_prediction_error(),
        "pipeline2_vs_paper_baseline": held["paper"]["vericache_vs_paper_baseline"],
        "auto_vs_paper_baseline": held["paper"]["auto_vs_paper_baseline"],
        "pipeline2_vs_strongest": {name: cell["auto_vs_strongest"] for name, cell in held.items()},
        "agentic_coding_vs_strongest": held["agentic_coding"]["auto_vs_strongest"],
        # What VeriCache's path adds to auto: auto over its own choice among full-KV paths alone.
        "auto_vs_full_routed": {name: cell["auto_vs_full_routed"] for name, cell in held.items()},
        "targets": targets(held),
    }
    result = {
        "benchmark": "paper-repro",
        "summary": summary,
        "paper": PAPER,
        "pipeline1": pipeline1,
        "pipeline2": pipeline2,
        "stagger": stagger,
        "pipeline2_scenarios": held,
        "environment": environment(),
    }
    if args.markdown:
        args.markdown.write_text(markdown_table(result))
    return result


def _held_to_baselines(name: str, quick: bool) -> dict:
    """One scenario's runs against both baselines: each run's summary (what binds it among
    them), the strongest pool's name and the speedups."""
    data = load_scenario(SCENARIOS / SCENARIOS_P2[name])
    if quick:  # a 32nd of the requests (at least 8), and at most 4 turns a session
        requests = data["requests"]
        count = max(8, requests["count"] // 32)
        data["requests"] = requests | {"count": count}
        if "concurrency" in requests:
            data["requests"]["concurrency"] = min(requests["concurrency"], count)
        data["turns_per_session"] = min(data.get("turns_per_session", 1), 4)
    compared = compare_deployments(build_remote_prefix(data))
    runs = {
        run_name: {key: value for key, value in report_summary(report).items() if key != "timeline"}
        for run_name, report in compared.pop("runs").items()
    }
    routed = runs["auto"]["tokens_per_s"] / runs["full_routed"]["tokens_per_s"]
    return {"file": SCENARIOS_P2[name], "runs": runs, **compared, "auto_vs_full_routed": routed}


def targets(held: dict) -> list[dict]:
    """Each target of issue 40, met or not, with what binds the runs it compares."""
    paper, bound = held["paper"], TARGETS["paper_baseline"]
    # The paper's claim is VeriCache's, every request through it; `auto`, which serves a request
    # with full KV where that is sooner, stands beside it.
    rows = [
        _target("paper", paper, system, "paper_baseline", bound) for system in ("vericache", "auto")
    ]
    rows += [
        _target(name, cell, "auto", cell["strongest"], TARGETS["strongest"])
        for name, cell in held.items()
    ]
    agentic = held["agentic_coding"]
    rows.append(
        _target("agentic_coding", agentic, "auto", agentic["strongest"], TARGETS["agentic_coding"])
    )
    return rows


def _target(scenario: str, cell: dict, system: str, baseline: str, target: float) -> dict:
    runs = cell["runs"]
    speedup = runs[system]["tokens_per_s"] / runs[baseline]["tokens_per_s"]
    met = speedup >= target
    why = None
    if not met:
        why = (
            f"{system} serves {runs[system]['tokens_per_s']:.0f} tokens/s, bound by "
            f"{runs[system]['binds']}; {baseline} serves {runs[baseline]['tokens_per_s']:.0f}, "
            f"bound by {runs[baseline]['binds']}"
        )
    bound = cell.get("arrival_bound_tokens_per_s")
    slowest = min(runs[system]["tokens_per_s"], runs[baseline]["tokens_per_s"])
    if why and bound and slowest >= END_DECIDES * bound:
        why += (
            f"; both within {1 - slowest / bound:.1%} of the {bound:.0f} no deployment passes "
            "(the last session's arrival and its tokens alone): the last sessions decide"
        )
    return {
        "scenario": scenario, "system": system, "baseline": baseline, "target": target,
        "speedup": speedup, "met": met, "why_missed": why,
    }  # fmt: skip


def committed_cpu_prediction_error() -> float | None:
    """The simulator's largest error against measured CPU runs: `bench sim-validate`'s, as the
    repository's committed result gives it (None where there is none, as in an installed copy):
    the run that measured it, not this one."""
    path = SIM_VALIDATE
    if not path.is_file():
        return None
    return json.loads(path.read_text())["summary"].get("cpu_prediction_error")


def _in_band(speedup: float, pipeline: str) -> bool:
    low, high = PAPER[pipeline]["band"]
    return low <= speedup <= high


def _pipeline2_miss_reason(pipeline2: dict) -> str | None:
    """Why Pipeline 2 falls outside the paper's band, from the simulated runs themselves."""
    run = pipeline2["paper_config"]
    if _in_band(run["speedup"], "pipeline2"):
        return None
    uncached = pipeline2["variants"]["without_prefix_caching"]
    return (
        f"VeriCache serves {run['vericache_tokens_per_s']:.0f} tokens/s, "
        f"{run['vericache_tokens_per_s'] / run['full_local_tokens_per_s']:.2f}x the verifiers "
        f"alone (FULL_LOCAL), but {run['best_full']} serves {run['best_full_tokens_per_s']:.0f}: "
        "there every GPU decodes over full KV, each remote one fetching a prefix's full KV once "
        "over the network and keeping it for the sessions after (prefix caching), while "
        "VeriCache's remote GPUs only draft and every token still passes the local verifiers. "
        f"Without prefix caching on either side (the paper's accounting of a request) the "
        f"speedup is {uncached['speedup']:.2f}x."
    )


def _pipeline1(base: dict, quick: bool) -> dict:
    budgets = KV_BUDGETS[::3] if quick else KV_BUDGETS
    ratios = BANDWIDTH_RATIOS[::3] if quick else BANDWIDTH_RATIOS
    hbm = device_profile(base["device"]).hbm_bytes_per_s
    with tempfile.TemporaryDirectory() as folder:
        by_ratio = {
            str(ratio): _p1(base | {"device": _device_file(base["device"], hbm / ratio, folder)})
            for ratio in ratios
        }
    best = plan_long_context(base, (16, 25, 32) if quick else (8, 16, 25, 32, 48))
    return {
        "paper_config": _p1(base),
        "at_measured_frontier": _p1_at_measured_frontier(base),
        "by_kv_budget": {str(b): _p1(base | {"kv_budget": b}) for b in budgets},
        "by_bandwidth_ratio": by_ratio,
        "best": best["recommended"],
        "best_candidates": best["candidates"],
    }


def _p1(data: dict) -> dict:
    result = run_scenario(data)
    return {
        "speedup": result["speedup"],
        "vericache_tokens_per_s": result["vericache"]["tokens_per_s"],
        "full_kv_tokens_per_s": result["full_kv"]["tokens_per_s"],
        "mean_accepted_per_round": result["vericache"]["mean_accepted_per_round"],
        "stall_s": result["vericache"]["stall_s"],
        "sources": result["sources"],
    }


def _p1_at_measured_frontier(base: dict) -> dict | None:
    """Pipeline 1 at the committed frontier's best point of c <= 1/8, per workload: its c as the
    KV budget and its measured rounds (bench acceptance's traces, replayed at the pipeline's x)
    in place of the paper's acceptance. None where the repository holds no such run (an
    installed copy)."""
    if not ACCEPTANCE_FRONTIER.is_file():
        return None
    best = json.loads(ACCEPTANCE_FRONTIER.read_text())["summary"].get("best_accepted_at_c_1_8")
    if not best:
        return None
    runs = {}
    for kind, cell in best.items():
        acceptance = {"bench": str(ACCEPTANCE_FRONTIER), "kind": kind, "compressor": cell["label"]}
        run = _p1(base | {"kv_budget": cell["c"], "acceptance": acceptance})
        runs[kind] = run | {"kv_budget": cell["c"], "label": cell["label"], "x30": cell["mean"]}
    return runs


def _device_file(name: str, host_to_device_bytes_per_s: float, folder: str) -> str:
    """A copy of a device profile with another host link, as a JSON file a scenario can name."""
    profile = asdict(device_profile(name))
    profile["host_to_device_bytes_per_s"] = host_to_device_bytes_per_s
    profile["source"] += f"; host link set to {host_to_device_bytes_per_s / 1e9:.3g} GB/s"
    path = Path(folder) / f"{name}-{host_to_device_bytes_per_s:.0f}.json"
    path.write_text(json.dumps(profile))
    return str(path)


def _pipeline2(base: dict, quick: bool) -> dict:
    remote = REMOTE_PER_LOCAL[::2] if quick else REMOTE_PER_LOCAL
    ratios = LOAD_RATIOS[::2] if quick else LOAD_RATIOS
    reply_s = _reply_decode_s(base)
    full_bytes = build_remote_prefix(base).prefix_bytes(compressed=False)
    by_load_ratio = {}
    for ratio in ratios:
        network = full_bytes / (ratio * reply_s) / 1e9
        by_load_ratio[str(ratio)] = _p2(base | {"network_gb_per_s": network})
    hardware = Hardware(
        base["device"], local_gpus=base["verifiers"], remote_gpus=base["drafters"],
        store_gb_per_s=base["store_gb_per_s"], network_gb_per_s=base["network_gb_per_s"],
        network_latency_ms=base.get("network_latency_ms", 0.0),
    )  # fmt: skip
    workload = {k: base[k] for k in ("prefix_tokens", "prefixes", "suffix_tokens")}
    workload |= {k: base[k] for k in ("output_tokens", "requests")}
    workload["compressors"] = {
        "kivi-4bit": {
            "compressed_ratio": base["compressed_ratio"],
            "acceptance": base["acceptance"],
        }
    }
    best = plan(base["model"], hardware, workload, (4, 8, 16) if quick else (4, 8, 16, 24, 40))
    paper_config = _p2(base)
    return {
        "paper_config": paper_config,
        "variants": _p2_variants(base, paper_config),
        "by_remote_per_local": {str(n): _p2(base | {"drafters": n}) for n in remote},
        "by_load_ratio": by_load_ratio,
        "reply_decode_s": reply_s,
        "best": best["recommended"],
        "best_baselines": best["baselines"],
    }


def _p2_variants(base: dict, paper_config: dict) -> dict:
    """The paper's configuration with each verifier's rounds planned by the staggered scheduler
    (the full KV loaded from the store for every round, as the paper's model of a round has it),
    and without prefix caching (every session fetches its own prefix, as the paper's accounting
    of a request has it). The bound: what the store link allows when every round loads its
    request's full KV, at the configuration's tokens per round."""
    scenario = build_remote_prefix(base)
    tokens_per_round = (paper_config["mean_accepted_per_round"] or 0.0) + 1
    loads_per_s = (
        scenario.num_verifiers
        * scenario.store_bytes_per_s
        / scenario.prefix_bytes(compressed=False)
    )
    return {
        "staggered": _p2(base | {"scheduling": "staggered"}),
        "without_prefix_caching": _p2(base | {"prefix_caching": False}),
        "staggered_without_prefix_caching": _p2(
            base | {"scheduling": "staggered", "prefix_caching": False}
        ),
        "store_link_bound_tokens_per_s": loads_per_s * tokens_per_round,
    }


def _reply_decode_s(data: dict) -> float:
    """One reply's decode time alone on one worker: its mean output length of one-token steps
    over the prefix's full KV."""
    scenario = build_remote_prefix(data)
    step_s = scenario.forward_s([scenario.row(1, scenario.suffix_tokens, compressed=False)])
    lengths = data["output_tokens"]
    return step_s * sum(lengths) / len(lengths)


def _p2(data: dict) -> dict:
    result = run_scenario(data)
    best = max(result["baselines"], key=lambda name: result[name]["tokens_per_s"])
    return {
        "speedup": result["speedup"],
        "vericache_tokens_per_s": result["vericache"]["tokens_per_s"],
        "best_full": best,
        "best_full_tokens_per_s": result[best]["tokens_per_s"],
        **{f"{name}_tokens_per_s": result[name]["tokens_per_s"] for name in result["baselines"]},
        "mean_accepted_per_round": result["vericache"]["mean_accepted_per_round"],
        "sources": result["sources"],
    }


def _stagger() -> dict:
    runs = {
        scheduler: run_scenario(MISTRAL_EXAMPLE | {"scheduler": scheduler})
        for scheduler in ("staggered", "lockstep")
    }
    staggered, lockstep = runs["staggered"]["vericache"], runs["lockstep"]["vericache"]
    return {
        "staggered_over_lockstep": staggered["tokens_per_s"] / lockstep["tokens_per_s"],
        "staggered": staggered,
        "lockstep": lockstep,
        "full_kv": runs["staggered"]["full_kv"],
        "acceptance": "published: Qwen-32B's 19 of 30 at 4x, standing in for Mistral-24B's",
    }
