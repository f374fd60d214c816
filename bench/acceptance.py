"""Accepted draft tokens per round, by compressor and draft length, on real long contexts,
recorded as traces the simulator replays.

Workloads: code (Python standard-library modules of 3-4k tokens, each asked a HumanEval prompt and a
question about the module), tools (BFCL function catalogues of 3k+ tokens, BFCL questions), math
(short word problems). `--prompts-per-kind` (20) code and tool prompts; the math set has 8.

Every request decodes `--max-tokens` (256) tokens at x = 64, the longest draft the simulator
replays, and every round records the position of its first draft that the full KV rejects (64 when
none is): a round at any x <= 64 would have accepted min(first mismatch, x), since the drafts before
the first mismatch do not depend on how many follow. A round cut short (by the token budget or an
end token) with every draft accepted tells no first mismatch and is left out. Each record also keeps
the prompt kind, the compressor and its ratio or bits, and the context length. Since the full-KV
output is decoded first (the reference), a round drafts only up to its first rejected draft: the
drafts after it would be thrown away, and skipping them makes the run two to three times cheaper
without changing a trace. The table replays the traces at every x of `--draft-lens`: the mean
accepted per round and its 95% confidence interval over prompts (a prompt's rounds are not
independent of each other, its mean is). Every vericache output is also checked against full-KV
decoding.
"""

from __future__ import annotations

import json
from pathlib import Path

from vericache.bench.acceptance_report import (  # noqa: F401 - plot: the CLI's
    TARGET_KINDS,
    TARGET_X30,
    best_at_4x,
    markdown,
    plot,
    replay_table,
)
from vericache.bench.common import (
    compressor_from_label,
    compressor_labels,
    environment,
    int_list,
    progress,
)
from vericache.bench.workloads import standard_workloads
from vericache.engine.engine import DraftKVSource, Engine, EngineConfig
from vericache.engine.prompt import build_chat_prompt
from vericache.engine.request import DecodeMode, Request, SamplingParams
from vericache.model.loader import DEFAULT_MODEL
from vericache.sim.workload import MAX_DRAFT_LEN, first_mismatches


