"""Accepted draft tokens per round, by compressor and draft length, on real long contexts,
recorded as traces the simulator replays.

Workloads: code (Python standard-library modules of 3-4k tokens, each asked a HumanEval prompt and a
question about the module), tools (BFCL function catalogues of 3k+ tokens, BFCL questions), math
(short word problems). `--prompts-per-kind` (20) code and tool prompts; the math set has 8.

Every request decodes `--max-tokens` (256) tokens at x = 64, the longest draft the simulator
replays, and every round records the position of its first draft that the full KV rejects (64 when
none is). The drafts before the first mismatch do not depend on how many follow, so the rounds lay
out where along the output a draft matches and where the run breaks, and rounds at any x replay
them in order (sim/workload.py `replayed_rounds`). A round cut short (by the token budget or an
end token) with every draft accepted tells no first mismatch and is left out. Rounds replayed at
x < 64 still read a little low: a whole round at x re-reads the exact KV of what it commits every
x + 1 tokens, and drafts deeper in a round of 64 run over more of their own drafted KV
(`--whole-rounds` measures rounds at x as served). Each record also keeps
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
from dataclasses import dataclass
from pathlib import Path

from vericache.bench import acceptance_report
from vericache.bench.acceptance_checkpoint import Checkpoint
from vericache.bench.acceptance_frontier import STEERED, WHOLE, plot_frontier
from vericache.bench.acceptance_result import SAMPLED, report_again, reported
from vericache.bench.common import (
    compressor_from_label,
    compressor_labels,
    int_list,
    progress,
)
from vericache.bench.workloads import standard_workloads
from vericache.cli.parser import float_list
from vericache.engine.engine import DraftKVSource, Engine, EngineConfig
from vericache.engine.prompt import build_chat_prompt
from vericache.engine.request import DecodeMode, Request, SamplingParams
from vericache.kv.codec import encode_bytes, model_fingerprint
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
    parser.add_argument(
        "--context-tokens",
        type=int,
        help="cut each code and tool context to at most this many tokens (whole: 3-4k)",
    )
    parser.add_argument("--draft-kv", choices=["verifier", "drafter", "both"], default="verifier")
    parser.add_argument(
        "--steer-every",
        type=int,
        default=0,
        help="also run each token dropper that keeps its tokens once with its kept set steered by "
        "the verifier every this many rounds (compress/steering.py); 0: not",
    )
    parser.add_argument(
        "--whole-rounds",
        type=int,
        default=0,
        help="draft whole rounds of this many drafts, each verified whole as a served round is, "
        "in place of rounds of 64 cut at the first rejected draft; their cells are given at this "
        "x alone (a steered kept set is refreshed by round, so rounds of 64 do not replay it)",
    )
    parser.add_argument("--batch-size", type=int, default=8, help="requests decoded together")
    parser.add_argument(
        "--temperature",
        type=float_list,
        default=[0.0],
        help="comma-separated temperatures (0: greedy); each request samples with its own seed",
    )
    parser.add_argument(
        "--coupling",
        type=lambda text: [c for c in text.split(",") if c],
        default=["seeded"],
        help="how sampled drafts are checked: seeded, rejection, or both (seeded,rejection)",
    )
    parser.add_argument(
        "--checkpoint",
        type=Path,
        help="a JSON-lines file of finished compressors' records: a run appends each compressor's "
        "as it finishes, and a run given the file again skips them (same settings)",
    )
    parser.add_argument(
        "--from-json",
        type=Path,
        help="an earlier acceptance result: its records reported again by this code (table, "
        "summary, figures), nothing decoded",
    )
    parser.add_argument(
        "--dtype",
        default="float32",
        help="model dtype; outputs are bit-exact in float32, and "
        "the identity rate with full decoding is reported for bfloat16/float16",
    )


def run(args) -> dict:
    if args.from_json is not None:
        return report_again(json.loads(args.from_json.read_text()))
    max_tokens = args.max_tokens or (64 if args.quick else 256)
    per_kind = args.prompts_per_kind or (2 if args.quick else 20)
    labels = compressor_labels(args.compressors or "all-4x")
    compressors = [compressor_from_label(label) for label in labels]
    engine = Engine.from_pretrained(
        args.model, dtype=args.dtype, config=EngineConfig(prefix_cache_bytes=16 << 30)
    )
    prompts = _prompts(engine.tokenizer, args.quick, per_kind, args.context_tokens)
    sources = list(DraftKVSource) if args.draft_kv == "both" else [DraftKVSource(args.draft_kv)]
    settings = {"max_tokens": max_tokens, "num_prompts": len(prompts), "model": args.model,
                "dtype": args.dtype}  # fmt: skip
    if args.context_tokens is not None:  # other prompts: another checkpoint's records
        settings["context_tokens"] = args.context_tokens
    checkpoint = Checkpoint(args.checkpoint, settings)
    records, shares = [], {}
    for sampling in sampling_settings(args.temperature, args.coupling):
        params = [sampling.params(max_tokens, seed) for seed in range(len(prompts))]
        references = _references(engine, prompts, params, checkpoint, sampling.label("full"))
        for source in sources:
            config = EngineConfig(draft_kv_source=source, prefix_cache_bytes=16 << 30)
            engine = Engine(engine.runner, engine.tokenizer, config, engine.prefix_store)
            for one in _runs(compressors, args.steer_every, args.whole_rounds):
                label = sampling.label(one.label)
                done = checkpoint.records(label, source.value)
                if done is None:
                    done = _traces(engine, one, source, prompts, references, params, args)
                    done = [{**r, **sampling.record_fields(), "compressor": label} for r in done]
                    checkpoint.add(label, source.value, done)
                records += done
                print(f"[acceptance] {label}, draft_kv={source.value}: done")
                if one.compressor.label not in shares:
                    shares[one.compressor.label] = compressed_share(engine, one.compressor, prompts)
    run_labels = [one.label for one in _runs(compressors, args.steer_every, args.whole_rounds)]
    return reported(records, run_labels, args, max_tokens, len(prompts), shares)


def plot(result: dict, path) -> None:
    """The CLI's figure (acceptance_report.py), and beside it (`<name>_frontier.png`) accepted
    per round against c (acceptance_frontier.py)."""
    acceptance_report.plot(result, path)
    if result.get("c"):
        path = Path(path)
        plot_frontier(result, path.with_name(f"{path.stem}_frontier{path.suffix}"))


@dataclass(frozen=True)
class Sampling:
    """One way of choosing tokens the run measures: greedy, or sampled at a temperature with
    one coupling of drafts (seeded: the full-KV sample; rejection: the distribution)."""

    temperature: float
    coupling: str

    def params(self, max_tokens: int, seed: int) -> SamplingParams:
        return SamplingParams(
            max_new_tokens=max_tokens, temperature=self.temperature, seed=seed,
            coupling=self.coupling if self.temperature > 0 else "seeded",
        )  # fmt: skip

    def label(self, compressor_label: str) -> str:
        """The compressor's label, with the sampling where it samples."""
        if self.temperature == 0:
            return compressor_label
        return f"{compressor_label}{SAMPLED}{self.temperature:g} {self.coupling}"

    def record_fields(self) -> dict:
        return {"temperature": self.temperature, "coupling": self.coupling}


