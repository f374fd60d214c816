"""Decode step cost at a long context: draft steps over compressed caches against full-cache
steps, and the engine's full-mode tokens/s against transformers' generate, same model and context.

Headlines: `draft_over_full_step` (StreamingLLM 4x draft step / full-cache step, same fast
kernels; target <= 0.6) and `runner_over_hf` (engine full mode, batch-invariant kernels, over
transformers generate; target >= 1).
"""

from __future__ import annotations

import statistics
import time

import torch

from vericache.bench.common import compressor_from_label, environment, pyplot
from vericache.bench.workloads import long_code_context
from vericache.engine.engine import Engine, EngineConfig
from vericache.engine.request import DecodeMode, Request, SamplingParams
from vericache.kv.cache import KVCache
from vericache.model.loader import DEFAULT_MODEL, resolve_model_dir
from vericache.model.runner import ModelRunner, SequenceInput

HEADLINE_LABEL = "streamingllm-4x"


def add_arguments(parser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--context-tokens", type=int, default=8000)
    parser.add_argument("--steps", type=int, help="decode steps timed per variant (32; quick 12)")
    parser.add_argument("--compressors", default="streamingllm-4x,kivi-4bit")
    parser.add_argument("--batch", type=int, default=8, help="requests in the batched comparison")


def time_steps(runner: ModelRunner, caches: list[KVCache], steps: int, invariant: bool) -> float:
    """Median seconds of a greedy one-token step of every cache in one batched forward; the caches
    are rolled back afterwards."""
    start_tokens = [cache.num_tokens for cache in caches]
    tokens = [torch.tensor([13])] * len(caches)
    durations = []
    for _ in range(steps):
        start = time.perf_counter()
        logits = runner.forward(
            [SequenceInput(token, cache) for token, cache in zip(tokens, caches)],
            invariant=invariant,
        )
        tokens = [row.argmax(-1) for row in logits]
        _synchronize(runner.device)
        durations.append(time.perf_counter() - start)
    for cache, num_tokens in zip(caches, start_tokens):
        cache.truncate(num_tokens)
    return statistics.median(durations)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_verification(runner: ModelRunner, cache: KVCache, num_tokens: int, repeats: int) -> float:
    start_tokens = cache.num_tokens
    tokens = torch.randint(3, runner.config.vocab_size, (num_tokens,))
    durations = []
    for _ in range(repeats):
        start = time.perf_counter()
        runner.forward([SequenceInput(tokens, cache, num_tokens)], invariant=True)
        _synchronize(runner.device)
        durations.append(time.perf_counter() - start)
        cache.truncate(start_tokens)
    return statistics.median(durations)


def time_transformers(path, ids: list[int], steps: int) -> dict:
    """transformers generate over a cache prefilled with all but the last prompt token."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    input_ids = torch.tensor([ids])
    with torch.no_grad():
        start = time.perf_counter()
        past = model(input_ids[:, :-1], use_cache=True).past_key_values
        prefill_s = time.perf_counter() - start
        start = time.perf_counter()
        output = model.generate(
            input_ids,
            past_key_values=past,
            max_new_tokens=steps,
            min_new_tokens=steps,
            do_sample=False,
        )
        decode_s = time.perf_counter() - start
    num_new = output.shape[1] - input_ids.shape[1]
    return {"prefill_s": prefill_s, "decode_s": decode_s, "tokens_per_s": num_new / decode_s}


def run(args) -> dict:
    steps = args.steps or (12 if args.quick else 32)
    engine = Engine.from_pretrained(args.model, config=EngineConfig())
    runner, tokenizer = engine.runner, engine.tokenizer
    context = long_code_context(tokenizer, args.context_tokens)
    ids = tokenizer.encode(context.text, add_special_tokens=False)
    prefix = tuple(ids[:-1])

    # Engine full mode end to end: prefill of the context, then `steps` decode steps.
    params = SamplingParams(max_new_tokens=steps, ignore_eos=True)
    (full_run,) = engine.generate([Request(tuple(ids), len(prefix), params, DecodeMode.FULL)])
    print(f"[decode-speed] prefill {len(ids)} tokens: {full_run.stats.prefill_s:.1f}s")
    full = engine.prefix_kv(prefix).clone(len(ids) + steps + 64)
    runner.forward([SequenceInput(torch.tensor(ids[-1:]), full, 0)])

    step_ms = {
        "full_invariant": 1e3 * time_steps(runner, [full], steps, invariant=True),
        "full_fast": 1e3 * time_steps(runner, [full], steps, invariant=False),
    }
    compressed_bytes = {}
    for label in args.compressors.split(","):
        compressed = compressor_from_label(label).compress(full)
        compressed_bytes[label] = compressed.nbytes
        step_ms[f"draft_{label}"] = 1e3 * time_steps(runner, [compressed], steps, invariant=False)
        print(f"[decode-speed] {label}: {step_ms[f'draft_{label}']:.1f} ms per draft step")
    # Serving many long requests at once: the weights are read once per step for all of them,
    # the KV once per request, so the cache dominates.
    batch = [full.clone() for _ in range(args.batch)]
    step_ms[f"full_fast_batch{args.batch}"] = 1e3 * time_steps(
        runner, batch, steps, invariant=False
    )
    headline = compressor_from_label(HEADLINE_LABEL).compress(full)
    batch = [headline.clone() for _ in range(args.batch)]
    step_ms[f"draft_{HEADLINE_LABEL}_batch{args.batch}"] = 1e3 * time_steps(
        runner, batch, steps, False
    )
    del batch
    verify_ms = 1e3 * time_verification(runner, full, 31, repeats=3)
    hf = time_transformers(resolve_model_dir(args.model), ids, steps)
    step_ms["transformers_generate"] = 1e3 / hf["tokens_per_s"]
    return _result(
        args, context, steps, step_ms, verify_ms, full_run, hf, full.nbytes, compressed_bytes
    )


def _result(
    args, context, steps, step_ms, verify_ms, full_run, hf, full_bytes, compressed_bytes
) -> dict:
    full_tokens_per_s = full_run.stats.tokens_per_s
    summary = {
        "draft_over_full_step": step_ms[f"draft_{HEADLINE_LABEL}"] / step_ms["full_fast"],
        "draft_over_full_invariant_step": step_ms[f"draft_{HEADLINE_LABEL}"]
        / step_ms["full_invariant"],
        "runner_over_hf": full_tokens_per_s / hf["tokens_per_s"],
        "runner_fast_over_hf": (1e3 / step_ms["full_fast"]) / hf["tokens_per_s"],
        "context_tokens": context.num_tokens,
    }
    for label in compressed_bytes:
        summary[f"draft_over_full_step_{label}"] = step_ms[f"draft_{label}"] / step_ms["full_fast"]
    batch = args.batch
    summary[f"draft_over_full_step_batch{batch}"] = (
        step_ms[f"draft_{HEADLINE_LABEL}_batch{batch}"] / step_ms[f"full_fast_batch{batch}"]
    )
    return {
        "benchmark": "decode-speed",
        "summary": summary,
        "definitions": {
            "draft_over_full_step": f"median {HEADLINE_LABEL} draft step / median full-cache step, "
            "both with the fast kernels (target <= 0.6)",
            "runner_over_hf": "engine full-mode decode tokens/s (batch-invariant kernels) / "
            "transformers generate tokens/s over the same prefilled context (target >= 1)",
        },
        "config": {
            "model": args.model,
            "steps": steps,
            "context": context.name,
            "quick": args.quick,
        },
        "environment": environment(),
        "step_ms": step_ms,
        "verify_31_tokens_ms": verify_ms,
        "engine_full_mode": full_run.stats.timing_dict(),
        "transformers": hf,
        "kv_bytes": {"full": full_bytes, **compressed_bytes},
    }


def plot(result: dict, path) -> None:
    plt = pyplot()
    names = list(result["step_ms"])
    values = [result["step_ms"][name] for name in names]
    fig, axis = plt.subplots(figsize=(8, 4))
    axis.barh(names, values, color=["tab:blue" if "draft" in n else "tab:grey" for n in names])
    axis.set(
        xlabel="ms per decode step", title=f"{result['summary']['context_tokens']}-token context"
    )
    for y, value in enumerate(values):
        axis.text(value, y, f" {value:.0f}", va="center")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
