"""A simulated run over time: throughput, link traffic and KV held, per configuration
(`vericache sim --plot`). matplotlib is imported only here, when a figure is asked for."""

from __future__ import annotations


def plot_timelines(result: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["vericache", *result["baselines"]]
    fig, (rate, link, kv) = plt.subplots(1, 3, figsize=(15, 4))
    for name in names:
        timeline = result[name]["timeline"]
        t = timeline["t_s"]
        rate.plot(*_windowed(t, timeline["output_tokens"]), label=name)
        middles, link_rates = _windowed(t, timeline["link_bytes"])
        link.plot(middles, [r / 1e9 for r in link_rates], label=name)
        kv.plot(t, [b / 1e9 for b in timeline["kv_bytes"]], label=name)
    rate.set(xlabel="seconds", ylabel="output tokens/s", ylim=(0, None))
    link.set(xlabel="seconds", ylabel="link GB/s (all links)", ylim=(0, None))
    kv.set(xlabel="seconds", ylabel="KV held, GB (all devices)", ylim=(0, None))
    rate.legend(fontsize=7)
    sources = result["sources"]
    fig.suptitle(f"device: {sources['device']}; acceptance: {sources['acceptance']}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _windowed(times: list[float], totals: list[int], windows: int = 40):
    """Window middles and the rate of a cumulative count in each of `windows` equal spans of the
    run (rounds emit in bursts: a rate between samples would show the bursts, not the rate)."""
    if len(times) < 2 or times[-1] <= 0:
        return [], []
    width = times[-1] / windows
    edges = [width * i for i in range(windows + 1)]
    at_edges, index = [], 0
    for edge in edges:  # the count reached by each edge (the last sample at or before it)
        while index + 1 < len(times) and times[index + 1] <= edge:
            index += 1
        at_edges.append(totals[index] if times[index] <= edge else 0)
    rates = [(at_edges[i + 1] - at_edges[i]) / width for i in range(windows)]
    return [edge + width / 2 for edge in edges[:-1]], rates
