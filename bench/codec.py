"""Wire size and speed of the KV codec (vericache/kv/codec.py) on a real prefix, every compressor.

The prefix is the system turn holding a 3-4k-token Python standard-library module (0.5-0.8k tokens
when quick), prefilled by the embedded model in bfloat16. Each cache (the full KV, KIVI at 8/4/2
bits, and every registered token-dropping compressor at 4x) is encoded and decoded, and the round
trip is checked bit-exact.

Definitions: wire fraction = encoded bytes / bf16 full-KV bytes of the prefix. Throughput = bf16
full-KV bytes of the prefix / median seconds to encode (or decode), in MB/s (10^6 bytes), with
torch on one thread (numpy and zstd run single-threaded). Targets: kivi-4bit <= 1/4.5,
kivi-2bit <= 1/8, every 4x token-dropping compressor <= 1/4.2, and encode and decode >= 200 MB/s
for every cache (`min_encode_mb_s`, `min_decode_mb_s`: the worst over all of them, full KV
included).
"""

from __future__ import annotations

import statistics
import time

import torch

from vericache.bench.common import compressor_from_label, environment, pyplot
from vericache.bench.workloads import code_contexts
from vericache.compress import COMPRESSORS, CompressionKind, ModelContext
from vericache.engine.engine import Engine
from vericache.engine.prompt import build_chat_prompt
from vericache.errors import InvalidRequestError
from vericache.kv.cache import KVCache
from vericache.kv.codec import decode_bytes, encode_bytes, model_fingerprint
from vericache.kv.codec_errors import CodecError
from vericache.model.loader import DEFAULT_MODEL

FULL_LABEL = "full"
WIRE_TARGETS = {"kivi-4bit": 1 / 4.5, "kivi-2bit": 1 / 8}
TOKEN_DROPPING_TARGET = 1 / 4.2  # every token-dropping compressor at 4x
SPEED_TARGET_MB_S = 200.0


