"""The paper-repro benchmark's table (markdown) and figure: each configuration of the paper beside
what the simulator gives, with the best configuration the planners find."""

from __future__ import annotations

from vericache.bench.common import pyplot, save_figure


def _measured_frontier_row(runs: dict | None, band: list[float]) -> list[str]:
    """Pipeline 1 at the measured frontier's best point of c <= 1/8 (bench acceptance on the
    embedded model), a row per workload, if the run had one."""
    return [
        f"| Pipeline 1 at the measured c <= 1/8 point, {kind}: {run['label']}, "
        f"c={run['kv_budget']:.3f}, {run['x30']:.1f} of 30 accepted | {band[0]}-{band[1]}x | "
        f"{run['speedup']:.2f}x | | |"
        for kind, run in (runs or {}).items()
    ]


def markdown_table(result: dict) -> str:
    p1, p2, stagger = result["pipeline1"], result["pipeline2"], result["stagger"]
    paper = result["paper"]
    band1, band2 = paper["pipeline1"]["band"], paper["pipeline2"]["band"]
    best1, best2 = p1["best"], p2["best"]
    rows = [
        "| configuration | paper | simulated | best found | its configuration |",
        "| --- | --- | --- | --- | --- |",
        f"| Pipeline 1: Llama-70B, 2 x H100 NVL, KVzip c=0.2, x=25 | {band1[0]}-{band1[1]}x | "
        f"{p1['paper_config']['speedup']:.2f}x | {best1['speedup']:.2f}x | "
        f"x={best1['draft_len']}, {best1['scheduler']} |",
        f"| Pipeline 2: 1 local + 4 remote, KIVI 4-bit, x=40 (vs best full KV) | "
        f"{band2[0]}-{band2[1]}x | {p2['paper_config']['speedup']:.2f}x "
        f"(best full KV: {p2['paper_config']['best_full']}) | {best2['speedup']:.2f}x | "
        f"x={best2['draft_len']}, {best2['num_verifiers']} verifier, {best2['scheduling']} |",
        *_measured_frontier_row(p1.get("at_measured_frontier"), band1),
        f"| Staggered over lock-step, Mistral-24B example | > 1 | "
        f"{stagger['staggered_over_lockstep']:.2f}x | | |",
    ]
    sweeps = ["", "| sweep | value | simulated speedup | paper |", "| --- | --- | --- | --- |"]
    for budget, run in p1["by_kv_budget"].items():
        quoted = paper["pipeline1"]["kv_budget"].get(float(budget))
        sweeps.append(f"| P1 KV budget | {budget} | {run['speedup']:.2f}x | {_quoted(quoted)} |")
    for ratio, run in p1["by_bandwidth_ratio"].items():
        quoted = paper["pipeline1"]["bandwidth_ratio"].get(int(ratio))
        sweeps.append(f"| P1 HBM : link | {ratio} | {run['speedup']:.2f}x | {_quoted(quoted)} |")
    for count, run in p2["by_remote_per_local"].items():
        sweeps.append(f"| P2 remote per local | {count} | {run['speedup']:.2f}x | |")
    for ratio, run in p2["by_load_ratio"].items():
        sweeps.append(f"| P2 prefix load / reply decode | {ratio} | {run['speedup']:.2f}x | |")
    for name, run in p2["variants"].items():
        if isinstance(run, dict):
            sweeps.append(f"| P2 variant | {name} | {run['speedup']:.2f}x | |")
    bound = p2["variants"]["store_link_bound_tokens_per_s"]
    sweeps.append(f"| P2 store-link bound, a full-KV load per round | | {bound:.0f} tokens/s | |")
    sources = p1["paper_config"]["sources"]["device"]
    notes = ["", f"Device profiles: {sources} (and alike)."]
    reason = result["summary"].get("pipeline2_miss_reason")
    if reason:
        notes += ["", f"Pipeline 2 outside the paper's band: {reason}"]
    return "\n".join([*rows, *sweeps, *notes, *held_table(result), ""])


def held_table(result: dict) -> list[str]:
    """Pipeline 2 against the paper's baseline and the strongest full-KV one, per scenario, each
    cell with what binds it; then the targets, and why each missed one is missed."""
    lines = [
        "",
        "| scenario | paper's baseline | strongest full KV | VeriCache (warm nodes) | auto |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, cell in result["pipeline2_scenarios"].items():
        runs = cell["runs"]
        strongest = cell["strongest"]
        lines.append(
            f"| {name} | {_cell(runs['paper_baseline'])} | {strongest}: {_cell(runs[strongest])} | "
            f"{_cell(runs['vericache'])}; {cell['vericache_vs_paper_baseline']:.2f}x paper's, "
            f"{cell['vericache_vs_strongest']:.2f}x strongest | {_cell(runs['auto'])}; "
            f"{cell['auto_vs_strongest']:.2f}x strongest, {cell['auto_vs_full_routed']:.2f}x "
            f"full_routed; paths {runs['auto']['paths']} |"
        )
    lines += [
        "",
        "| target | scenario | speedup | met | why missed |",
        "| --- | --- | --- | --- | --- |",
    ]
    for target in result["summary"]["targets"]:
        lines.append(
            f"| {target['system']} >= {target['target']}x {target['baseline']} | "
            f"{target['scenario']} | {target['speedup']:.2f}x | "
            f"{'yes' if target['met'] else 'no'} | "
            f"{target['why_missed'] or ''} |"
        )
    return lines


def _cell(run: dict) -> str:
    return f"{run['tokens_per_s']:.0f} tok/s, binds {run['binds']}"


def _quoted(value) -> str:
    return f"{value}x" if value is not None else ""


def plot(result: dict, path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 4, figsize=(16, 4))
    p1, p2 = result["pipeline1"], result["pipeline2"]
    panels = [
        (p1["by_kv_budget"], "P1: KV budget (c)", result["paper"]["pipeline1"]["kv_budget"]),
        (p1["by_bandwidth_ratio"], "P1: HBM : host link", result["paper"]["pipeline1"]
         ["bandwidth_ratio"]),
        (p2["by_remote_per_local"], "P2: remote GPUs per local", {}),
        (p2["by_load_ratio"], "P2: prefix load / reply decode", {}),
    ]  # fmt: skip
    for axis, (runs, label, paper) in zip(axes, panels):
        xs = [float(x) for x in runs]
        axis.plot(xs, [run["speedup"] for run in runs.values()], "o-", label="simulated")
        if paper:
            axis.plot([float(x) for x in paper], list(paper.values()), "s", label="paper")
        axis.axhline(1.0, color="grey", linewidth=0.8)
        axis.set(xlabel=label, ylabel="VeriCache / best full KV", ylim=(0, None))
        axis.legend(fontsize=7)
    save_figure(fig, path, "The paper's configurations in the simulator (datasheet profiles)")
