"""Batched drafting: one forward for every drafting request per step, against drafting them one by
one, on the embedded model with long code contexts.

Headline `batched_over_single`: draft tokens/s of B requests stepping together over their own
compressed caches, over the same B requests stepping one at a time (target >= 3 on CPU for B=8).
A step reads the weights once for the whole batch, and each request's small compressed cache once.
`identical`: vericache outputs of the B requests decoded together equal those decoded alone (the
verification's batch-invariant kernels make them equal by construction; this checks it end to end).
"""

from __future__ import annotations

from vericache.bench.common import compressor_from_label, environment, pyplot
from vericache.bench.decode_speed import time_steps
from vericache.bench.workloads import code_contexts, humaneval_prompts
from vericache.engine.engine import Engine
from vericache.engine.prompt import build_chat_prompt
from vericache.engine.request import DecodeMode, Request, SamplingParams
from vericache.model.loader import DEFAULT_MODEL

TARGET = 3.0


def add_arguments(parser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--compressor", default="streamingllm-4x")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context-tokens", type=int, help="per request (3000; quick 1500)")
    parser.add_argument("--steps", type=int, help="draft steps timed (24; quick 8)")
    parser.add_argument("--max-tokens", type=int, help="tokens per request, end to end (64; 16)")


def run(args) -> dict:
    context_tokens = args.context_tokens or (1500 if args.quick else 3000)
    steps = args.steps or (8 if args.quick else 24)
    max_tokens = args.max_tokens or (16 if args.quick else 64)
    engine = Engine.from_pretrained(args.model)
    requests = _requests(engine, args, context_tokens, max_tokens)

    caches = [
        engine.compressed_prefix_kv(r.prompt_ids[: r.num_prefix_tokens], r.compressor).clone()
        for r in requests
    ]
    single_s = [time_steps(engine.runner, [cache], steps, invariant=False) for cache in caches]
    batched_s = time_steps(engine.runner, caches, steps, invariant=False)
    print(f"[batching] draft step: {sum(single_s) / len(single_s) * 1e3:.1f} ms alone, "
          f"{batched_s * 1e3:.1f} ms for {len(caches)} together")  # fmt: skip

    together = engine.generate(requests)
    alone = [engine.generate([request])[0] for request in requests]
    identical = all(a.token_ids == b.token_ids for a, b in zip(together, alone))
    end_to_end = {
        "together_tokens_per_s": _tokens_per_s(together, max(o.stats.total_s for o in together)),
        "alone_tokens_per_s": _tokens_per_s(alone, sum(o.stats.total_s for o in alone)),
    }
    return {
        "benchmark": "batching",
        "summary": {
            "batched_over_single": sum(single_s) / batched_s,
            "identical": identical,
            "batch": len(requests),
            "meets_target": sum(single_s) / batched_s >= TARGET,
        },
        "config": {
            "model": args.model,
            "compressor": args.compressor,
            "context_tokens": context_tokens,
            "steps": steps,
            "max_tokens": max_tokens,
            "quick": args.quick,
        },  # fmt: skip
        "draft_step_ms": {"alone": [s * 1e3 for s in single_s], "together": batched_s * 1e3},
        "end_to_end_vericache": end_to_end,
        "mean_accepted_per_round": [o.stats.mean_accepted_per_round for o in together],
        "environment": environment(),
    }


def _requests(engine: Engine, args, context_tokens: int, max_tokens: int) -> list[Request]:
    """B requests, each over its own standard-library module and HumanEval prompt."""
    low, high = int(context_tokens * 0.8), context_tokens
    contexts = code_contexts(engine.tokenizer, low, high, count=args.batch)
    prompts = humaneval_prompts(args.batch)
    params = SamplingParams(max_new_tokens=max_tokens)
    compressor = compressor_from_label(args.compressor)
    requests = []
    for context, prompt in zip(contexts, prompts):
        ids = build_chat_prompt(engine.tokenizer, context.text, prompt)
        requests.append(
            Request(ids.token_ids, ids.num_prefix_tokens, params, DecodeMode.VERICACHE, compressor)
        )
    return requests


def _tokens_per_s(outputs, seconds: float) -> float:
    return sum(len(o.token_ids) for o in outputs) / seconds if seconds > 0 else 0.0


def plot(result: dict, path) -> None:
    plt = pyplot()
    steps = result["draft_step_ms"]
    batch = result["summary"]["batch"]
    figure, axis = plt.subplots(figsize=(6, 4))
    labels = [f"{batch} steps, one at a time", f"one step of {batch} together"]
    axis.bar(labels, [sum(steps["alone"]), steps["together"]], color=["tab:gray", "tab:blue"])
    axis.set_ylabel("ms for one draft token of every request")
    axis.set_title(
        f"Batched drafting: {result['summary']['batched_over_single']:.2f}x tokens/s "
        f"(target {TARGET:.0f}x)"
    )
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
