"""The acceptance benchmark's frontier: drafts accepted per round at x=30 against c, the draft KV's
share of the full KV's bytes (bench/acceptance.py `compressed_share`), and the summary keys read off
it: the most a configuration of c <= 1/8 (and <= 1/16) accepts per workload, and what the
verifier's steering adds to a compressor of c <= 1/8."""

from __future__ import annotations

import re
import statistics
from pathlib import Path

from vericache.bench.acceptance_report import (
    TARGET_KINDS,
    _half_width,
    mean_ci95,
    paired_ratio,
    prompt_mean,
    replays,
)
from vericache.bench.common import pyplot

X = "30"
# Today's best at 4x (bench/results/acceptance_4x.json, replayed in order), which c <= 1/8 is to
# match; each recorded round drawn alone, it read 24.9 and 24.4.
BEST_AT_4X = {"code": 25.1, "tools": 24.9}
AT_SIXTEENTH = 20.0  # what c <= 1/16 is to accept at least
STEERED = " steered/"
WHOLE = " whole/"  # a run in whole rounds of that many drafts, each verified whole


def base_label(label: str) -> str:
    """The compressor of a run's label ("snapkv-8x-bf16 steered/2 whole/30" ->
    "snapkv-8x-bf16")."""
    return label.partition(" ")[0]


def unsteered_label(label: str) -> str:
    """The label of the same run unsteered ("snapkv-8x-bf16 steered/2 whole/30" ->
    "snapkv-8x-bf16 whole/30")."""
    return re.sub(rf"{STEERED}\d+", "", label)


def frontier_summary(table: dict, shares: dict[str, float]) -> dict:
    """`table`: the run's replayed cells by kind and label (greedy); `shares`: c by compressor."""
    return {
        "best_accepted_at_c_1_8": _best_within(table, shares, 1 / 8),
        "best_accepted_at_c_1_16": _best_within(table, shares, 1 / 16),
        "steering_gain_at_c_1_8": _steering_gains(table, shares, 1 / 8),
    }


def _best_within(table: dict, shares: dict[str, float], largest_c: float) -> dict:
    """Per workload kind: the configuration (steered or not) of c <= largest_c that accepts the
    most at x=30, its mean, interval and c."""
    best = {}
    for kind in TARGET_KINDS:
        cells = {
            label: by_x[X]
            for label, by_x in table.get(kind, {}).items()
            if X in by_x and shares.get(base_label(label), 1.0) <= largest_c
        }
        if cells:
            label = max(cells, key=lambda name: cells[name]["mean"])
            best[kind] = {
                "label": label, "mean": cells[label]["mean"], "ci95": cells[label]["ci95"],
                "c": shares[base_label(label)],
            }  # fmt: skip
    return best


def _steering_gains(table: dict, shares: dict[str, float], largest_c: float) -> dict:
    """Per workload kind and steered compressor of c <= largest_c: its accepted per round at x=30
    over the same compressor's unsteered."""
    gains = {}
    for kind in TARGET_KINDS:
        cells = table.get(kind, {})
        for label, by_x in cells.items():
            plain = cells.get(unsteered_label(label), {}).get(X)
            if STEERED not in label or X not in by_x or not plain or plain["mean"] <= 0:
                continue
            if shares.get(base_label(label), 1.0) <= largest_c:
                gains.setdefault(kind, {})[label] = by_x[X]["mean"] / plain["mean"]
    return gains


def paired_steering_gains(records: list[dict], shares: dict[str, float], largest_c: float) -> dict:
    """Per workload kind and steered run of c <= largest_c: its accepted per round at x=30 over
    the same run's unsteered, prompt by prompt (the same prompts, in the run's order), with a 95%
    bootstrap interval over prompts."""
    by_label: dict[str, list[dict]] = {}
    for record in records:
        by_label.setdefault(record["compressor"], []).append(record)
    gains: dict = {}
    for label, steered in by_label.items():
        plain = by_label.get(unsteered_label(label))
        if STEERED not in label or plain is None or shares.get(base_label(label), 1.0) > largest_c:
            continue
        for kind in TARGET_KINDS:
            pairs = [
                (prompt_mean(one, int(X)), prompt_mean(other, int(X)))
                for one, other in zip(steered, plain)
                if one["kind"] == kind and one["first_mismatch"] and other["first_mismatch"]
                and replays(one, int(X)) and replays(other, int(X))
            ]  # fmt: skip
            if pairs:
                gains.setdefault(kind, {})[label] = paired_ratio(pairs)
    return gains


def refresh_shares(records: list[dict]) -> dict:
    """Per steered run and workload kind: the share of its kept set's entries a refresh replaces,
    the mean over prompts of each prompt's mean over its refreshes, with a 95% interval."""
    shares: dict = {}
    for record in records:
        changed = record.get("changed_per_refresh")
        if changed:
            share = statistics.fmean(changed) / record["kept_entries"]
            shares.setdefault(record["compressor"], {}).setdefault(record["kind"], []).append(share)
    return {
        label: {
            kind: dict(zip(("mean", "ci95"), mean_ci95(values))) for kind, values in kinds.items()
        }
        for label, kinds in shares.items()
    }


def plot_frontier(result: dict, path: Path) -> None:
    """Accepted per round at x=30 against c, a panel per workload kind, a point per configuration
    with its 95% interval (steered: hollow), c = 1/8 and 1/16 marked, and the targets."""
    plt = pyplot()
    table = result["table"][result["summary"]["draft_kv"]]
    shares = result["c"]
    kinds = [kind for kind in TARGET_KINDS if kind in table]
    fig, axes = plt.subplots(1, len(kinds), figsize=(6 * len(kinds), 4.2), squeeze=False)
    for axis, kind in zip(axes[0], kinds):
        bases = sorted({base_label(label) for label in table[kind]})
        for label, by_x in sorted(table[kind].items()):
            if X not in by_x or base_label(label) not in shares:
                continue
            color = f"C{bases.index(base_label(label)) % 10}"  # a compressor's, steered or not
            axis.errorbar(
                [shares[base_label(label)]], [by_x[X]["mean"]], yerr=[_half_width(by_x[X])],
                marker="o", markerfacecolor="none" if STEERED in label else color, color=color,
                capsize=2, label=label, linestyle="none",
            )  # fmt: skip
        for c in (1 / 8, 1 / 16):
            axis.axvline(c, color="grey", linestyle=":", linewidth=1)
        axis.axhline(BEST_AT_4X[kind], color="red", linestyle="--", linewidth=1)
        axis.axhline(AT_SIXTEENTH, color="red", linestyle=":", linewidth=1)
        axis.set(title=kind, xlabel="c (draft KV bytes / full KV bytes)", xscale="log",
                 ylabel=f"accepted per round, x={X}", ylim=(0, int(X) + 1))  # fmt: skip
        axis.legend(fontsize=7)
    title = ("dotted verticals: c = 1/16, 1/8; dashed: today's best at 4x; dotted: 20 (the target "
             "at 1/16); bars: 95% CI over prompts; hollow: steered")  # fmt: skip
    fig.suptitle(title, fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.94))
    fig.savefig(path, dpi=110)
