"""Sampled acceptance by coupling: how seeded coupling's accepted drafts per round at x=30 compare
with rejection coupling's, per temperature (bench/acceptance.py runs both where asked)."""

from __future__ import annotations

from vericache.bench.acceptance_report import TARGET_KINDS, paired_ratio, prompt_mean

SEEDED_OVER_REJECTION = 0.75  # seeded coupling's accepted per round over rejection's, at T=0.7


def seeded_over_rejection(table: dict, labels: list[str]) -> dict:
    """Per temperature sampled with both couplings: the least, over the 4x compressors and the
    code and tool kinds, of seeded coupling's accepted per round at x=30 over rejection
    coupling's (target: at least SEEDED_OVER_REJECTION at T=0.7)."""
    ratios: dict[str, list[float]] = {}
    for kind in TARGET_KINDS:
        cells = table.get(kind, {})
        for label in labels:
            for seeded_label, cell in cells.items():
                prefix = f"{label} T="
                if not (seeded_label.startswith(prefix) and seeded_label.endswith(" seeded")):
                    continue
                temperature = seeded_label[len(prefix) : -len(" seeded")]
                rejection = cells.get(f"{label} T={temperature} rejection", {}).get("30")
                if rejection and rejection["mean"] > 0 and "30" in cell:
                    ratio = cell["30"]["mean"] / rejection["mean"]
                    ratios.setdefault(temperature, []).append(ratio)
    return {temperature: min(values) for temperature, values in ratios.items()}


def pooled_seeded_over_rejection(
    records: list[dict], labels: list[str], x: int = 30, draws: int = 2000
) -> dict:
    """Per temperature sampled with both couplings: the sum over prompts of seeded coupling's
    per-prompt accepted per round at x over rejection coupling's, over the 4x compressors and
    the code and tool kinds; its interval resamples prompts (a prompt's two couplings together:
    the same prompt and seed)."""
    by_label: dict[str, list[dict]] = {}
    for record in records:
        if record["kind"] in TARGET_KINDS:
            by_label.setdefault(record["compressor"], []).append(record)
    pooled = {}
    for temperature in sorted({r.get("temperature") for r in records if r.get("temperature")}):
        pairs = []  # (seeded, rejection) per prompt
        for label in labels:
            seeded = by_label.get(f"{label} T={temperature:g} seeded", [])
            rejection = by_label.get(f"{label} T={temperature:g} rejection", [])
            for one, other in zip(seeded, rejection):  # prompt by prompt, in the run's order
                if one["first_mismatch"] and other["first_mismatch"]:
                    pairs.append((prompt_mean(one, x), prompt_mean(other, x)))
        if pairs:
            pooled[f"{temperature:g}"] = paired_ratio(pairs, draws)
    return pooled
