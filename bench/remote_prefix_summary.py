"""What a remote-prefix run's cells add up to (bench/remote_prefix.py's summary): VeriCache and
`mode: auto` over the best full-KV configuration of their stream, worker calls per round, the
latency comparison, and the verifier's CPU over the in-process engine's."""

from __future__ import annotations

import statistics
from dataclasses import replace

from vericache.bench.remote_prefix_cells import FEW, FULL_MODES, HEADLINE, MANY, Cell, StreamSpec

TARGETS = {
    "rpcs_per_round": 2.0,  # at most
    "rtt20_over_rtt0": 0.85,  # at least
    "verifier_overhead": 1.3,  # at most
    "auto_over_best_full_many_prefixes": 1.5,  # at least
    "auto_over_best_everywhere": 0.95,  # at least
}


DEFINITIONS = {
    "tokens_per_s": "output tokens of the whole stream / its wall time; the median of the "
    "cell's repeats, with tokens_per_s_min and _max",
    "best_full": "the most tokens/s of FULL_LOCAL, FULL_REMOTE and FULL_BOTH on the same drafters "
    "and stream",
    "vericache_over_best_full": "VERICACHE tokens/s / best_full (the few-prefix stream)",
    "auto_over_best_full_many_prefixes": "AUTO tokens/s / best_full, the many-prefix stream, "
    "headline draft length, one drafter",
    "auto_over_best_everywhere": "the least over AUTO cells of AUTO tokens/s / max(VERICACHE at "
    "the same stream, draft length and drafters (per-request rounds), best_full)",
    "rpcs_per_round": "worker calls of VERICACHE rounds / rounds verified",
    "rtt20_over_rtt0": "VERICACHE tokens/s at the rtt latency / at none (x = the largest, 1 "
    "drafter), each sample over the one served just before it; the median",
    "verifier_overhead": "verifier process CPU s per output token over the cell's samples / "
    "in-process engine CPU s of the same requests' verifications and suffix prefills per output "
    "token, same draft length, measured in parts beside the samples",
    "verifier_serving_overhead": "verifier process CPU s / (its forward loop's CPU s + the "
    "reference's suffix prefill CPU s), the same stream, per sample, the median: serving's "
    "share, the machine's speed cancelled",
    "reference_cpu_s_per_token_range": "per draft length, the lowest and highest part of an "
    "in-process reference in the run: how far the machine's speed moved",
    "steered_over_unsteered": "with --steer-every: the headline VERICACHE cell's tokens/s with its "
    "drafters' kept sets steered over without, each sample over the one served just before it; "
    "the median (steering_link_bytes_per_token and steering_accepted_per_round beside it)",
}


def summarize(cells: list[dict], spec: StreamSpec) -> dict:
    by_name = {cell["name"]: cell for cell in cells}
    vericache = [
        c for c in cells if c["mode"] == "vericache" and not c["latency_s"] and c["workload"] == FEW
    ]

    def best_full(num_drafters: int, workload: str = FEW) -> float:
        names = [Cell("full_local", 1, workload=workload).name] + [
            Cell(mode, num_drafters, workload=workload).name for mode in FULL_MODES[1:]
        ]
        return max(by_name[name]["tokens_per_s"] for name in names if name in by_name)

    over = {c["name"]: c["tokens_per_s"] / best_full(c["num_drafters"]) for c in vericache}
    headline = Cell("vericache", **HEADLINE).name
    rpcs = max(_rpcs_per_round(c) for c in vericache)
    rpcs_by_scheduling = {
        scheduling: max(_rpcs_per_round(c) for c in vericache if c["scheduling"] == scheduling)
        for scheduling in sorted({c["scheduling"] for c in vericache})
    }
    paired = [c for c in vericache if "reference" in c]
    overhead = {c["name"]: _verifier_overhead(c) for c in paired}
    serving = {c["name"]: _serving_overhead(c) for c in paired}
    rtt = _rtt_ratios(cells, spec)
    summary = {
        "vericache_over_best_full": over.get(headline),
        "headline_cell": headline,
        "vericache_over_best_full_by_cell": over,
        "best_full_tokens_per_s": {n: best_full(n) for n in spec.drafter_counts},
        "rpcs_per_round": rpcs,
        "rpcs_per_round_by_scheduling": rpcs_by_scheduling,
        "rtt20_over_rtt0": min(rtt.values()) if rtt else None,
        "rtt20_over_rtt0_by_scheduling": rtt,
        "verifier_overhead": max(overhead.values()) if overhead else None,
        "verifier_overhead_by_cell": overhead,
        "reference_cpu_s_per_token_range": reference_spread(cells),
        "verifier_serving_overhead": max(serving.values()) if serving else None,
        "verifier_serving_overhead_by_cell": serving,
        **_auto_summary(by_name, best_full),
        **_steering_summary(by_name, spec),
        "identical": all(c["outputs_match"] for c in cells if c["mode"] != "lossy")
        and all(all(c.get("reference_outputs_match", [True])) for c in cells),
    }
    summary["meets_targets"] = {
        "rpcs_per_round": rpcs <= TARGETS["rpcs_per_round"],
        "rtt20_over_rtt0": bool(rtt) and summary["rtt20_over_rtt0"] >= TARGETS["rtt20_over_rtt0"],
        "verifier_overhead": bool(overhead)
        and summary["verifier_overhead"] <= TARGETS["verifier_overhead"],
    } | {
        key: summary[key] is not None and summary[key] >= TARGETS[key]
        for key in ("auto_over_best_full_many_prefixes", "auto_over_best_everywhere")
    }
    return summary


