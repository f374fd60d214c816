"""Accepted draft tokens per round, by compressor and draft length, on real long contexts.

Code: Python standard-library modules of 3-4k tokens as the context, a HumanEval prompt and a
question about the module. Tools: BFCL function catalogues of 3k+ tokens, BFCL questions. Math:
short word problems. Every registered compressor at 2x/4x/8x (8/4/2 bits) by default. Every
vericache output is also checked against full-KV decoding of the same prompt.

The headline metric counts rounds that drafted the full x tokens (a round cut short by the token
budget or an end token drafts fewer and would bias the mean down); all rounds are reported too.
"""

from __future__ import annotations

from collections import defaultdict

from vericache.bench.common import (
    compressor_from_label,
    compressor_labels,
    environment,
    int_list,
    progress,
    pyplot,
)
from vericache.bench.workloads import standard_workloads
from vericache.engine.engine import DraftKVSource, Engine, EngineConfig
from vericache.engine.prompt import build_chat_prompt
from vericache.engine.request import DecodeMode, Request, SamplingParams
from vericache.model.loader import DEFAULT_MODEL

TARGET_X30 = 20.0
TARGET_KINDS = ("code", "tools")


def add_arguments(parser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument(
        "--compressors",
        help="comma-separated labels, `all` (default: every compressor at 2x/4x/8x) or `all-4x` "
        "(the default when quick)",
    )
    parser.add_argument("--draft-lens", type=int_list, default=[10, 20, 30, 40])
    parser.add_argument("--max-tokens", type=int, help="output tokens per request (128; quick 64)")
    parser.add_argument("--draft-kv", choices=["verifier", "drafter", "both"], default="verifier")
    parser.add_argument("--batch-size", type=int, default=8, help="requests decoded together")
    parser.add_argument(
        "--dtype",
        default="float32",
        help="model dtype; outputs are bit-exact in float32, and "
        "the identity rate with full decoding is reported for bfloat16/float16",
    )


def run(args) -> dict:
    max_tokens = args.max_tokens or (64 if args.quick else 128)
    labels = compressor_labels(args.compressors or ("all-4x" if args.quick else "all"))
    compressors = [compressor_from_label(label) for label in labels]
    engine = Engine.from_pretrained(
        args.model, dtype=args.dtype, config=EngineConfig(prefix_cache_bytes=16 << 30)
    )
    prompts = _prompts(engine.tokenizer, args.quick)
    params = SamplingParams(max_new_tokens=max_tokens)
    references = engine.generate(
        [Request(p.token_ids, p.num_prefix_tokens, params, DecodeMode.FULL) for _, p in prompts]
    )
    sources = list(DraftKVSource) if args.draft_kv == "both" else [DraftKVSource(args.draft_kv)]
    records = []
    for source in sources:
        config = EngineConfig(draft_kv_source=source, prefix_cache_bytes=16 << 30)
        engine = Engine(engine.runner, engine.tokenizer, config, engine.prefix_store)
        for draft_len in args.draft_lens:
            batch = [
                (
                    kind,
                    compressor,
                    reference,
                    Request(
                        prompt.token_ids,
                        prompt.num_prefix_tokens,
                        params,
                        DecodeMode.VERICACHE,
                        compressor,
                        draft_len,
                    ),
                )
                for (kind, prompt), reference in zip(prompts, references)
                for compressor in compressors
            ]
            outputs = []
            chunks = range(0, len(batch), args.batch_size)
            description = f"{source.value} KV, x={draft_len}"
            for start in progress(chunks, description, unit="batch"):
                chunk = batch[start : start + args.batch_size]
                outputs += engine.generate([request for *_, request in chunk])
            for (kind, compressor, reference, _), out in zip(batch, outputs):
                records.append(
                    {
                        "kind": kind,
                        "compressor": compressor.label,
                        "draft_len": draft_len,
                        "draft_kv": source.value,
                        "identical": out.token_ids == reference.token_ids,
                        "drafted_per_round": out.stats.drafted_per_round,
                        "accepted_per_round": out.stats.accepted_per_round,
                    }
                )
            print(f"[acceptance] draft_kv={source.value} x={draft_len}: {len(batch)} requests done")
    return _result(records, labels, args, max_tokens, len(prompts))


def _prompts(tokenizer, quick: bool):
    return [
        (workload.kind, build_chat_prompt(tokenizer, workload.context, prompt))
        for workload in standard_workloads(tokenizer, quick)
        for prompt in workload.prompts
    ]


def _aggregate(records: list[dict]) -> dict:
    """Per (draft_kv, kind, compressor, x): accepted per full round, per round, acceptance rate."""
    groups = defaultdict(list)
    for record in records:
        groups[
            record["draft_kv"], record["kind"], record["compressor"], record["draft_len"]
        ].append(record)
    table = {}
    for (source, kind, label, draft_len), group in sorted(groups.items()):
        drafted = [d for r in group for d in r["drafted_per_round"]]
        accepted = [a for r in group for a in r["accepted_per_round"]]
        full_rounds = [a for d, a in zip(drafted, accepted) if d == draft_len]
        table.setdefault(source, {}).setdefault(kind, {}).setdefault(label, {})[draft_len] = {
            "mean_accepted_per_full_round": _mean(full_rounds),
            "mean_accepted_per_round": _mean(accepted),
            "acceptance_rate": sum(accepted) / sum(drafted) if sum(drafted) else None,
            "num_full_rounds": len(full_rounds),
            "num_rounds": len(accepted),
        }
    return table


def _mean(values):
    return sum(values) / len(values) if values else None


def _result(records, labels, args, max_tokens, num_prompts) -> dict:
    table = _aggregate(records)
    default = (
        DraftKVSource.VERIFIER.value if DraftKVSource.VERIFIER.value in table else args.draft_kv
    )

    def at_x30(source, kind):
        cells = table[source].get(kind, {})
        return {
            label: cells[label][30]["mean_accepted_per_full_round"]
            for label in labels
            if 30 in cells.get(label, {})
        }

    x30 = at_x30(default, "code")
    best = {kind: _best_at_4x(at_x30(default, kind)) for kind in TARGET_KINDS}
    summary = {
        "x30": x30,
        "x30_tools": at_x30(default, "tools"),
        "x30_math": at_x30(default, "math"),
        "best_4x_x30": best,
        "identical": all(record["identical"] for record in records),
        "identical_rate": sum(record["identical"] for record in records) / len(records),
        "dtype": args.dtype,
        "draft_kv": default,
        "meets_target": _meets_target(best),
    }
    if len(table) > 1:
        summary["x30_by_draft_kv"] = {source: at_x30(source, "code") for source in table}
    return {
        "benchmark": "acceptance",
        "summary": summary,
        "definitions": {
            "x30": "mean accepted draft tokens per round that drafted 30 tokens, code contexts",
            "best_4x_x30": "per workload kind, the 4x (4-bit) compressor with the most x30",
            "target": f"best_4x_x30 >= {TARGET_X30:g} on code and on tools (3k+ token contexts)",
        },
        "config": {
            "max_tokens": max_tokens,
            "num_prompts": num_prompts,
            "quick": args.quick,
            "draft_lens": args.draft_lens,
            "model": args.model,
            "dtype": args.dtype,
        },
        "environment": environment(),
        "table": table,
        "table_markdown": _markdown(table, args.draft_lens),
        "records": records,
    }


def _best_at_4x(x30: dict) -> dict | None:
    """{label, x30} of the 4x (or 4-bit) compressor that accepts the most at x=30."""
    at_4x = {
        label: value
        for label, value in x30.items()
        if value is not None and label.endswith(("-4x", "-4bit"))
    }
    if not at_4x:
        return None
    label = max(at_4x, key=at_4x.get)
    return {"label": label, "x30": at_4x[label]}


def _meets_target(best: dict) -> bool | None:
    """None when the run did not measure a 4x compressor at x=30 on both kinds."""
    if any(best[kind] is None for kind in TARGET_KINDS):
        return None
    return all(best[kind]["x30"] >= TARGET_X30 for kind in TARGET_KINDS)


def _markdown(table: dict, draft_lens: list[int]) -> str:
    lines = []
    for source, kinds in table.items():
        lines.append(f"Mean accepted tokens per full round (draft KV: {source})\n")
        lines.append("| workload | compressor | " + " | ".join(f"x={x}" for x in draft_lens) + " |")
        lines.append("|---|---|" + "---|" * len(draft_lens))
        for kind, compressors in kinds.items():
            for label, cells in compressors.items():
                values = [cells.get(x, {}).get("mean_accepted_per_full_round") for x in draft_lens]
                shown = " | ".join("-" if v is None else f"{v:.1f}" for v in values)
                lines.append(f"| {kind} | {label} | {shown} |")
        lines.append("")
    return "\n".join(lines)


STRENGTH_ROWS = {"2x": ("-2x", "-8bit"), "4x": ("-4x", "-4bit"), "8x": ("-8x", "-2bit")}


def plot(result: dict, path) -> None:
    """Accepted per round against draft length: a column per workload kind, a row per strength
    (2x/4x/8x, i.e. 8/4/2 bits), a line per compressor; labels of other strengths get a row too."""
    plt = pyplot()
    table = result["table"][result["summary"]["draft_kv"]]
    labels = sorted({label for compressors in table.values() for label in compressors})
    rows = {
        name: [label for label in labels if label.endswith(suffixes)]
        for name, suffixes in STRENGTH_ROWS.items()
    }
    rows["other"] = [label for label in labels if not any(label in r for r in rows.values())]
    rows = {name: row for name, row in rows.items() if row}
    colors = {label.rsplit("-", 1)[0]: None for label in labels}
    colors = {name: f"C{index % 10}" for index, name in enumerate(colors)}
    fig, axes = plt.subplots(
        len(rows), len(table), figsize=(4.5 * len(table) + 2, 3.2 * len(rows)), squeeze=False
    )
    for axes_row, (strength, row_labels) in zip(axes, rows.items()):
        for axis, (kind, compressors) in zip(axes_row, table.items()):
            for label in row_labels:
                cells = compressors.get(label, {})
                xs = sorted(cells, key=int)
                values = [cells[x]["mean_accepted_per_full_round"] for x in xs]
                color = colors[label.rsplit("-", 1)[0]]
                axis.plot([int(x) for x in xs], values, marker="o", color=color, label=label)
            top = max(int(x) for cells in compressors.values() for x in cells)
            axis.plot([0, top], [0, top], color="grey", linestyle=":")
            axis.plot([30], [TARGET_X30], "r*", markersize=10)
            axis.set(title=f"{kind}, {strength}", xlabel="draft length x", ylim=(0, top + 2))
            axis.set_ylabel("accepted per round")
        axes_row[-1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.02, 0.5))
    fig.suptitle("dotted: every draft accepted; star: the target at x=30", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
