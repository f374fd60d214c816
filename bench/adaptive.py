"""Adaptive draft length against static ones, on a mixed workload decoded as one batch.

Several compressors (streamingllm-4x, snapkv-8x, kvzip-4x by default) over code contexts (stdlib
modules with a HumanEval prompt), tool contexts (BFCL catalogues with a question) and short math
chats (a one-line system turn, where token dropping keeps little and acceptance falls): every
(context, compressor) pair is one vericache request, and all of them decode together in one
`Engine.generate` batch. The batch runs once per static draft length and once with
`adaptive_draft_len` (each round's length chosen per request from its acceptance so far and the
engine's measured costs, up to the longest static length), each on a fresh engine, runs
interleaved over the repeats.

Headline `adaptive_over_best_static`: tokens/s of the adaptive run over the best static run, no
setting tuned by hand (target >= 1). `identical`: every output equals full-KV decoding.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict

from vericache.bench.common import (
    compressor_from_label,
    environment,
    int_list,
    progress,
    pyplot,
    save_figure,
)
from vericache.bench.workloads import (
    MATH_CONTEXT,
    MATH_PROBLEMS,
    code_contexts,
    humaneval_prompts,
    tool_contexts,
)
from vericache.engine.engine import Engine, EngineConfig
from vericache.engine.prompt import build_chat_prompt
from vericache.engine.request import DecodeMode, Request, SamplingParams
from vericache.model.loader import DEFAULT_MODEL

TARGET = 1.0
ADAPTIVE = "adaptive"


def add_arguments(parser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--compressors", default="streamingllm-4x,snapkv-8x,kvzip-4x")
    parser.add_argument("--draft-lens", type=int_list, help="static lengths (4,8,16,30,48)")
    parser.add_argument("--contexts", type=int, help="code and tool contexts, each (2; quick 1)")
    parser.add_argument("--math-prompts", type=int, help="short math chats (2; quick 1)")
    parser.add_argument("--context-tokens", type=int, default=3000, help="per context, about")
    parser.add_argument("--max-tokens", type=int, help="output tokens per request (128; quick 64)")
    parser.add_argument("--repeats", type=int, help="runs of each setting, interleaved (3; 1)")


def run(args) -> dict:
    draft_lens = args.draft_lens or [4, 8, 16, 30, 48]
    num_contexts = args.contexts or (1 if args.quick else 2)
    max_tokens = args.max_tokens or (64 if args.quick else 128)
    repeats = args.repeats or (1 if args.quick else 3)
    engine = Engine.from_pretrained(args.model, config=EngineConfig(prefix_cache_bytes=8 << 30))
    workload = _workload(engine, args, num_contexts)
    params = SamplingParams(max_new_tokens=max_tokens)
    references = _full_outputs(engine, workload, params)
    _warm_prefixes(engine, workload)

    settings = [str(d) for d in draft_lens] + [ADAPTIVE]
    samples, outputs = defaultdict(list), {}
    # Repeats interleave the settings, so that a slow spell of the machine hits them all.
    runs = [(repeat, setting) for repeat in range(repeats) for setting in settings]
    for repeat, setting in progress(runs, "adaptive and static runs"):
        batch = [_request(item, params, setting, max(draft_lens)) for item in workload]
        fresh = Engine(engine.runner, engine.tokenizer, engine.config, engine.prefix_store)
        start = time.perf_counter()
        outputs[setting] = fresh.generate(batch)
        elapsed = time.perf_counter() - start
        num_tokens = sum(len(out.token_ids) for out in outputs[setting])
        samples[setting].append(num_tokens / elapsed)
        print(f"[adaptive] repeat {repeat} draft_len={setting}: {num_tokens / elapsed:.1f} tok/s")
    return _result(args, workload, references, samples, outputs, draft_lens, max_tokens, repeats)


def _workload(engine: Engine, args, num_contexts: int) -> list[dict]:
    """(kind, context name, prompt ids, compressor label) for every context x compressor."""
    num_math = args.math_prompts if args.math_prompts is not None else (1 if args.quick else 2)
    tokenizer = engine.tokenizer
    low = int(args.context_tokens * 0.8)
    codes = code_contexts(tokenizer, low, args.context_tokens, count=num_contexts)
    prompts = [("code", c.name, c.text, p) for c, p in zip(codes, humaneval_prompts(num_contexts))]
    for tools in tool_contexts(tokenizer, low, count=num_contexts):
        prompts.append(("tools", tools.name, tools.context, tools.questions[0]))
    for index, problem in enumerate(MATH_PROBLEMS[:num_math]):
        prompts.append(("math", f"math:{index}", MATH_CONTEXT, problem.prompt))
    return [
        {
            "kind": kind,
            "context": name,
            "prompt": build_chat_prompt(tokenizer, context, question),
            "compressor": compressor_from_label(label),
        }
        for kind, name, context, question in prompts
        for label in args.compressors.split(",")
    ]


def _request(item: dict, params: SamplingParams, setting: str, max_draft_len: int) -> Request:
    prompt, is_adaptive = item["prompt"], setting == ADAPTIVE
    return Request(
        prompt.token_ids,
        prompt.num_prefix_tokens,
        params,
        DecodeMode.VERICACHE,
        item["compressor"],
        max_draft_len if is_adaptive else int(setting),
        adaptive_draft_len=is_adaptive,
    )


def _full_outputs(engine: Engine, workload: list[dict], params: SamplingParams) -> list[list[int]]:
    prompts = {item["prompt"].token_ids: item["prompt"] for item in workload}
    outputs = engine.generate(
        [
            Request(p.token_ids, p.num_prefix_tokens, params, DecodeMode.FULL)
            for p in prompts.values()
        ]
    )
    by_prompt = {ids: out.token_ids for ids, out in zip(prompts, outputs)}
    return [by_prompt[item["prompt"].token_ids] for item in workload]


def _warm_prefixes(engine: Engine, workload: list[dict]) -> None:
    """Prefill and compress every prefix before any timed run, so that none pays for it."""
    for item in workload:
        prompt = item["prompt"]
        engine.compressed_prefix_kv(
            prompt.token_ids[: prompt.num_prefix_tokens], item["compressor"]
        )


def _result(args, workload, references, samples, outputs, draft_lens, max_tokens, repeats) -> dict:
    tokens_per_s = {setting: statistics.median(values) for setting, values in samples.items()}
    static = {d: tokens_per_s[str(d)] for d in draft_lens}
    best_static = max(static, key=static.get)
    ratio = tokens_per_s[ADAPTIVE] / static[best_static]
    identical = all(
        out.token_ids == reference
        for setting_outputs in outputs.values()
        for out, reference in zip(setting_outputs, references)
    )
    return {
        "benchmark": "adaptive",
        "summary": {
            "adaptive_over_best_static": ratio,
            "best_static_draft_len": best_static,
            "identical": identical,
            "tokens_per_s": {f"static_{d}": static[d] for d in draft_lens}
            | {ADAPTIVE: tokens_per_s[ADAPTIVE]},
            "meets_target": ratio >= TARGET,
        },
        "definitions": {
            "tokens_per_s": "output tokens of the whole batch over the wall time of its generate "
            "call (median over the repeats)",
            "adaptive_over_best_static": "adaptive tokens/s over the best static draft length's",
        },
        "config": {
            "model": args.model,
            "compressors": args.compressors,
            "draft_lens": draft_lens,
            "adaptive_max_draft_len": max(draft_lens),
            "max_tokens": max_tokens,
            "repeats": repeats,
            "quick": args.quick,
            "requests": [
                {
                    "kind": item["kind"],
                    "context": item["context"],
                    "prompt_tokens": len(item["prompt"].token_ids),
                    "compressor": item["compressor"].label,
                }
                for item in workload
            ],
        },
        "samples_tokens_per_s": dict(samples),
        "rounds": {setting: _round_stats(workload, outs) for setting, outs in outputs.items()},
        "environment": environment(),
    }


def _round_stats(workload: list[dict], outputs) -> dict:
    """Per kind and compressor: mean draft length and accepted tokens per round."""
    drafted, accepted = defaultdict(list), defaultdict(list)
    for item, out in zip(workload, outputs):
        key = f"{item['kind']}/{item['compressor'].label}"
        drafted[key] += out.stats.drafted_per_round
        accepted[key] += out.stats.accepted_per_round
    return {
        key: {
            "rounds": len(drafted[key]),
            "mean_draft_len": statistics.fmean(drafted[key]),
            "mean_accepted": statistics.fmean(accepted[key]),
        }
        for key in drafted
    }


def plot(result: dict, path) -> None:
    plt = pyplot()
    summary = result["summary"]
    draft_lens = result["config"]["draft_lens"]
    static = [summary["tokens_per_s"][f"static_{d}"] for d in draft_lens]
    figure, axis = plt.subplots(figsize=(6, 4))
    axis.plot(draft_lens, static, "o-", color="tab:gray", label="static draft length")
    axis.axhline(summary["tokens_per_s"][ADAPTIVE], color="tab:blue", label="adaptive")
    axis.set_xscale("log", base=2)
    axis.set_xticks(draft_lens, [str(d) for d in draft_lens])
    axis.set_xlabel("draft length")
    axis.set_ylabel("tokens/s, whole batch")
    axis.set_title(
        f"Adaptive draft length: {summary['adaptive_over_best_static']:.2f}x the best static "
        f"(x={summary['best_static_draft_len']})"
    )
    axis.legend()
    save_figure(figure, path)
