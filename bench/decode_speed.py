"""Decode step cost at a long context: draft steps over compressed caches against full-cache
steps, and the engine's full-mode tokens/s against transformers' generate, same model and context.

Headlines: `draft_over_full_step` (StreamingLLM 4x draft step / full-cache step, same fast
kernels; target <= 0.6) and `runner_over_hf` (engine full mode, batch-invariant kernels, over
transformers generate; target >= 1). Memory-bound steps at 8k tokens vary by tens of percent
between runs on a shared machine, so the engine and transformers alternate over several rounds and
medians are compared.
"""

from __future__ import annotations

import copy
import statistics
import time

import torch

from vericache.bench.common import compressor_from_label, environment, pyplot
from vericache.bench.decode_speed_tiny import run_tiny
from vericache.bench.workloads import long_code_context
from vericache.engine.engine import Engine
from vericache.engine.request import DecodeMode, Request, SamplingParams
from vericache.kv.cache import KVCache
from vericache.model.loader import DEFAULT_MODEL, resolve_model_dir
from vericache.model.runner import ModelRunner, SequenceInput

HEADLINE_LABEL = "streamingllm-4x"


def add_arguments(parser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--context-tokens", type=int, default=8000)
    parser.add_argument("--steps", type=int, help="decode steps timed per variant (32; quick 12)")
    parser.add_argument("--rounds", type=int, help="alternations engine/transformers (5; quick 3)")
    parser.add_argument("--compressors", default="streamingllm-4x,kivi-4bit")
    parser.add_argument("--batch", type=int, default=8, help="requests in the batched comparison")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (both models run there)")
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="the host's overhead per step instead, on a 2-layer random model (decode_speed_tiny)",
    )


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(runner: ModelRunner, caches: list[KVCache], steps: int, invariant: bool) -> float:
    """Median seconds of a greedy one-token step of every cache in one batched forward; the caches
    are rolled back afterwards."""
    start_tokens = [cache.num_tokens for cache in caches]
    tokens = [torch.tensor([13])] * len(caches)
    durations = []
    for _ in range(steps):
        start = time.perf_counter()
        batch = [SequenceInput(token, cache) for token, cache in zip(tokens, caches)]
        tokens = [row.argmax(-1) for row in runner.forward(batch, invariant=invariant)]
        _synchronize(runner.device)
        durations.append(time.perf_counter() - start)
    for cache, num_tokens in zip(caches, start_tokens):
        cache.truncate(num_tokens)
    return statistics.median(durations)


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


def step_costs(runner: ModelRunner, full: KVCache, steps: int, args) -> tuple[dict, dict, float]:
    """Milliseconds per step of every variant, compressed sizes, and a 31-token verification."""
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
    fulls = [full.clone() for _ in range(args.batch)]
    step_ms[f"full_fast_batch{args.batch}"] = 1e3 * time_steps(runner, fulls, steps, False)
    del fulls
    headline = compressor_from_label(HEADLINE_LABEL).compress(full)
    drafts = [headline.clone() for _ in range(args.batch)]
    step_ms[f"draft_{HEADLINE_LABEL}_batch{args.batch}"] = 1e3 * time_steps(
        runner, drafts, steps, False
    )
    verify_ms = 1e3 * time_verification(runner, full, 31, repeats=3)
    return step_ms, compressed_bytes, verify_ms


def dynamic_step_costs(runner: ModelRunner, full: KVCache, steps: int) -> dict:
    """Where the runner's forwards are static (captured in CUDA graphs), the same steps by its
    dynamic forward: what the graphs save, same process and caches."""
    headline = compressor_from_label(HEADLINE_LABEL).compress(full)
    with runner.dynamic_only():
        return {
            "full_invariant": 1e3 * time_steps(runner, [full], steps, invariant=True),
            f"draft_{HEADLINE_LABEL}": 1e3 * time_steps(runner, [headline], steps, False),
            "verify_31_tokens": 1e3 * time_verification(runner, full, 31, repeats=3),
        }


def engine_vs_transformers(engine: Engine, model: str, ids: list[int], steps: int, rounds: int):
    """Decode tokens/s of the engine's full mode and of transformers generate, alternating."""
    from transformers import AutoModelForCausalLM

    device = engine.runner.device
    hf = AutoModelForCausalLM.from_pretrained(str(resolve_model_dir(model)), dtype=torch.float32)
    hf.to(device).eval()
    input_ids = torch.tensor([ids], device=device)
    with torch.no_grad():
        start = time.perf_counter()
        prefilled = hf(input_ids[:, :-1], use_cache=True).past_key_values
        hf_prefill_s = time.perf_counter() - start
    params = SamplingParams(max_new_tokens=steps, ignore_eos=True)
    request = Request(tuple(ids), len(ids) - 1, params, DecodeMode.FULL)
    engine_rates, hf_rates = [], []
    for _ in range(rounds):
        (out,) = engine.generate([request])  # the prefix's KV is reused, not prefilled again
        engine_rates.append(out.stats.tokens_per_s)
        with torch.no_grad():
            past = copy.deepcopy(prefilled)
            start = time.perf_counter()
            output = hf.generate(
                input_ids,
                past_key_values=past,
                max_new_tokens=steps,
                min_new_tokens=steps,
                do_sample=False,
            )
            _synchronize(device)
            elapsed = time.perf_counter() - start
        # One forward per token, as the engine's rate counts its decode steps.
        hf_rates.append((output.shape[1] - input_ids.shape[1]) / elapsed)
    return {
        "engine_tokens_per_s": engine_rates,
        "transformers_tokens_per_s": hf_rates,
        "transformers_prefill_s": hf_prefill_s,
    }


