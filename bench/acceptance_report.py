"""The acceptance benchmark's table, ranking and figure, replayed from its first-mismatch traces."""

from __future__ import annotations

import math
import random
import statistics
from collections import defaultdict

from vericache.bench.common import pyplot
from vericache.sim.workload import MAX_DRAFT_LEN, replayed_rounds

TARGET_X30 = 20.0
TARGET_KINDS = ("code", "tools")
STRENGTH_ROWS = {"2x": ("-2x", "-8bit"), "4x": ("-4x", "-4bit"), "8x": ("-8x", "-2bit")}
# Two-sided 95% quantiles of Student's t for 1..30 degrees of freedom; past 30, the normal's.
_T975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
    2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
    2.052, 2.048, 2.045, 2.042,
)  # fmt: skip


def mean_ci95(values: list[float]) -> tuple[float, list[float] | None]:
    """The mean and its 95% confidence interval (None from one value)."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, None
    df = len(values) - 1
    half = (_T975[df - 1] if df <= len(_T975) else 1.96) * statistics.stdev(values)
    half /= math.sqrt(len(values))
    return mean, [mean - half, mean + half]


def replay_table(records: list[dict], draft_lens: list[int]) -> dict:
    """Per (draft KV, kind, compressor, x): the mean accepted per round replayed from the traces,
    its 95% interval over prompts, and the counts behind it."""
    groups = defaultdict(list)
    for record in records:
        groups[record["draft_kv"], record["kind"], record["compressor"]].append(record)
    table = {}
    for (source, kind, label), group in sorted(groups.items()):
        cells = {}
        for x in draft_lens:
            per_prompt = [prompt_mean(r, x) for r in group if r["first_mismatch"] and replays(r, x)]
            if not per_prompt:
                continue
            mean, ci = mean_ci95(per_prompt)
            cells[str(x)] = {
                "mean": mean,
                "ci95": ci,
                "num_prompts": len(per_prompt),
                "num_rounds": sum(len(r["first_mismatch"]) for r in group),
            }
        table.setdefault(source, {}).setdefault(kind, {})[label] = cells
    return table


def replays(record: dict, x: int) -> bool:
    """Whether a record's rounds tell what a round at x accepts: rounds of 64 cut at the first
    rejected draft tell it at any x <= 64, whole rounds (`whole_rounds`) at their own x alone."""
    whole = record.get("whole_rounds")
    return x == whole if whole else x <= MAX_DRAFT_LEN


def prompt_mean(record: dict, x: int) -> float:
    """A prompt's accepted drafts per round at x: its whole rounds' as they were, or those its
    rounds of 64 replay in order (sim/workload.py `replayed_rounds`)."""
    if record.get("whole_rounds"):
        return statistics.fmean(record["first_mismatch"])
    return statistics.fmean(replayed_rounds(record["first_mismatch"], x))


def paired_ratio(pairs: list[tuple[float, float]], draws: int = 2000) -> dict:
    """Sum over prompts of the first of each pair over the second's (each a prompt's accepted per
    round under two settings), with a 95% bootstrap interval that resamples prompts."""
    rng = random.Random(0)
    resampled = sorted(
        _ratio([pairs[rng.randrange(len(pairs))] for _ in pairs]) for _ in range(draws)
    )
    return {
        "ratio": _ratio(pairs),
        "ci95": [resampled[int(0.025 * draws)], resampled[int(0.975 * draws) - 1]],
        "num_prompts": len(pairs),
    }


def _ratio(pairs: list[tuple[float, float]]) -> float:
    return sum(s for s, _ in pairs) / max(1e-9, sum(r for _, r in pairs))


def best_at_4x(x30: dict) -> dict | None:
    """The 4x (or 4-bit) compressor that accepts the most at x=30, and whether its interval lies
    above the runner-up's (whether the ranking is told apart from noise)."""
    at_4x = {
        label: cell
        for label, cell in x30.items()
        if label.endswith(("-4x", "-4bit")) and cell.get("mean") is not None
    }
    if not at_4x:
        return None
    ranked = sorted(at_4x, key=lambda label: at_4x[label]["mean"], reverse=True)
    best = at_4x[ranked[0]]
    record = {"label": ranked[0], "x30": best["mean"], "ci95": best["ci95"]}
    if len(ranked) > 1:
        runner_up = at_4x[ranked[1]]
        record["runner_up"] = ranked[1]
        intervals = best["ci95"] and runner_up["ci95"]
        record["separated"] = bool(intervals) and best["ci95"][0] > runner_up["ci95"][1]
    return record


def markdown(table: dict, draft_lens: list[int]) -> str:
    lines = []
    for source, kinds in table.items():
        lines.append(f"Mean accepted tokens per round, replayed (draft KV: {source}; 95% CI)\n")
        lines.append("| workload | compressor | " + " | ".join(f"x={x}" for x in draft_lens) + " |")
        lines.append("|---|---|" + "---|" * len(draft_lens))
        for kind, compressors in kinds.items():
            for label, cells in compressors.items():
                shown = " | ".join(_cell(cells.get(str(x))) for x in draft_lens)
                lines.append(f"| {kind} | {label} | {shown} |")
        lines.append("")
    return "\n".join(lines)


def _cell(cell: dict | None) -> str:
    if cell is None:
        return "-"
    if cell["ci95"] is None:
        return f"{cell['mean']:.1f}"
    low, high = cell["ci95"]
    return f"{cell['mean']:.1f} ({low:.1f}-{high:.1f})"


