"""How often each coupling of sampled drafts can keep a draft, from the model's own distributions:
what bounds seeded coupling's accepted tokens per round against rejection coupling's.

Along each prompt's full-KV sample (seeded, at `--temperature`), every position's target
distribution p (full KV) and draft distribution q (the compressed KV, with the exact KV of every
token before the position appended, as the verifier hands it to the drafter) are computed, after
the same temperature. Then, per position:
- rejection coupling keeps a draft with probability sum(min(p, q)) = 1 - TV(p, q), exactly: the
  most any coupling of q-drafts with p-tokens can keep (the coupling inequality);
- seeded coupling (argmax(log p + g) against argmax(log q + g), one Gumbel noise g) keeps it with
  probability P(both argmaxes agree), estimated here with `--noise-draws` noise draws. It needs
  no communication between drafter and verifier, which is what makes vericache's output the
  full-KV sample: such a coupling cannot keep more than (1 - TV) / (1 + TV) for every pair of
  distributions at that distance, and Gumbel-max meets that bound (Daliri, Musco and Suresh,
  "Coupling without communication and drafter-invariant speculative decoding", 2024).
Accepted drafts per round at draft length x follow from the per-position rates, each position
treated as independent: a round from position s keeps sum over m <= x of prod over i < m of the
rate at s + i. A per-position gap compounds over a round: rates of 0.95 and 0.90 keep 14.9 and
8.6 drafts per round at x=30 (a ratio of 0.58), so a ratio target per round is a target on how
close the two rates are where drafts are good.
"""

from __future__ import annotations

import statistics

import torch

from vericache.bench.acceptance import _prompts
from vericache.bench.common import (
    compressor_from_label,
    compressor_labels,
    environment,
    progress,
    pyplot,
)
from vericache.engine.engine import Engine, EngineConfig
from vericache.engine.prefill import id_tensor
from vericache.engine.request import DecodeMode, Request, SamplingParams
from vericache.engine.sampling import processed_logits
from vericache.kv.exact import ExactKV
from vericache.model.loader import DEFAULT_MODEL

SUPPORT_FLOOR = 1e-9  # tokens below this in both p and q are left out of the noise draws


def add_arguments(parser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--compressors", default="snapkv-4x,streamingllm-4x")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--prompts-per-kind", type=int, help="code and tool prompts (10; quick 1)")
    parser.add_argument("--max-tokens", type=int, help="output tokens per prompt (128; quick 24)")
    parser.add_argument("--draft-len", type=int, default=30, help="x of the per-round figures")
    parser.add_argument("--noise-draws", type=int, default=512, help="per position")


def run(args) -> dict:
    max_tokens = args.max_tokens or (24 if args.quick else 128)
    per_kind = args.prompts_per_kind or (1 if args.quick else 10)
    engine = Engine.from_pretrained(args.model, config=EngineConfig(prefix_cache_bytes=16 << 30))
    prompts = [p for p in _prompts(engine.tokenizer, args.quick, per_kind) if p[0] != "math"]
    params = [
        SamplingParams(max_new_tokens=max_tokens, temperature=args.temperature, seed=seed)
        for seed in range(len(prompts))
    ]
    outputs = engine.generate(
        [Request(p.token_ids, p.num_prefix_tokens, params[i], DecodeMode.FULL)
         for i, (*_, p) in enumerate(prompts)]
    )  # fmt: skip
    generator = torch.Generator().manual_seed(0)
    rows = []
    for label in compressor_labels(args.compressors):
        compressor = compressor_from_label(label)
        for (kind, name, prompt), out, p in progress(
            list(zip(prompts, outputs, params)), label, unit="prompt"
        ):
            target, draft = _distributions(engine, prompt, compressor, out.token_ids, p)
            rates = _rates(target, draft, args.noise_draws, generator)
            rows.append({"kind": kind, "workload": name, "compressor": label, **rates})
    return _result(rows, args, max_tokens, len(prompts))


def _distributions(engine: Engine, prompt, compressor, output_ids, params):
    """p and q [n, V] float32 at each of the n output positions, after the temperature."""
    split = min(prompt.num_prefix_tokens, len(prompt.token_ids) - 1)
    prefix, suffix = prompt.token_ids[:split], prompt.token_ids[split:]
    fed = list(suffix) + list(output_ids[:-1])  # what predicts each output token
    full = engine.prefix_kv(prefix).clone(len(fed))
    target = engine.runner.prefill(id_tensor(fed), full, num_logits=len(output_ids))
    draft_cache = engine.compressed_prefix_kv(prefix, compressor).clone(len(fed))
    draft_cache.append_exact(ExactKV.of(full, split, len(prompt.token_ids) - 1))
    compressor.update(draft_cache)
    draft, sequence = [], list(prompt.token_ids) + list(output_ids)
    for position in range(len(prompt.token_ids) - 1, len(sequence) - 1):
        token = sequence[position]
        draft.append(engine.runner.prefill(id_tensor([token]), draft_cache, num_logits=1))
        draft_cache.truncate(draft_cache.num_tokens - 1)  # the drafter's own KV of it, replaced
        draft_cache.append_exact(ExactKV.of(full, position, position + 1))  # by the exact one
        compressor.update(draft_cache)
    return (
        processed_logits(target, params).softmax(-1),
        processed_logits(torch.cat(draft), params).softmax(-1),
    )


