"""The prefix-sharing benchmark's figure: tokens/s of every cell before and after sharing, with
the spread of its samples, and each cell's peak KV summed over the workers."""

from __future__ import annotations

from vericache.bench.common import pyplot, save_figure

COLOURS = {"before": "C1", "after": "C0"}


def plot(result: dict, path) -> None:
    plt = pyplot()
    cells = result["cells"]
    codes = result["config"]["codes"]
    names = list(dict.fromkeys(f"{c['mode']} {c['layout']}" for c in cells))
    by_key = {(c["code"], f"{c['mode']} {c['layout']}"): c for c in cells}
    fig, (rates, memory) = plt.subplots(2, 1, figsize=(12, 8), sharex=True)
    width = 0.8 / len(codes)
    for i, code in enumerate(codes):
        chosen = [by_key[(code, name)] for name in names]
        xs = [x + (i - (len(codes) - 1) / 2) * width for x in range(len(names))]
        medians = [c["tokens_per_s"] for c in chosen]
        spread = [
            [m - c["tokens_per_s_min"] for m, c in zip(medians, chosen)],
            [c["tokens_per_s_max"] - m for m, c in zip(medians, chosen)],
        ]
        rates.bar(xs, medians, width, yerr=spread, capsize=2, color=COLOURS[code], label=code)
        peaks = [sum(w["peak_kv_bytes"] for w in c["workers"].values()) / 2**20 for c in chosen]
        memory.bar(xs, peaks, width, color=COLOURS[code], label=code)
    rates.set(ylabel="tokens/s (median, min-max)", ylim=(0, None))
    rates.legend(fontsize=8)
    memory.set(ylabel="peak KV, all workers (MiB)", yscale="log")
    memory.set_xticks(range(len(names)), names, rotation=60, ha="right", fontsize=7)
    config = result["config"]
    title = (
        f"{config['num_drafters']} drafters, prefixes of {config['prefix_tokens'][0]}-"
        f"{config['prefix_tokens'][1]} tokens, {config['max_tokens']} tokens each, "
        f"{config['compressor']}, link {config['link_bytes_per_s'] / 1e6:.3g} MB/s, "
        f"{config['repeats']} samples per cell"
    )
    save_figure(fig, path, title)