def sampling_settings(temperatures: list[float], couplings: list[str]) -> list[Sampling]:
    """Greedy once (if asked), then every temperature above 0 with every coupling."""
    settings = [Sampling(0.0, "greedy")] if 0 in temperatures else []
    return settings + [Sampling(t, c) for t in temperatures if t > 0 for c in couplings]


def _references(engine, prompts, params, checkpoint, label: str) -> list[tuple[int, ...]]:
    """Every prompt's full-KV output (prompt i with params[i]), from the checkpoint if it has
    them: a resumed run does not decode them again."""
    references = checkpoint.references(label)
    if references is None:
        outputs = engine.generate(
            [Request(p.token_ids, p.num_prefix_tokens, params[i], DecodeMode.FULL)
             for i, (*_, p) in enumerate(prompts)]
        )  # fmt: skip
        references = [tuple(out.token_ids) for out in outputs]
        checkpoint.add_references(label, references)
    return references


@dataclass(frozen=True)
class Run:
    """One compressor's traces: steered every `steer_every` rounds (0: not), in rounds of 64
    cut at the first rejected draft (`whole_rounds` 0), or in whole rounds of that many drafts,
    each verified whole as a served round is."""

    compressor: object
    steer_every: int = 0
    whole_rounds: int = 0

    @property
    def label(self) -> str:
        """The compressor's label, with its steering and its rounds where they are not the
        default ("snapkv-8x-bf16 steered/1 whole/30")."""
        label = self.compressor.label
        if self.steer_every:
            label += f"{STEERED}{self.steer_every}"
        return f"{label}{WHOLE}{self.whole_rounds}" if self.whole_rounds else label

    @property
    def draft_len(self) -> int:
        return self.whole_rounds or MAX_DRAFT_LEN


