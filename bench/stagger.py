"""Staggered against lock-step scheduling of long-context decoding on a link-bound workload, on the
embedded model.

B requests (code contexts and HumanEval prompts, as in `bench long-context`) are decoded by the
same `LongContextEngine` twice, with no device-memory limit, over an emulated host-to-device link
slow enough that one full-KV load takes `--load-draft-steps` batched draft steps (the bandwidth is
set from a draft step timed at start-up):
- LOCKSTEP (the paper's baseline): every running request drafts x tokens, then the B full-KV loads
  move together and all B verify in one iteration; compute idles while the link moves B full KVs,
  and B full KVs sit on the device at once.
- STAGGERED: each request's load starts so as to end just before its own verification, and the
  verifications spread over the iterations, so the link moves loads while the others draft and at
  most a few full KVs are on the device at a time.

Each request writes `--max-tokens` tokens (256), about ten rounds: requests finish about a round
apart, and with a few rounds each (96 tokens) the last requests decoding alone, as many as one
or two, took about 40% of the iterations, so that the run measured the drain more than B
concurrent requests.

Headline `staggered_over_lockstep`: output tokens/s over the decode iterations, staggered over
lock-step (target >= 1.3). `peak_memory_ratio`: the device-memory high-water mark of staggered over
lock-step's; `peak_memory_full_kvs`: the most full KV on the device at once, in full KVs
(staggering aims at one or two, lock-step holds B). `identical`: both decode the same tokens.
"""

from __future__ import annotations

from vericache.bench.common import environment, pyplot, save_figure
from vericache.bench.decode_speed import time_steps
from vericache.bench.long_context import (
    add_model_arguments,
    load_runner,
    long_context_requests,
    run_engine,
    without_tokens,
    workload_config,
    workload_title,
)
from vericache.engine.device_memory import full_kv_bytes
from vericache.engine.engine import Engine, EngineConfig
from vericache.engine.long_context_config import LongContextConfig
from vericache.scheduler import SchedulerConfig

TARGET = 1.3


