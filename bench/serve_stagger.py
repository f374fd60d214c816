"""Scheduling the distributed system's rounds: staggered against lock-step and per-request rounds,
on Ray workers whose verifier holds few full KVs and loads them from its store over a slow path.

One verifier and one drafter (Ray, one thread each, as in `bench remote-prefix`), P prefixes of
3-4k tokens (standard-library modules) registered with one compressor, B requests in flight at
once (CONTEXT_PROMPTS about each prefix), draft length x. The verifier keeps at most
`--resident-full-kvs` requests' full KV on its device (`VerifierConfig.resident_bytes`), so a round
reloads its prefix from the store, and its loads onto the device are held to a bandwidth at which
one prefix's full KV takes `--load-draft-steps` scheduled iterations (the iteration time measured
by a calibration stream over an unthrottled path). The same stream is served on fresh workers under
each `CoordinatorConfig.scheduling`:
- per-request: each request's rounds on their own (batched in the workers); a round's load happens
  inside its verification, and the verifier evicts by LRU between rounds;
- lockstep (the paper's baseline): every request drafts x, then all load and verify together;
- staggered: each request's load starts so as to end just before its own verification, and
  verifications spread over the iterations within the verifier's memory.

Headline `staggered_over_lockstep` and `staggered_over_per_request`: tokens/s of the whole stream.
`peak_resident_full_kvs`: the verifier's measured high-water mark of resident full KV, in
requests' full KVs. `identical`: every output equals FULL_LOCAL's (served unthrottled).
"""

from __future__ import annotations

import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from vericache.bench.common import compressor_from_label, environment, pyplot, save_figure
from vericache.bench.serving import ray_server, ray_session, serve_stream, stream_record
from vericache.bench.workloads import CONTEXT_PROMPTS, code_contexts
from vericache.client import Client, PrefixInfo
from vericache.engine.device_memory import slot_bytes
from vericache.engine.prompt import build_chat_prompt
from vericache.kv.slots import reserved_full_kv_bytes
from vericache.model.config import ModelConfig
from vericache.model.loader import DEFAULT_MODEL, load_tokenizer, resolve_model_dir
from vericache.scheduler import SchedulerConfig
from vericache.serve.config import CoordinatorConfig, DrafterConfig, VerifierConfig

POLICIES = ("per-request", "lockstep", "staggered")
PREFIX_FIELDS = ("num_tokens", "full_kv_bytes", "compressed_kv_bytes")  # recorded of each prefix


