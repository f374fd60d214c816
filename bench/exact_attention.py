"""Exact forwards on CUDA: the Triton batch-invariant attention against the torch blocked path it
replaces, in one process, on the embedded model's architecture at a long context.

The exact (batch-invariant) forwards are VeriCache's verifications and the full-KV baseline's
decode steps: a token gets the same bits decoded alone as verified among others. On CUDA, without
the kernel, their attention is a loop of small products over fixed key blocks. Timed, both ways
and interleaved over `--rounds`: a one-token exact step and a 31-token verification over a
`--context-tokens` cache, a fast (drafting) step over the same cache, and a fast step over a
StreamingLLM-4x cache stored in bfloat16 under a float32 model (the kernel reads 16-bit keys
without converting them first). Each round also checks that the verification's logits equal
one-token steps', bit for bit, over caches of different capacities. `fast_step_ms` runs the same
code both ways (library attention): its ratio is the noise floor of the others.

Headline `verify_torch_over_triton`: median verification time with the torch path over the
kernel's, float32 model. Needs CUDA and Triton.
"""

from __future__ import annotations

import statistics
import time

import torch

from vericache.bench.common import environment, pyplot, save_figure
from vericache.compress import StreamingLLM
from vericache.engine.engine import Engine, EngineConfig
from vericache.kernels import triton_ops
from vericache.model.loader import DEFAULT_MODEL, load_model
from vericache.model.runner import ModelRunner, SequenceInput

NUM_VERIFIED = 31


def add_arguments(parser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--context-tokens", type=int, help="cache length (8000; quick 2000)")
    parser.add_argument("--rounds", type=int, help="interleaved rounds (3; quick 1)")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="model dtypes")


def run(args) -> dict:
    if not triton_ops.available():
        raise SystemExit("bench exact-attention needs CUDA and Triton")
    context_tokens = args.context_tokens or (2000 if args.quick else 8000)
    rounds = args.rounds or (1 if args.quick else 3)
    results = {}
    for dtype in args.dtypes.split(","):
        results[dtype] = _measure_dtype(args.model, dtype, context_tokens, rounds)
        print(f"[exact-attention] {dtype}: {results[dtype]['torch_over_triton']}")
    return {
        "benchmark": "exact-attention",
        "summary": {
            "verify_torch_over_triton": results["float32"]["torch_over_triton"]["verify_ms"]
            if "float32" in results
            else None,
            "exact_step_torch_over_triton": {
                d: r["torch_over_triton"]["exact_step_ms"] for d, r in results.items()
            },
            "verify_ms": {d: r["triton"]["verify_ms"] for d, r in results.items()},
            "identical": all(r["verify_equals_steps"] for r in results.values()),
        },
        "definitions": {
            "verify_torch_over_triton": f"median {NUM_VERIFIED}-token verification time, torch "
            "blocked attention over the Triton kernel, float32 model",
            "identical": "every round's verification logits equal one-token steps' bit for bit",
        },
        "config": {"model": args.model, "context_tokens": context_tokens, "rounds": rounds},
        "per_dtype": results,
        "environment": environment(),
    }


def _measure_dtype(model: str, dtype: str, context_tokens: int, rounds: int) -> dict:
    loaded = load_model(model, dtype=dtype, device="cuda")
    runner = ModelRunner(loaded.config, loaded.weights, "cuda")
    generator = torch.Generator().manual_seed(0)
    vocab = loaded.config.vocab_size
    prefix = tuple(torch.randint(3, vocab, (context_tokens,), generator=generator).tolist())
    continuation = torch.randint(3, vocab, (NUM_VERIFIED,), generator=generator)
    cache = runner.new_cache()
    runner.prefill(torch.tensor(prefix), cache, num_logits=0)
    engine = Engine(runner, None, EngineConfig(prefix_cache_bytes=0))
    draft = engine.compressed_prefix_kv(prefix, StreamingLLM(ratio=4, dtype="bfloat16")).clone()
    timings = {"triton": [], "torch": []}
    identical = True
    for round_index in range(rounds):
        # Each round reverses the order: the second of a pair runs on a GPU the first warmed.
        for name in list(timings)[:: 1 if round_index % 2 == 0 else -1]:
            if name == "torch":
                with triton_ops.switched_off():
                    timings[name].append(_time_steps(runner, cache, draft, continuation))
            else:
                timings[name].append(_time_steps(runner, cache, draft, continuation))
                identical &= _verify_equals_steps(runner, cache, continuation)
    medians = {
        name: {key: statistics.median(r[key] for r in runs) for key in runs[0]}
        for name, runs in timings.items()
    }
    ratios = {key: medians["torch"][key] / medians["triton"][key] for key in medians["triton"]}
    return medians | {"torch_over_triton": ratios, "verify_equals_steps": identical}


def _time_steps(runner, cache, draft, continuation) -> dict:
    """Median milliseconds of each forward, the caches rolled back after each."""

    def forward(kv, num_new, invariant):
        start_tokens = kv.num_tokens
        tokens = continuation[:num_new]
        runner.forward([SequenceInput(tokens, kv, num_new)], invariant=invariant)
        kv.truncate(start_tokens)

    cases = {
        "exact_step_ms": (cache, 1, True, 10),
        "verify_ms": (cache, NUM_VERIFIED, True, 5),
        "fast_step_ms": (cache, 1, False, 10),
        "draft_step_bf16_cache_ms": (draft, 1, False, 10),
    }
    return {key: _median_ms(forward, *case) for key, case in cases.items()}


def _median_ms(forward, kv, num_new, invariant, repeats) -> float:
    forward(kv, num_new, invariant)  # warm-up: compiles the kernels of this shape
    durations = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        forward(kv, num_new, invariant)
        torch.cuda.synchronize()
        durations.append(time.perf_counter() - start)
    return statistics.median(durations) * 1e3


def _verify_equals_steps(runner, cache, continuation) -> bool:
    """A verification over a copy of the cache at another capacity (other strides) against
    one-token steps over another copy."""
    steps_cache = cache.clone()
    # Capacities are rounded up: 4096 slots more is surely another one, hence other strides.
    verify_cache = cache.clone(capacity=cache.num_tokens + 4096)
    steps = [
        runner.forward([SequenceInput(token.view(1), steps_cache)], invariant=True)[0]
        for token in continuation
    ]
    (verified,) = runner.forward(
        [SequenceInput(continuation, verify_cache, NUM_VERIFIED)], invariant=True
    )
    return torch.equal(torch.cat(steps), verified)


def plot(result: dict, path) -> None:
    plt = pyplot()
    per_dtype = result["per_dtype"]
    figure, axes = plt.subplots(1, len(per_dtype), figsize=(5 * len(per_dtype), 4), squeeze=False)
    for ax, (dtype, timings) in zip(axes[0], per_dtype.items()):
        cases = list(timings["triton"])
        x = range(len(cases))
        for offset, (name, color) in zip(
            (-0.2, 0.2), (("torch", "tab:gray"), ("triton", "tab:blue"))
        ):
            ax.bar(
                [i + offset for i in x],
                [timings[name][c] for c in cases],
                0.4,
                label=name,
                color=color,
            )
        ax.set_xticks(list(x), [c.removesuffix("_ms") for c in cases], rotation=20, fontsize=8)
        ax.set_ylabel("ms")
        ax.set_title(f"{dtype} model", fontsize=10)
        ax.legend(fontsize=8)
    config = result["config"]
    save_figure(
        figure,
        path,
        f"exact forwards on {result['environment']['cuda']}, "
        f"{config['context_tokens']} tokens of context",
    )