def add_arguments(parser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--requests", type=int, help="concurrent requests B (8; quick 8)")
    parser.add_argument("--context-tokens", type=int, help="per request (3000; quick 1000)")
    parser.add_argument("--max-tokens", type=int, help="output tokens per request (256; quick 32)")
    parser.add_argument("--draft-len", type=int, help="x, both policies (30; quick 12)")
    parser.add_argument(
        "--load-draft-steps",
        type=float,
        default=3.0,
        help="draft steps (of all B together) one full-KV load takes: sets the link bandwidth",
    )
    parser.add_argument("--window", type=int, default=160, help="scheduler window, iterations")
    parser.add_argument(
        "--load-slack",
        type=int,
        default=SchedulerConfig.load_slack,
        help="iterations a load may span beyond S (SchedulerConfig.load_slack)",
    )


def run(args) -> dict:
    num_requests = args.requests or 8
    context_tokens = args.context_tokens or (1000 if args.quick else 3000)
    max_tokens = args.max_tokens or (32 if args.quick else 256)
    draft_len = args.draft_len or (12 if args.quick else 30)
    loaded, runner = load_runner(args.model, args.device)
    requests = long_context_requests(
        loaded.tokenizer, num_requests, context_tokens, max_tokens, args.compressor, draft_len
    )
    full_bytes = full_kv_bytes(requests[0], loaded.config, runner.dtype.itemsize)
    draft_step_s = _draft_step_s(runner, loaded.tokenizer, requests)
    bandwidth = full_bytes / (args.load_draft_steps * draft_step_s)
    print(
        f"[stagger] draft step of {num_requests}: {draft_step_s * 1e3:.0f} ms; full KV "
        f"{full_bytes / 1e6:.0f} MB; link {bandwidth / 1e6:.0f} MB/s"
    )
    # Every request prefilled before decoding starts: B requests are in flight from the first
    # round on, under either policy.
    common = {
        "link_bytes_per_s": bandwidth,
        "iteration_s": draft_step_s,  # the start-up estimate; both refine it as they run
        "scheduler": SchedulerConfig(window=args.window, load_slack=args.load_slack),
        "max_parked": num_requests,
    }
    configs = {
        "lockstep": LongContextConfig(lockstep_draft_len=draft_len, **common),
        "staggered": LongContextConfig(**common),
    }
    runs = {}
    for name, config in configs.items():
        runs[name] = run_engine(runner, loaded.tokenizer, requests, config)
        runs[name]["peak_memory_full_kvs"] = runs[name]["stats"]["peak_full_kv_bytes"] / full_bytes
        print(f"[stagger] {name}: {_describe(runs[name])}")
    lockstep, staggered = runs["lockstep"], runs["staggered"]
    speedup = staggered["stats"]["decode_tokens_per_s"] / lockstep["stats"]["decode_tokens_per_s"]
    peak_ratio = staggered["stats"]["peak_device_bytes"] / lockstep["stats"]["peak_device_bytes"]
    return {
        "benchmark": "stagger",
        "summary": {
            "staggered_over_lockstep": speedup,
            "peak_memory_ratio": peak_ratio,
            "peak_memory_full_kvs": {name: r["peak_memory_full_kvs"] for name, r in runs.items()},
            "identical": staggered["token_ids"] == lockstep["token_ids"],
            "meets_target": speedup >= TARGET,
        },
        "definitions": {
            "staggered_over_lockstep": "decode tokens/s (output tokens after each request's "
            "first / time in decode iterations), staggered over lock-step (target >= 1.3)",
            "peak_memory_ratio": "device-memory high-water mark, staggered / lock-step",
            "peak_memory_full_kvs": "high-water mark of the full KV on the device / one full KV",
        },
        "config": workload_config(args, runner, requests, max_tokens, draft_len, full_bytes)
        | {
            "draft_step_s": draft_step_s,
            "load_draft_steps": args.load_draft_steps,
            "link_bytes_per_s": bandwidth,
            "window": args.window,
            "load_slack": args.load_slack,
            "quick": args.quick,
        },
        "runs": {name: without_tokens(r) for name, r in runs.items()},
        "environment": environment(),
    }


def _draft_step_s(runner, tokenizer, requests) -> float:
    """Seconds of one batched draft step over every request's compressed prefix KV."""
    engine = Engine(runner, tokenizer, EngineConfig(prefix_cache_bytes=0))
    caches = []
    for request in requests:
        prefix_ids = tuple(request.prompt_ids[: request.num_prefix_tokens])
        caches.append(engine.compressed_prefix_kv(prefix_ids, request.compressor))
    time_steps(runner, caches, 2, invariant=False)  # warm-up
    return time_steps(runner, caches, 5, invariant=False)


def _describe(run: dict) -> str:
    stats = run["stats"]
    return (
        f"{stats['decode_tokens_per_s']:.1f} decode tokens/s, peak "
        f"{stats['peak_device_bytes'] / 1e9:.2f} GB ({run['peak_memory_full_kvs']:.1f} full KVs), "
        f"{stats['num_late_loads']}/{stats['num_loads']} loads "
        f"late, wall {run['wall_s']:.0f} s"
    )


def plot(result: dict, path) -> None:
    plt = pyplot()
    runs, summary, config = result["runs"], result["summary"], result["config"]
    names = list(runs)
    colors = ["tab:gray", "tab:blue"]
    figure, (rates, memory) = plt.subplots(1, 2, figsize=(10, 4))
    rates.bar(names, [runs[n]["stats"]["decode_tokens_per_s"] for n in names], color=colors)
    rates.set_ylabel("decode tokens/s")
    rates.set_title(f"{summary['staggered_over_lockstep']:.2f}x (target {TARGET:g}x)", fontsize=10)
    memory.bar(names, [runs[n]["stats"]["peak_device_bytes"] / 1e9 for n in names], color=colors)
    memory.axhline(config["weights_bytes"] / 1e9, color="black", linewidth=0.8, label="weights")
    memory.set_ylabel("device memory peak, GB")
    memory.set_title(f"peak ratio {summary['peak_memory_ratio']:.2f}", fontsize=10)
    memory.legend(fontsize=8)
    load = (
        f"a full-KV load = {config['load_draft_steps']:g} draft steps "
        f"({config['link_bytes_per_s'] / 1e6:.0f} MB/s)"
    )
    save_figure(figure, path, f"{workload_title(config)}, {load}")