def _auto_summary(by_name: dict[str, dict], best_full) -> dict:
    """AUTO against the better of VERICACHE and the best full-KV cell, per AUTO cell; and over
    the best full-KV cell alone in the many-prefix stream (with VERICACHE's there beside it)."""
    auto = [cell for cell in by_name.values() if cell["mode"] == "auto"]
    over_best, over_full_many, vericache_many = {}, {}, {}
    for cell in auto:
        full = best_full(cell["num_drafters"], cell["workload"])
        twin = Cell("vericache", cell["num_drafters"], cell["draft_len"], workload=cell["workload"])
        vericache = by_name.get(twin.name, {}).get("tokens_per_s", 0.0)
        over_best[cell["name"]] = cell["tokens_per_s"] / max(full, vericache)
        if cell["workload"] == MANY:
            over_full_many[cell["name"]] = cell["tokens_per_s"] / full
            vericache_many[twin.name] = vericache / full
    headline = Cell("auto", HEADLINE["num_drafters"], HEADLINE["draft_len"], workload=MANY).name
    return {
        "auto_over_best_full_many_prefixes": over_full_many.get(headline),
        "auto_over_best_full_many_prefixes_by_cell": over_full_many,
        "vericache_over_best_full_many_prefixes_by_cell": vericache_many,
        "auto_over_best_everywhere": min(over_best.values()) if over_best else None,
        "auto_over_best_by_cell": over_best,
        "auto_paths": {cell["name"]: _paths(cell) for cell in auto},
    }


def _steering_summary(by_name: dict[str, dict], spec: StreamSpec) -> dict:
    """The headline cell steered against itself unsteered, served in turn: tokens/s, the link
    bytes per output token (the refreshes ride on the link with the rounds' exact KV) and the
    drafts accepted per round."""
    plain = Cell("vericache", **HEADLINE)
    steered = replace(plain, steer_every=spec.steer_every)
    if not spec.steer_every or steered.name not in by_name:
        return {}
    pair = {"unsteered": by_name[plain.name], "steered": by_name[steered.name]}
    samples = zip(pair["steered"]["samples"], pair["unsteered"]["samples"])
    return {
        "steered_over_unsteered": statistics.median(
            s["tokens_per_s"] / u["tokens_per_s"] for s, u in samples
        ),
        "steering_link_bytes_per_token": {
            name: statistics.median(s["link_bytes"] / s["num_tokens"] for s in cell["samples"])
            for name, cell in pair.items()
        },
        "steering_accepted_per_round": {
            name: statistics.median(s["mean_accepted_per_round"] for s in cell["samples"])
            for name, cell in pair.items()
        },
    }


def _paths(cell: dict) -> dict[str, int]:
    """How many of the cell's requests took each path, over its samples."""
    counts: dict[str, int] = {}
    for sample in cell["samples"]:
        for path, count in sample.get("paths", {}).items():
            counts[path] = counts.get(path, 0) + count
    return counts


def _rpcs_per_round(cell: dict) -> float:
    calls = sum(s["round_calls"] for s in cell["samples"])
    return calls / max(1.0, sum(s["verified_rounds"] for s in cell["samples"]))


def _verifier_overhead(cell: dict) -> float:
    """The cell's verifier CPU s per output token over its reference's, both over the same
    minutes."""
    samples = cell["samples"]
    cpu_s = sum(s["cpu_s"]["verifiers"] for s in samples)
    per_token = cpu_s / sum(s["num_tokens"] for s in samples)
    return per_token / cell["reference"]["cpu_s_per_token"]


def _serving_overhead(cell: dict) -> float:
    """The verifier's CPU over its own forward loop's plus the suffix prefills' (from the
    reference), per sample, median: what serving adds, measured in the same process and stream."""
    prefill_cpu_s = cell["reference"]["suffix_prefill_cpu_s"]
    ratios = [
        s["cpu_s"]["verifiers"] / (s["verifiers_forward_cpu_s"] + prefill_cpu_s)
        for s in cell["samples"]
    ]
    return statistics.median(ratios)


def _rtt_ratios(cells: list[dict], spec: StreamSpec) -> dict[str, float]:
    """Per scheduling, the median over repeats of a sample with latency over the sample without
    it served just before (bench.serve serves the pair in turn)."""
    by_name = {cell["name"]: cell for cell in cells}
    ratios = {}
    for scheduling in spec.schedulings:
        far = Cell("vericache", 1, max(spec.draft_lens), scheduling, spec.rtt_latency_s)
        near = replace(far, latency_s=0.0)
        if far.name in by_name and near.name in by_name:
            pairs = zip(by_name[far.name]["samples"], by_name[near.name]["samples"])
            ratios[scheduling] = statistics.median(
                f["tokens_per_s"] / n["tokens_per_s"] for f, n in pairs
            )
    return ratios


def reference_spread(cells: list[dict]) -> dict[str, list[float]]:
    """Per draft length, the lowest and highest reference part measured over the run: how far
    this machine's speed moved, which references spread beside their samples cancel."""
    by_len: dict[str, list[float]] = {}
    for cell in cells:
        if "reference" in cell:
            run = cell["reference"]
            by_len.setdefault(str(run["draft_len"]), []).extend(run["parts_cpu_s_per_token"])
    return {x: [min(values), max(values)] for x, values in sorted(by_len.items())}