def plot(result: dict, path) -> None:
    """The run's figure: where it sampled in more than one way, each way side by side at x=30
    (`plot_samplings`); else accepted per round against draft length (`plot_draft_lengths`)."""
    table = result["table"][result["summary"]["draft_kv"]]
    labels = {label for compressors in table.values() for label in compressors}
    if len({label.partition(" ")[2] for label in labels}) > 1:
        plot_samplings(result, path)
    else:
        plot_draft_lengths(result, path)


def plot_samplings(result: dict, path, x: str = "30") -> None:
    """Accepted per round at x=30 with 95% intervals: a panel per workload kind, a group of bars
    per compressor, a bar per way of sampling (greedy, or a temperature with a coupling). Forty
    lines against the draft length are too many to read; this compares what the run is for."""
    plt = pyplot()
    table = result["table"][result["summary"]["draft_kv"]]
    labels = sorted({label for compressors in table.values() for label in compressors})
    compressors = list(dict.fromkeys(label.partition(" ")[0] for label in labels))
    samplings = list(dict.fromkeys(label.partition(" ")[2] for label in labels))
    width = 0.8 / len(samplings)
    fig, axes = plt.subplots(len(table), 1, figsize=(12, 3.2 * len(table)), squeeze=False)
    for axis, (kind, by_label) in zip(axes[:, 0], table.items()):
        for index, sampling in enumerate(samplings):
            cells = [by_label.get(f"{c} {sampling}".strip(), {}).get(x) for c in compressors]
            positions = [i + (index - (len(samplings) - 1) / 2) * width for i in range(len(cells))]
            shown = [(pos, cell) for pos, cell in zip(positions, cells) if cell is not None]
            axis.bar([pos for pos, _ in shown], [cell["mean"] for _, cell in shown], width,
                     yerr=[_half_width(cell) for _, cell in shown], capsize=2,
                     color=f"C{index % 10}", label=sampling or "greedy")  # fmt: skip
        axis.axhline(TARGET_X30, color="red", linestyle=":", linewidth=1)
        axis.set_xticks(range(len(compressors)), compressors, fontsize=8)
        axis.set(title=f"{kind}, x={x}", ylabel="accepted per round", ylim=(0, int(x) + 2))
    handles, names = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, names, fontsize=8, ncol=len(samplings), loc="upper center",
               bbox_to_anchor=(0.5, 0.97))  # fmt: skip
    fig.suptitle("accepted drafts per round at x=30 (replayed from first mismatches at x=64); "
                 "bars: 95% CI over prompts; dotted: the target", fontsize=9)  # fmt: skip
    fig.tight_layout(rect=(0, 0, 1, 0.94))
    fig.savefig(path, dpi=110)


def plot_draft_lengths(result: dict, path) -> None:
    """Accepted per round against draft length with 95% intervals: a column per workload kind, a
    row per strength (2x/4x/8x, i.e. 8/4/2 bits), a colour per compressor family and a line style
    and marker per way of sampling (greedy, or a temperature with a coupling)."""
    plt = pyplot()
    table = result["table"][result["summary"]["draft_kv"]]
    labels = sorted({label for compressors in table.values() for label in compressors})
    compressor_of = {label: label.partition(" ")[0] for label in labels}  # "snapkv-4x T=0.7 ..."
    rows = {
        name: [label for label in labels if compressor_of[label].endswith(suffixes)]
        for name, suffixes in STRENGTH_ROWS.items()
    }
    rows["other"] = [label for label in labels if not any(label in r for r in rows.values())]
    rows = {name: row for name, row in rows.items() if row}
    families = list(dict.fromkeys(compressor_of[label].rsplit("-", 1)[0] for label in labels))
    colors = {name: f"C{index % 10}" for index, name in enumerate(families)}
    samplings = list(dict.fromkeys(label.partition(" ")[2] for label in labels))
    styles = {s: _STYLES[i % len(_STYLES)] for i, s in enumerate(samplings)}
    fig, axes = plt.subplots(
        len(rows), len(table), figsize=(4.5 * len(table) + 2, 3.2 * len(rows)), squeeze=False
    )
    for axes_row, (strength, row_labels) in zip(axes, rows.items()):
        for axis, (kind, compressors) in zip(axes_row, table.items()):
            top = 1
            for label in row_labels:
                cells = compressors.get(label, {})
                xs = sorted(cells, key=int)
                means = [cells[x]["mean"] for x in xs]
                errors = [_half_width(cells[x]) for x in xs]
                color = colors[compressor_of[label].rsplit("-", 1)[0]]
                linestyle, marker = styles[label.partition(" ")[2]]
                axis.errorbar([int(x) for x in xs], means, yerr=errors, marker=marker,
                              linestyle=linestyle, color=color, label=label, capsize=2)  # fmt: skip
                top = max([top, *(int(x) for x in xs)])
            axis.plot([0, top], [0, top], color="grey", linestyle=":")
            axis.plot([30], [TARGET_X30], "r*", markersize=10)
            axis.set(title=f"{kind}, {strength}", xlabel="draft length x", ylim=(0, top + 2))
            axis.set_ylabel("accepted per round")
        axes_row[-1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.02, 0.5))
    fig.suptitle("replayed from first mismatches at x=64; bars: 95% CI over prompts; dotted: "
                 "every draft accepted; star: the target at x=30", fontsize=9)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# Line style and marker of each way of sampling, in the order the run lists them.
_STYLES = [("-", "o"), ("--", "s"), ("-.", "^"), ((0, (1, 1)), "v"), ((0, (5, 1)), "D")]


def _half_width(cell: dict) -> float:
    return 0.0 if cell["ci95"] is None else (cell["ci95"][1] - cell["ci95"][0]) / 2