def _runs(compressors, steer_every: int, whole_rounds: int = 0) -> list[Run]:
    """Every compressor as it is, and where asked each steerable one steered too."""
    runs = [Run(compressor, 0, whole_rounds) for compressor in compressors]
    if steer_every:
        runs += [Run(c, steer_every, whole_rounds) for c in compressors if c.is_steerable]
    return runs


def _traces(engine, run: Run, source, prompts, references, params, args) -> list[dict]:
    """Every prompt decoded with drafts over the run's compressor (prompt i with params[i]): one
    trace record each. Rejection coupling samples the model's distribution but not the full-KV
    sample: its outputs are not compared (`identical` None)."""
    outputs = []
    chunks = range(0, len(prompts), args.batch_size)
    for start in progress(chunks, f"{run.label}, x={run.draft_len}", unit="batch"):
        end = start + args.batch_size
        chunk = zip(prompts[start:end], references[start:end], params[start:end])
        outputs += engine.generate([_request(run, *item) for item in chunk])
    records = []
    for (kind, name, prompt), reference, out, p in zip(prompts, references, outputs, params):
        record = trace_record(kind, name, run.compressor, out.stats, source.value, run.draft_len)
        record["identical"] = None if p.is_rejection_coupled else tuple(out.token_ids) == reference
        record["context_tokens"] = prompt.num_prefix_tokens
        if run.whole_rounds:
            record["whole_rounds"] = run.whole_rounds
        records.append(record)
    return records


def _request(run: Run, item, reference, params: SamplingParams) -> Request:
    """A traced round stops drafting after its first draft the reference rejects (expected_ids):
    it commits the same tokens and tells the same first mismatch as one that drafts all 64. Not
    under rejection coupling, whose output is not the reference's, nor in whole rounds."""
    *_, prompt = item
    expected = None if params.is_rejection_coupled or run.whole_rounds else reference
    return Request(
        prompt.token_ids, prompt.num_prefix_tokens, params, DecodeMode.VERICACHE, run.compressor,
        run.draft_len, expected_ids=expected, steer_every=run.steer_every,
    )  # fmt: skip


def compressed_share(engine: Engine, compressor, prompts) -> float:
    """c: the compressed KV's bytes on the wire (the KV codec's, what the link carries and the
    drafter holds) over the full KV's in bf16, the mean over the prompts' distinct prefixes."""
    config = engine.model_config
    fingerprint = model_fingerprint(config, "acceptance")
    prefixes = {tuple(p.token_ids[: p.num_prefix_tokens]) for *_, p in prompts}
    shares = []
    for prefix in sorted(prefixes):
        state = engine.compressed_prefix_kv(prefix, compressor).to_state()
        full_bf16 = config.kv_bytes_per_token(2) * len(prefix)
        shares.append(len(encode_bytes(state, fingerprint)) / full_bf16)
    return sum(shares) / len(shares)


def _prompts(tokenizer, quick: bool, per_kind: int, context_tokens: int | None = None):
    """(kind, workload name, prompt ids) of every prompt."""
    return [
        (workload.kind, workload.name, build_chat_prompt(tokenizer, workload.context, prompt))
        for workload in standard_workloads(tokenizer, quick, per_kind, context_tokens)
        for prompt in workload.prompts
    ]


def trace_record(
    kind: str, workload: str, compressor, stats, draft_kv: str, draft_len: int = MAX_DRAFT_LEN
) -> dict:
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
            stats.drafted_per_round, stats.accepted_per_round, draft_len
        ),
    } | _refreshes(stats)


def _refreshes(stats) -> dict:
    """A steered trace's kept set: its entries, and those each refresh replaced (what a remote
    drafter's refreshes cost the link, sim/steering_link.py)."""
    if not stats.kept_entries:
        return {}
    return {"kept_entries": stats.kept_entries, "changed_per_refresh": stats.changed_per_refresh}