def run(args) -> dict:
    if args.tiny:
        return run_tiny(args)
    steps = args.steps or (12 if args.quick else 32)
    rounds = args.rounds or (3 if args.quick else 5)
    engine = Engine.from_pretrained(args.model, device=args.device)
    context = long_code_context(engine.tokenizer, args.context_tokens)
    ids = engine.tokenizer.encode(context.text, add_special_tokens=False)
    prefix = tuple(ids[:-1])
    start = time.perf_counter()
    full = engine.prefix_kv(prefix).clone(len(ids) + steps + 64)
    prefill_s = time.perf_counter() - start
    print(f"[decode-speed] prefill of {len(prefix)} tokens: {prefill_s:.1f}s")
    engine.runner.forward([SequenceInput(torch.tensor(ids[-1:]), full, 0)])
    step_ms, compressed_bytes, verify_ms = step_costs(engine.runner, full, steps, args)
    dynamic_ms = None
    if engine.runner.static is not None:
        dynamic_ms = dynamic_step_costs(engine.runner, full, steps)
    throughput = engine_vs_transformers(engine, args.model, ids, steps, rounds)
    result = {
        "benchmark": "decode-speed",
        "summary": _summary(step_ms, throughput, compressed_bytes, args.batch, context)
        | _static_summary(step_ms, verify_ms, dynamic_ms),
        "definitions": {
            "draft_over_full_step": f"median {HEADLINE_LABEL} draft step / median full-cache step, "
            "both with the fast kernels (target <= 0.6)",
            "runner_over_hf": "median engine full-mode decode tokens/s (batch-invariant kernels) / "
            "median transformers generate tokens/s, same prefilled context (target >= 1)",
            "static_over_dynamic_*": "median step with static forwards (CUDA graphs on CUDA) / the "
            "same step by the dynamic forward, same caches (only where static forwards are on)",
        },
        "config": {
            "model": args.model,
            "steps": steps,
            "rounds": rounds,
            "quick": args.quick,
            "device": args.device,
            "static_shapes": engine.runner.static is not None,
        },  # fmt: skip
        "environment": environment(),
        "context": {"files": context.name, "tokens": context.num_tokens},
        "step_ms": step_ms,
        "verify_31_tokens_ms": verify_ms,
        "dynamic_step_ms": dynamic_ms,
        "prefill_s": {
            "engine": prefill_s,
            "transformers": throughput.pop("transformers_prefill_s"),
        },
        "throughput": throughput,
        "kv_bytes": {"full": full.nbytes, **compressed_bytes},
    }
    return result


def _summary(step_ms, throughput, compressed_bytes, batch, context) -> dict:
    engine_rate = statistics.median(throughput["engine_tokens_per_s"])
    hf_rate = statistics.median(throughput["transformers_tokens_per_s"])
    draft = step_ms[f"draft_{HEADLINE_LABEL}"]
    summary = {
        "draft_over_full_step": draft / step_ms["full_fast"],
        "draft_over_full_invariant_step": draft / step_ms["full_invariant"],
        "runner_over_hf": engine_rate / hf_rate,
        "engine_full_tokens_per_s": engine_rate,
        "transformers_tokens_per_s": hf_rate,
        "context_tokens": context.num_tokens,
        f"draft_over_full_step_batch{batch}": step_ms[f"draft_{HEADLINE_LABEL}_batch{batch}"]
        / step_ms[f"full_fast_batch{batch}"],
    }
    for label in compressed_bytes:
        summary[f"draft_over_full_step_{label}"] = step_ms[f"draft_{label}"] / step_ms["full_fast"]
    return summary


def _static_summary(step_ms: dict, verify_ms: float, dynamic_ms: dict | None) -> dict:
    """Static forwards (CUDA graphs) over the dynamic forward, per kind of step: < 1 is faster."""
    if dynamic_ms is None:
        return {}
    draft = f"draft_{HEADLINE_LABEL}"
    return {
        "static_over_dynamic_full_step": step_ms["full_invariant"] / dynamic_ms["full_invariant"],
        "static_over_dynamic_draft_step": step_ms[draft] / dynamic_ms[draft],
        "static_over_dynamic_verify": verify_ms / dynamic_ms["verify_31_tokens"],
    }


def plot(result: dict, path) -> None:
    plt = pyplot()
    step_ms = dict(result["step_ms"])
    step_ms["transformers_generate"] = 1e3 / result["summary"]["transformers_tokens_per_s"]
    names = list(step_ms)
    values = [step_ms[name] for name in names]
    fig, axis = plt.subplots(figsize=(8, 4))
    axis.barh(names, values, color=["tab:blue" if "draft" in n else "tab:grey" for n in names])
    tokens = result["summary"]["context_tokens"]
    axis.set(xlabel="ms per decode step", title=f"{tokens}-token context, batch 1 unless named")
    for y, value in enumerate(values):
        axis.text(value, y, f" {value:.0f}", va="center")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