def add_arguments(parser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument(
        "--compressors", help="comma-separated labels, `all-4x` (default) or `all` (2x/4x/8x)"
    )
    parser.add_argument("--draft-lens", type=int_list, default=[10, 20, 30, 40, 64])
    parser.add_argument("--max-tokens", type=int, help="output tokens per request (256; quick 64)")
    parser.add_argument("--prompts-per-kind", type=int, help="code and tool prompts (20; quick 2)")
    parser.add_argument("--draft-kv", choices=["verifier", "drafter", "both"], default="verifier")
    parser.add_argument("--batch-size", type=int, default=8, help="requests decoded together")
    parser.add_argument(
        "--checkpoint",
        type=Path,
        help="a JSON-lines file of finished compressors' records: a run appends each compressor's "
        "as it finishes, and a run given the file again skips them (same settings)",
    )
    parser.add_argument(
        "--dtype",
        default="float32",
        help="model dtype; outputs are bit-exact in float32, and "
        "the identity rate with full decoding is reported for bfloat16/float16",
    )


def run(args) -> dict:
    max_tokens = args.max_tokens or (64 if args.quick else 256)
    per_kind = args.prompts_per_kind or (2 if args.quick else 20)
    labels = compressor_labels(args.compressors or "all-4x")
    compressors = [compressor_from_label(label) for label in labels]
    engine = Engine.from_pretrained(
        args.model, dtype=args.dtype, config=EngineConfig(prefix_cache_bytes=16 << 30)
    )
    prompts = _prompts(engine.tokenizer, args.quick, per_kind)
    params = SamplingParams(max_new_tokens=max_tokens)
    references = engine.generate(
        [Request(p.token_ids, p.num_prefix_tokens, params, DecodeMode.FULL) for *_, p in prompts]
    )
    sources = list(DraftKVSource) if args.draft_kv == "both" else [DraftKVSource(args.draft_kv)]
    settings = {"max_tokens": max_tokens, "num_prompts": len(prompts), "model": args.model,
                "dtype": args.dtype}  # fmt: skip
    checkpoint = Checkpoint(args.checkpoint, settings)
    records = []
    for source in sources:
        config = EngineConfig(draft_kv_source=source, prefix_cache_bytes=16 << 30)
        engine = Engine(engine.runner, engine.tokenizer, config, engine.prefix_store)
        for compressor in compressors:
            done = checkpoint.records(compressor.label, source.value)
            if done is None:
                done = _traces(engine, compressor, source, prompts, references, params, args)
                checkpoint.add(compressor.label, source.value, done)
            records += done
            print(f"[acceptance] {compressor.label}, draft_kv={source.value}: done")
    return _result(records, labels, args, max_tokens, len(prompts))


def _traces(engine, compressor, source, prompts, references, params, args) -> list[dict]:
    """Every prompt decoded with drafts over `compressor`: one trace record each."""
    outputs = []
    chunks = range(0, len(prompts), args.batch_size)
    for start in progress(chunks, f"{compressor.label}, x={MAX_DRAFT_LEN}", unit="batch"):
        chunk = zip(prompts[start : start + args.batch_size], references[start:])
        requests = [
            _request(compressor, prompt, reference, params) for (*_, prompt), reference in chunk
        ]
        outputs += engine.generate(requests)
    records = []
    for (kind, name, prompt), reference, out in zip(prompts, references, outputs):
        record = trace_record(kind, name, compressor, out.stats, source.value)
        record["identical"] = out.token_ids == reference.token_ids
        record["context_tokens"] = prompt.num_prefix_tokens
        records.append(record)
    return records


class Checkpoint:
    """Finished compressors' records in a JSON-lines file (one line per compressor and draft KV
    source, with the run's settings): a long run that stops keeps what it finished."""

    def __init__(self, path: Path | None, settings: dict):
        self.path, self.settings = path, settings
        self._done: dict[tuple[str, str], list[dict]] = {}
        if path is not None and path.is_file():
            for line in path.read_text().splitlines():
                entry = json.loads(line)
                if entry["settings"] != settings:
                    raise ValueError(
                        f"{path} holds records of other settings ({entry['settings']}): "
                        "give another checkpoint file"
                    )
                self._done[entry["compressor"], entry["draft_kv"]] = entry["records"]

    def records(self, label: str, draft_kv: str) -> list[dict] | None:
        return self._done.get((label, draft_kv))

    def add(self, label: str, draft_kv: str, records: list[dict]) -> None:
        self._done[label, draft_kv] = records
        if self.path is not None:
            entry = {"settings": self.settings, "compressor": label, "draft_kv": draft_kv,
                     "records": records}  # fmt: skip
            with self.path.open("a") as file:
                file.write(json.dumps(entry) + "\n")


def _request(compressor, prompt, reference, params: SamplingParams) -> Request:
    """A round stops drafting after its first draft the reference rejects (expected_ids): it
    commits the same tokens and tells the same first mismatch as one that drafts all 64."""
    return Request(
        prompt.token_ids, prompt.num_prefix_tokens, params, DecodeMode.VERICACHE, compressor,
        MAX_DRAFT_LEN, expected_ids=tuple(reference.token_ids),
    )  # fmt: skip


def _prompts(tokenizer, quick: bool, per_kind: int):
    """(kind, workload name, prompt ids) of every prompt."""
    return [
        (workload.kind, workload.name, build_chat_prompt(tokenizer, workload.context, prompt))
        for workload in standard_workloads(tokenizer, quick, per_kind)
        for prompt in workload.prompts
    ]


def trace_record(kind: str, workload: str, compressor, stats, draft_kv: str) -> dict:
    params = compressor.spec()["params"]
    return {
        "kind": kind,
        "workload": workload,
        "compressor": compressor.label,
        "ratio": params.get("ratio"),
        "bits": params.get("bits"),
        "draft_kv": draft_kv,
        "drafted_per_round": stats.drafted_per_round,
        "accepted_per_round": stats.accepted_per_round,
        "first_mismatch": first_mismatches(
            stats.drafted_per_round, stats.accepted_per_round, MAX_DRAFT_LEN
        ),
    }


def _result(records, labels, args, max_tokens, num_prompts) -> dict:
    table = replay_table(records, args.draft_lens)
    default = (
        DraftKVSource.VERIFIER.value if DraftKVSource.VERIFIER.value in table else args.draft_kv
    )

    def at_x30(kind):
        cells = table[default].get(kind, {})
        return {label: cells[label]["30"] for label in labels if "30" in cells.get(label, {})}

    best = {kind: best_at_4x(at_x30(kind)) for kind in TARGET_KINDS}
    summary = {
        "x30": {label: cell["mean"] for label, cell in at_x30("code").items()},
        "x30_tools": {label: cell["mean"] for label, cell in at_x30("tools").items()},
        "x30_math": {label: cell["mean"] for label, cell in at_x30("math").items()},
        "best_4x_x30": best,
        "identical": all(record["identical"] for record in records),
        "identical_rate": sum(record["identical"] for record in records) / len(records),
        "dtype": args.dtype,
        "draft_kv": default,
        "meets_target": _meets_target(best),
    }
    return {
        "benchmark": "acceptance",
        "summary": summary,
        "definitions": DEFINITIONS,
        "config": {
            "max_tokens": max_tokens,
            "num_prompts": num_prompts,
            "quick": args.quick,
            "trace_draft_len": MAX_DRAFT_LEN,
            "draft_lens": args.draft_lens,
            "model": args.model,
            "dtype": args.dtype,
        },  # fmt: skip
        "environment": environment(),
        "table": table,
        "table_markdown": markdown(table, args.draft_lens),
        "records": records,
    }


DEFINITIONS = {
    "first_mismatch": f"per round at x={MAX_DRAFT_LEN}: the first draft the full KV rejects "
    f"({MAX_DRAFT_LEN}: none)",
    "x30": "mean accepted per round at x=30, replayed from the traces (min(first mismatch, 30)), "
    "code contexts",
    "ci95": "95% confidence interval of the mean over prompts (t distribution)",
    "best_4x_x30": "per workload kind, the 4x (4-bit) compressor with the most x30; `separated`: "
    "its interval lies above the runner-up's",
    "target": f"best_4x_x30 >= {TARGET_X30:g} on code and on tools (3k+ token contexts)",
}


def _meets_target(best: dict) -> bool | None:
    """None when the run did not measure a 4x compressor on both kinds."""
    if any(best[kind] is None for kind in TARGET_KINDS):
        return None
    return all(best[kind]["x30"] >= TARGET_X30 for kind in TARGET_KINDS)
