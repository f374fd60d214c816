"""The remote-prefix benchmark's figure: tokens/s of every cell with the spread of its repeats, and
VeriCache and `mode: auto` over the best full-KV configuration of their stream on the same
workers."""

from __future__ import annotations

from vericache.bench.common import pyplot, save_figure


def plot(result: dict, path) -> None:
    plt = pyplot()
    cells = result["cells"]
    summary = result["summary"]
    fig, (rates, gains) = plt.subplots(1, 2, figsize=(13, 4.8), width_ratios=(3, 2))
    names = [cell["name"] for cell in cells]
    medians = [cell["tokens_per_s"] for cell in cells]
    spread = [
        [m - cell["tokens_per_s_min"] for m, cell in zip(medians, cells)],
        [cell["tokens_per_s_max"] - m for m, cell in zip(medians, cells)],
    ]
    colour = {"vericache": "C0", "auto": "C2"}
    colours = [colour.get(cell["mode"], "C1") for cell in cells]
    rates.bar(range(len(cells)), medians, yerr=spread, color=colours, capsize=3)
    rates.set_xticks(range(len(cells)), names, rotation=60, ha="right", fontsize=7)
    rates.set(ylabel="tokens/s over the stream (median, min-max)", ylim=(0, None))
    over = summary["vericache_over_best_full_by_cell"] | summary.get(
        "vericache_over_best_full_many_prefixes_by_cell", {}
    )
    # Of the first stream, by drafter count: int keys as the run made them, str once in JSON.
    best_full = {str(n): rate for n, rate in summary["best_full_tokens_per_s"].items()}
    auto = {
        cell["name"]: cell["tokens_per_s"] / best_full[str(cell["num_drafters"])]
        for cell in cells
        if cell["mode"] == "auto" and cell["workload"] == "few-prefixes"
    } | summary.get("auto_over_best_full_many_prefixes_by_cell", {})
    names = list(over) + list(auto)
    gain_colours = ["C0"] * len(over) + ["C2"] * len(auto)
    gains.barh(range(len(names)), [*over.values(), *auto.values()], color=gain_colours)
    gains.set_yticks(range(len(names)), names, fontsize=7)
    gains.axvline(1.0, color="grey", linewidth=0.8)
    gains.set(xlabel="VERICACHE (blue), AUTO (green) / best full-KV of its stream")
    config = result["config"]
    title = (
        f"{config['num_requests']} requests over {config['num_prefixes']} prefixes, "
        f"{config['concurrency']} in flight, {config['max_tokens']} tokens each, "
        f"{config['compressor']}, link {result['bandwidth_bytes_per_s'] / 1e6:.3g} MB/s, "
        f"{config['repeats']} repeats per cell"
    )
    if result.get("many_prefix_budgets"):
        budgets = result["many_prefix_budgets"]
        title += (
            f"\nmany-prefixes: {config['many_requests']} requests over "
            f"{config['many_prefixes']} prefixes, drafter budget "
            f"{budgets['drafter_kv_bytes'] / 1e6:.0f} MB, host tier "
            f"{budgets['host_tier_bytes'] / 1e6:.0f} MB"
        )
    save_figure(fig, path, title)