def add_arguments(parser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--compressor", default="kvzip-4x", help="label, e.g. snapkv-4x")
    parser.add_argument("--prefixes", type=int, help="distinct prefixes P (2; quick 1)")
    parser.add_argument("--requests", type=int, help="requests B, all in flight (8; quick 4)")
    parser.add_argument("--max-tokens", type=int, help="output tokens per request (96; quick 32)")
    parser.add_argument("--draft-len", type=int, help="x (16; quick 12)")
    parser.add_argument(
        "--resident-full-kvs", type=float, default=2.0, help="the verifier's device, in full KVs"
    )
    parser.add_argument(
        "--load-draft-steps",
        type=float,
        default=3.0,
        help="iterations one prefix's full-KV load takes: sets the store-to-device bandwidth",
    )
    parser.add_argument("--window", type=int, default=160, help="scheduler window, iterations")


@dataclass(frozen=True)
class Setup:
    """The stream and the verifier's memory, resolved from the arguments."""

    model: str
    compressor: str
    num_prefixes: int
    num_requests: int
    max_tokens: int
    draft_len: int
    resident_full_kvs: float
    load_draft_steps: float
    window: int
    quick: bool


def setup(args) -> Setup:
    def pick(value, full, reduced):
        return value if value is not None else (reduced if args.quick else full)

    return Setup(
        model=args.model,
        compressor=args.compressor,
        num_prefixes=pick(args.prefixes, 2, 1),
        num_requests=pick(args.requests, 8, 4),
        max_tokens=pick(args.max_tokens, 96, 32),
        draft_len=pick(args.draft_len, 16, 12),
        resident_full_kvs=args.resident_full_kvs,
        load_draft_steps=args.load_draft_steps,
        window=args.window,
        quick=args.quick,
    )


def run(args) -> dict:
    spec = setup(args)
    model_dir = resolve_model_dir(spec.model)
    tokenizer = load_tokenizer(model_dir)
    token_range = (1000, 1500) if spec.quick else (3000, 4000)
    contexts = code_contexts(tokenizer, *token_range, spec.num_prefixes, truncate=True)
    # Request i asks prompt i about prefix i mod P.
    jobs = [
        (i % spec.num_prefixes, CONTEXT_PROMPTS[i % len(CONTEXT_PROMPTS)])
        for i in range(spec.num_requests)
    ]
    request_kv_bytes = _request_kv_bytes(spec, model_dir, tokenizer, contexts, jobs)
    resident_bytes = int(spec.resident_full_kvs * request_kv_bytes)
    with ray_session(1), tempfile.TemporaryDirectory() as directory:
        root = Path(directory)
        prefixes = _register(spec, root, contexts)
        prefix_kv_bytes = max(p.full_kv_bytes for p in prefixes)
        stream = [(prefixes[p].prefix_id, prompt) for p, prompt in jobs]

        def serve(scheduling: str, load_bandwidth: float | None, mode: str = "vericache"):
            verifier = VerifierConfig(
                model=spec.model, root=root, resident_bytes=resident_bytes,
                load_bandwidth=load_bandwidth,
            )  # fmt: skip
            return _serve(spec, verifier, scheduling, stream, mode)

        full_local, reference = serve("per-request", None, mode="full_local")
        calibration, _ = serve("staggered", None)
        bandwidth = prefix_kv_bytes / (spec.load_draft_steps * calibration["iteration_s"])
        runs, outputs = {}, {}
        for policy in POLICIES:
            runs[policy], outputs[policy] = serve(policy, bandwidth)
    return {
        "benchmark": "serve-stagger",
        "summary": _summary(runs, outputs, reference, request_kv_bytes, bandwidth),
        "definitions": {
            "tokens_per_s": "output tokens of the stream / its wall time",
            "peak_resident_full_kvs": "the verifier's high-water mark of resident full KV / one "
            "request's full KV; requests open (prefill their prompt turn) outside the schedule, "
            "so the plan bounds only what the rounds load",
            "load_bandwidth_mb_s": "store-to-device bandwidth: one prefix's full KV in "
            f"{spec.load_draft_steps:g} iterations of the calibration stream",
            "identical": "every output of every policy equals FULL_LOCAL's",
        },
        "config": asdict(spec),
        "environment": environment(),
        "request_full_kv_bytes": request_kv_bytes,
        "prefix_full_kv_bytes": prefix_kv_bytes,
        # What the simulator needs of the prefixes and the drafter (bench sim-validate).
        "prefixes": [{name: getattr(p, name) for name in PREFIX_FIELDS} for p in prefixes],
        "drafter_kv_cache_bytes": DrafterConfig(model=spec.model).kv_cache_bytes,
        "calibration": calibration,
        "full_local": full_local,
        "runs": runs,
    }


def _request_kv_bytes(spec: Setup, model_dir, tokenizer, contexts, jobs) -> int:
    """A session's full KV on the verifier (float32), for the longest request of the stream."""
    config = ModelConfig.from_dir(model_dir)
    longest = max(
        len(build_chat_prompt(tokenizer, contexts[p].text, prompt).token_ids) for p, prompt in jobs
    )
    return reserved_full_kv_bytes(
        longest, spec.max_tokens, spec.draft_len, config.max_position_embeddings,
        slot_bytes(config, 4),
    )  # fmt: skip


def _register(spec: Setup, root: Path, contexts) -> list[PrefixInfo]:
    """Registers every prefix; returns what the server says of each."""
    params = compressor_from_label(spec.compressor).spec()["params"]
    verifier = VerifierConfig(model=spec.model, root=root)
    with ray_server(verifier, DrafterConfig(model=spec.model), 1) as server:
        with Client(server.target) as client:
            prefix_ids = [
                client.put_prefix(
                    text=context.text,
                    compressor=spec.compressor.rsplit("-", 1)[0],
                    ratio=params.get("ratio"),
                    bits=params.get("bits"),
                )
                for context in contexts
            ]
            return [client.get_prefix(p) for p in prefix_ids]


def coordinator_config(spec: Setup, scheduling: str) -> CoordinatorConfig:
    """How the stream's rounds are driven under one policy: all its requests at once."""
    return CoordinatorConfig(
        default_draft_len=spec.draft_len,
        max_running=spec.num_requests,
        scheduling=scheduling,
        scheduler=SchedulerConfig(window=spec.window),
    )


def _serve(spec: Setup, verifier: VerifierConfig, scheduling: str, stream, mode: str):
    """The stream on fresh workers: its record (with the verifier's peak residency and, when
    scheduled, the measured iteration time) and every output's token ids."""
    config = coordinator_config(spec, scheduling)
    with ray_server(verifier, DrafterConfig(model=spec.model), 1, config) as server:
        wall_s, results, cpu_s, _ = serve_stream(
            server.target, stream, mode, spec.max_tokens, spec.draft_len, spec.num_requests
        )
        record = stream_record(wall_s, results, cpu_s)
        residency = server.run(server.coordinator.backend.verifiers[0].residency())
        record["peak_resident_bytes"] = residency.peak_bytes
        schedules = list(server.coordinator.backend.schedules.values())
        record["iteration_s"] = schedules[0].scheduler.costs.iteration_s if schedules else None
    shown = (
        "open" if verifier.load_bandwidth is None else f"{verifier.load_bandwidth / 1e6:.0f} MB/s"
    )
    print(
        f"[serve-stagger] {mode}, {scheduling}, loads {shown}: {record['tokens_per_s']:.2f} tok/s"
    )
    return record, [result.token_ids for result in results]


def _summary(runs, outputs, reference, request_kv_bytes: int, bandwidth: float) -> dict:
    tokens_per_s = {policy: runs[policy]["tokens_per_s"] for policy in POLICIES}
    return {
        "staggered_over_lockstep": tokens_per_s["staggered"] / tokens_per_s["lockstep"],
        "staggered_over_per_request": tokens_per_s["staggered"] / tokens_per_s["per-request"],
        "tokens_per_s": tokens_per_s,
        "peak_resident_full_kvs": {
            policy: runs[policy]["peak_resident_bytes"] / request_kv_bytes for policy in POLICIES
        },
        "identical": all(outputs[policy] == reference for policy in POLICIES),
        "load_bandwidth_mb_s": bandwidth / 1e6,
    }


def plot(result: dict, path) -> None:
    """Tokens/s and the verifier's peak resident full KV, per scheduling policy."""
    plt = pyplot()
    summary = result["summary"]
    fig, (rates, memory) = plt.subplots(1, 2, figsize=(10, 4))
    colors = ["C7", "C1", "C0"]
    rates.bar(POLICIES, [summary["tokens_per_s"][p] for p in POLICIES], color=colors)
    rates.set(ylabel="tokens/s over the stream", title="throughput")
    memory.bar(POLICIES, [summary["peak_resident_full_kvs"][p] for p in POLICIES], color=colors)
    budget = result["config"]["resident_full_kvs"]
    memory.axhline(budget, color="red", linestyle=":", label=f"budget {budget:g}")
    memory.set(ylabel="full KVs resident at once (peak)", title="verifier device memory")
    memory.legend(fontsize=8)
    config = result["config"]
    title = (
        f"{config['num_requests']} requests over {config['num_prefixes']} prefixes, "
        f"{config['max_tokens']} tokens each, {config['compressor']}, x={config['draft_len']}, "
        f"loads {summary['load_bandwidth_mb_s']:.0f} MB/s"
    )
    save_figure(fig, path, title)
