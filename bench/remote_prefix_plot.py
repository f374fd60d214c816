"""The remote-prefix benchmark's figure: tokens/s of every cell with the spread of its repeats, and
VeriCache over the best full-KV configuration on the same workers."""

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
    colours = ["C0" if cell["mode"] == "vericache" else "C1" for cell in cells]
    rates.bar(range(len(cells)), medians, yerr=spread, color=colours, capsize=3)
    rates.set_xticks(range(len(cells)), names, rotation=60, ha="right", fontsize=7)
    rates.set(ylabel="tokens/s over the stream (median, min-max)", ylim=(0, None))
    over = summary["vericache_over_best_full_by_cell"]
    gains.barh(range(len(over)), list(over.values()), color="C0")
    gains.set_yticks(range(len(over)), list(over), fontsize=7)
    gains.axvline(1.0, color="grey", linewidth=0.8)
    gains.set(xlabel="VERICACHE / best full-KV on the same workers")
    config = result["config"]
    title = (
        f"{config['num_requests']} requests over {config['num_prefixes']} prefixes, "
        f"{config['concurrency']} in flight, {config['max_tokens']} tokens each, "
        f"{config['compressor']}, link {result['bandwidth_bytes_per_s'] / 1e6:.3g} MB/s, "
        f"{config['repeats']} repeats per cell"
    )
    save_figure(fig, path, title)
