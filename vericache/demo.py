"""`make demo`: the distributed system on this machine, used through the client SDK.

A local Ray instance offers one `verifier` and two `drafter` resources; the verifier keeps full KV
in its LMCache store, the drafters receive compressed KV over an emulated slow link. A standard-
library module (3-4k tokens) is registered once as a prefix, then one coding request runs in each
mode: FULL_LOCAL (the reference), VERICACHE (lossless: it must equal FULL_LOCAL), FULL_REMOTE
(a drafter fetches the full KV over the slow link), LOSSY (a drafter decodes over compressed KV).

The compressor is KVzip at 4x: on CPUs token dropping drafts in about half the time of a full-KV
step (quantized KV is dequantized per step; see bench/results/decode_speed.json).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from vericache.bench.workloads import code_contexts
from vericache.client import Client
from vericache.engine.link import LinkSpec
from vericache.model.loader import DEFAULT_MODEL, load_tokenizer, resolve_model_dir
from vericache.serve.config import DrafterConfig, VerifierConfig

PROMPT = "Write a short example that uses the main functions of the module above."
MODES = ("full_local", "vericache", "full_remote", "lossy")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--draft-len", type=int, default=30)
    parser.add_argument("--compressor", default="kvzip", help="registry name")
    parser.add_argument("--ratio", type=float, default=4.0, help="token dropping")
    parser.add_argument("--bits", type=int, help="quantization (then pass --ratio 0)")
    parser.add_argument("--link-bandwidth", default="200MB/s")
    parser.add_argument("--link-latency", default="2ms")
    args = parser.parse_args(argv)

    import ray

    from vericache.serve.auth import Access
    from vericache.serve.launch import ray_workers
    from vericache.serve.server import distributed_server

    tokenizer = load_tokenizer(resolve_model_dir(DEFAULT_MODEL))
    context = code_contexts(tokenizer, 3000, 4000, count=1)[0]
    link = LinkSpec.parse(args.link_bandwidth, args.link_latency)
    print("Starting a local Ray instance: 1 verifier, 2 drafters (one thread each)...")
    ray.init(resources={"verifier": 1, "drafter": 2}, include_dashboard=False, log_to_driver=False)
    with tempfile.TemporaryDirectory(prefix="vericache-demo-") as root:
        verifier = VerifierConfig(
            root=Path(root), link=link, transfer_host="127.0.0.1", num_threads=1
        )
        drafter = DrafterConfig(num_threads=1)

        def workers():
            return ray_workers(verifier, drafter, 1, 2)

        # Loopback only, for this process's own client: no API keys (--insecure-no-auth).
        with distributed_server(workers, DEFAULT_MODEL, access=Access()) as server:
            print(f"Serving on {server.target}; slow link {args.link_bandwidth}, "
                  f"{args.link_latency}\n")  # fmt: skip
            with Client(server.target, timeout=600) as client:
                results = _run(client, context, args)
    ray.shutdown()
    print(_table(results))


def _run(client: Client, context, args) -> dict:
    started = time.perf_counter()
    prefix_id = client.put_prefix(
        context.text,
        compressor=args.compressor,
        ratio=args.ratio or None,
        bits=args.bits,
        on_progress=lambda p: print(f"  register {context.name}: {p.stage}", flush=True),
    )
    info = client.get_prefix(prefix_id)
    print(
        f"Prefix {prefix_id}: {info.num_tokens} tokens of {context.name}, registered in "
        f"{time.perf_counter() - started:.1f} s; full KV {info.full_kv_bytes / 1e6:.1f} MB, "
        f"compressed KV on the wire {info.compressed_kv_bytes / 1e6:.1f} MB\n"
    )
    print(f"Prompt: {PROMPT}\n")
    results = {}
    for mode in MODES:
        result = client.generate(
            PROMPT, prefix_id=prefix_id, mode=mode, max_tokens=args.max_tokens,
            draft_len=args.draft_len,
        )  # fmt: skip
        results[mode] = result
        print(f"--- {mode}: {result.text[:200]!r}\n", flush=True)
    return results


def _table(results: dict) -> str:
    reference = results["full_local"].token_ids
    header = (
        f"{'mode':<12} {'identical':>9} {'tokens/s':>9} {'TTFT s':>7} {'accepted/round':>15} "
        f"{'link MB':>8} {'store MB':>9}"
    )
    lines = [header, "-" * len(header)]
    for mode, result in results.items():
        stats = result.stats
        accepted = f"{stats['mean_accepted_per_round']:.1f}" if mode == "vericache" else "-"
        lines.append(
            f"{mode:<12} {'yes' if result.token_ids == reference else 'NO':>9} "
            f"{stats['tokens_per_s']:>9.1f} {stats['ttft_s']:>7.2f} {accepted:>15} "
            f"{stats['link_bytes'] / 1e6:>8.2f} {stats['store_bytes'] / 1e6:>9.1f}"
        )
    lines.append(
        "\nidentical: the same tokens as FULL_LOCAL. VERICACHE must be identical; LOSSY need not. "
        "link MB: bytes over the slow link to the drafters (a prefix already in a drafter's LRU "
        "costs nothing); store MB: full KV loaded from the verifier's store."
    )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