def _rates(p: torch.Tensor, q: torch.Tensor, draws: int, generator) -> dict:
    """Per position: TV(p, q), rejection coupling's keep rate, seeded coupling's (estimated)."""
    tv = 0.5 * (p - q).abs().sum(-1)
    seeded = []
    for p_row, q_row in zip(p, q):
        support = (p_row > SUPPORT_FLOOR) | (q_row > SUPPORT_FLOOR)
        log_p, log_q = p_row[support].log(), q_row[support].log()
        uniform = torch.rand((draws, log_p.numel()), generator=generator).clamp_(1e-12, 1 - 1e-12)
        noise = -torch.log(-torch.log(uniform))
        agree = (log_p + noise).argmax(-1) == (log_q + noise).argmax(-1)
        seeded.append(agree.float().mean().item())
    return {"tv": tv.tolist(), "rejection": (1 - tv).tolist(), "seeded": seeded}


def per_round(rates: list[float], x: int) -> float:
    """Mean accepted drafts per round of length x over the round's start positions, positions
    independent (see the module's docstring)."""
    kept = []
    for start in range(max(1, len(rates) - x + 1)):
        run, total = 1.0, 0.0
        for rate in rates[start : start + x]:
            run *= rate
            total += run
        kept.append(total)
    return statistics.fmean(kept)


def _result(rows: list[dict], args, max_tokens: int, num_prompts: int) -> dict:
    table, ratios = {}, []
    x = args.draft_len
    for label in compressor_labels(args.compressors):
        for kind in ("code", "tools"):
            cell = [r for r in rows if r["compressor"] == label and r["kind"] == kind]
            if not cell:
                continue
            rejection = statistics.fmean(per_round(r["rejection"], x) for r in cell)
            seeded = statistics.fmean(per_round(r["seeded"], x) for r in cell)
            tv = [value for r in cell for value in r["tv"]]
            table[f"{label} {kind}"] = {
                "mean_tv": statistics.fmean(tv),
                "rejection_keep_rate": statistics.fmean(v for r in cell for v in r["rejection"]),
                "seeded_keep_rate": statistics.fmean(v for r in cell for v in r["seeded"]),
                "communication_free_bound": statistics.fmean((1 - d) / (1 + d) for d in tv),
                f"rejection_x{x}": rejection,
                f"seeded_x{x}": seeded,
                f"seeded_over_rejection_x{x}": seeded / rejection,
            }
            ratios.append(seeded / rejection)
    return {
        "benchmark": "coupling",
        "summary": {f"seeded_over_rejection_x{x}_least": min(ratios), "cells": table},
        "definitions": DEFINITIONS,
        "config": {
            "model": args.model,
            "temperature": args.temperature,
            "draft_len": x,
            "max_tokens": max_tokens,
            "num_prompts": num_prompts,
            "noise_draws": args.noise_draws,
            "quick": args.quick,
        },  # fmt: skip
        "environment": environment(),
        "records": rows,
    }


DEFINITIONS = {
    "mean_tv": "total variation distance between full-KV p and compressed-KV q per position",
    "rejection_keep_rate": "sum(min(p, q)): rejection coupling's chance of keeping a draft",
    "seeded_keep_rate": "P(argmax(log p + g) == argmax(log q + g)), Gumbel g: seeded coupling's",
    "communication_free_bound": "(1 - TV) / (1 + TV): what a coupling without communication can "
    "guarantee at that distance, and Gumbel-max guarantees",
    "rejection_x": "accepted drafts per round at x from the rejection keep rates, positions "
    "independent",
    "seeded_x": "likewise from the seeded keep rates",
}


def plot(result: dict, path) -> None:
    plt = pyplot()
    cells = result["summary"]["cells"]
    x = result["config"]["draft_len"]
    labels = list(cells)
    fig, (rates, rounds) = plt.subplots(1, 2, figsize=(13, 4.5))
    positions = range(len(labels))
    bars = [("rejection_keep_rate", "rejection", "tab:blue"),
            ("seeded_keep_rate", "seeded", "tab:orange"),
            ("communication_free_bound", "(1 - TV) / (1 + TV)", "tab:grey")]  # fmt: skip
    for offset, (key, name, color) in zip((-0.27, 0, 0.27), bars):
        rates.bar([p + offset for p in positions], [cells[c][key] for c in labels], width=0.27,
                  color=color, label=name)  # fmt: skip
    rates.set_ylabel("chance a draft is kept, mean over positions")
    lowest = min(cells[c]["communication_free_bound"] for c in labels)
    rates.set_ylim(max(0.0, lowest - 0.05), 1)  # the rates differ in their last hundredths
    for offset, key, name, color in ((-0.2, f"rejection_x{x}", "rejection", "tab:blue"),
                                     (0.2, f"seeded_x{x}", "seeded", "tab:orange")):  # fmt: skip
        rounds.bar([p + offset for p in positions], [cells[c][key] for c in labels], width=0.4,
                   color=color, label=name)  # fmt: skip
    rounds.set_ylabel(f"accepted drafts per round at x={x}, from the rates")
    for axis in (rates, rounds):
        axis.set_xticks(list(positions), labels, rotation=20, ha="right")
        axis.legend(loc="lower left")
    temperature = result["config"]["temperature"]
    fig.suptitle(f"Seeded against rejection coupling at T={temperature:g}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