def add_arguments(parser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--labels", help="comma-separated compressor labels (default: see above)")
    parser.add_argument("--repeats", type=int, help="timed encodes and decodes per cache (5; 3)")


def default_labels(quick: bool) -> list[str]:
    if quick:
        return ["kivi-4bit", "kivi-2bit", "streamingllm-4x"]
    dropping = [
        f"{name}-4x"
        for name, cls in sorted(COMPRESSORS.items())
        if cls.kind is CompressionKind.TOKEN_DROPPING and name != "streamingllm"
    ]
    other_quantizers = [
        f"{name}-{bits}bit"
        for name, cls in sorted(COMPRESSORS.items())
        if cls.kind is CompressionKind.QUANTIZATION and name != "kivi"
        for bits in (4, 2)
    ]
    return ["kivi-8bit", "kivi-4bit", "kivi-2bit", "streamingllm-4x", *dropping, *other_quantizers]


def measure(state, fingerprint: str, full_bf16_bytes: int, repeats: int) -> dict:
    """Wire bytes and median encode/decode times of one CacheState, on one torch thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        blob = encode_bytes(state, fingerprint)  # also warms up
        if not decode_bytes(blob, fingerprint).equals(state):
            raise CodecError("the KV codec did not round-trip a cache exactly")
        encode_s = _median_seconds(lambda: encode_bytes(state, fingerprint), repeats)
        decode_s = _median_seconds(lambda: decode_bytes(blob, fingerprint), repeats)
    finally:
        torch.set_num_threads(threads)
    return {
        "wire_bytes": len(blob),
        "encode_s": encode_s,
        "decode_s": decode_s,
        "encode_mb_s": full_bf16_bytes / encode_s / 1e6,
        "decode_mb_s": full_bf16_bytes / decode_s / 1e6,
    }


def _median_seconds(action, repeats: int) -> float:
    durations = []
    for _ in range(repeats):
        start = time.perf_counter()
        action()
        durations.append(time.perf_counter() - start)
    return statistics.median(durations)


def measure_caches(
    full: KVCache, labels, context: ModelContext | None, fingerprint: str, repeats: int
) -> dict:
    """Records per label (the full KV first, as `full`), and the labels skipped with why."""
    full_bf16_bytes = bf16_bytes(full)
    records = {FULL_LABEL: {"kind": "full", "resident_bytes": full.nbytes}}
    records[FULL_LABEL].update(measure(full.to_state(), fingerprint, full_bf16_bytes, repeats))
    skipped = {}
    for label in labels:
        try:
            compressor = compressor_from_label(label)
            cache = compressor.compress(full, context)
        except InvalidRequestError as exc:  # not registered, no such strength, needs the model
            skipped[label] = str(exc)
            continue
        record = {"kind": compressor.kind.value, "resident_bytes": cache.resident_bytes}
        record.update(measure(cache.to_state(), fingerprint, full_bf16_bytes, repeats))
        records[label] = record
        print(
            f"[codec] {label}: wire 1/{full_bf16_bytes / record['wire_bytes']:.2f}, "
            f"encode {record['encode_mb_s']:.0f} MB/s, decode {record['decode_mb_s']:.0f} MB/s"
        )
    return {"full_bf16_bytes": full_bf16_bytes, "records": records, "skipped": skipped}


def bf16_bytes(full: KVCache) -> int:
    """Bytes of the full KV's keys and values at 2 bytes an element, whatever its dtype."""
    keys, _ = full.layers[0].keys_values()
    return 2 * 2 * len(full.layers) * full.num_tokens * keys[0].numel()


def summarize(measured: dict, context_tokens: int) -> dict:
    full_bytes, records = measured["full_bf16_bytes"], measured["records"]
    fractions = {label: r["wire_bytes"] / full_bytes for label, r in records.items()}
    dropping = [
        fractions[label]
        for label, r in records.items()
        if r["kind"] == CompressionKind.TOKEN_DROPPING.value and label.endswith("-4x")
    ]
    encode = {label: r["encode_mb_s"] for label, r in records.items()}
    decode = {label: r["decode_mb_s"] for label, r in records.items()}
    meets = {
        f"{label}_wire<=1/{1 / target:g}": fractions[label] <= target
        if label in fractions
        else None
        for label, target in WIRE_TARGETS.items()
    }
    meets[f"token_dropping_4x_wire<=1/{1 / TOKEN_DROPPING_TARGET:g}"] = (
        max(dropping) <= TOKEN_DROPPING_TARGET if dropping else None
    )
    meets[f"encode>={SPEED_TARGET_MB_S:g}MB/s"] = min(encode.values()) >= SPEED_TARGET_MB_S
    meets[f"decode>={SPEED_TARGET_MB_S:g}MB/s"] = min(decode.values()) >= SPEED_TARGET_MB_S
    return {
        "wire_fraction": fractions,
        "wire_ratio": {label: 1 / fraction for label, fraction in fractions.items()},
        "resident_fraction": {
            label: r["resident_bytes"] / full_bytes for label, r in records.items()
        },
        "encode_mb_s": encode,
        "decode_mb_s": decode,
        "min_encode_mb_s": min(encode.values()),
        "min_decode_mb_s": min(decode.values()),
        "meets_target": meets,
        "context_tokens": context_tokens,
        "full_bf16_bytes": full_bytes,
    }


def run(args) -> dict:
    repeats = args.repeats or (3 if args.quick else 5)
    labels = args.labels.split(",") if args.labels else default_labels(args.quick)
    engine = Engine.from_pretrained(args.model, dtype="bfloat16")
    low, high = (500, 800) if args.quick else (3000, 4000)
    context = code_contexts(engine.tokenizer, low, high, count=1, truncate=args.quick)[0]
    prompt = build_chat_prompt(engine.tokenizer, context.text, "")
    prefix = tuple(prompt.token_ids[: prompt.num_prefix_tokens])
    start = time.perf_counter()
    full = engine.prefix_kv(prefix)
    print(f"[codec] prefill of {len(prefix)} tokens: {time.perf_counter() - start:.1f}s")
    fingerprint = model_fingerprint(engine.model_config, args.model)
    measured = measure_caches(full, labels, engine.model_context(prefix), fingerprint, repeats)
    return {
        "benchmark": "codec",
        "summary": summarize(measured, len(prefix)),
        "definitions": {
            "wire_fraction": "encoded bytes / bf16 full-KV bytes of the prefix",
            "encode_mb_s": "bf16 full-KV bytes / median encode seconds / 1e6, one torch thread",
            "min_encode_mb_s": "worst encode_mb_s over every cache, the full KV included",
        },
        "config": {
            "model": args.model,
            "dtype": "bfloat16",
            "repeats": repeats,
            "quick": args.quick,
        },
        "environment": environment(),
        "context": {"files": context.name, "prefix_tokens": len(prefix)},
        **measured,
    }


def plot(result: dict, path) -> None:
    plt = pyplot()
    summary = result["summary"]
    labels = list(summary["wire_fraction"])
    fig, (sizes, speeds) = plt.subplots(1, 2, figsize=(13, 4.5))
    positions = range(len(labels))
    sizes.bar(
        [p - 0.2 for p in positions],
        [summary["resident_fraction"][x] for x in labels],
        width=0.4,
        color="tab:grey",
        label="resident",
    )
    sizes.bar(
        [p + 0.2 for p in positions],
        [summary["wire_fraction"][x] for x in labels],
        width=0.4,
        color="tab:blue",
        label="wire (encoded)",
    )
    targets = {**WIRE_TARGETS, "token dropping 4x": TOKEN_DROPPING_TARGET}
    for (name, target), color in zip(targets.items(), ("tab:red", "tab:purple", "tab:orange")):
        sizes.axhline(target, color=color, linestyle="--", label=f"{name} target 1/{1 / target:g}")
    for position, label in zip(positions, labels):
        fraction = summary["wire_fraction"][label]
        sizes.text(
            position + 0.2, fraction, f"1/{1 / fraction:.2f}", ha="center", va="bottom", fontsize=7
        )
    sizes.set_xticks(list(positions), labels, rotation=30, ha="right")
    sizes.set(ylabel="bytes / bf16 full KV", title=f"{summary['context_tokens']}-token prefix")
    sizes.legend(fontsize=7)
    speeds.bar(
        [p - 0.2 for p in positions],
        [summary["encode_mb_s"][x] for x in labels],
        width=0.4,
        label="encode",
    )
    speeds.bar(
        [p + 0.2 for p in positions],
        [summary["decode_mb_s"][x] for x in labels],
        width=0.4,
        label="decode",
    )
    speeds.axhline(SPEED_TARGET_MB_S, color="tab:red", linestyle="--", label="target")
    speeds.set_xticks(list(positions), labels, rotation=30, ha="right")
    speeds.set(ylabel="MB/s of bf16 full KV, one core", title="codec throughput")
    speeds.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
