"""`vericache plan`: the fastest VeriCache deployment for remote prefix caching on given hardware
and workload, against full-KV serving on the same GPUs (vericache/sim/plan.py)."""

from __future__ import annotations

import json
from pathlib import Path

from vericache.cli.parser import int_list
from vericache.sim.plan import Hardware, plan
from vericache.sim.scenario import load_scenario


def add_parser(commands) -> None:
    parser = commands.add_parser("plan", help="recommend a remote-prefix deployment (simulated)")
    parser.add_argument("--model", required=True, help="a model profile, e.g. qwen2.5-32b")
    parser.add_argument("--hardware", required=True, help="a device profile, e.g. h200, or JSON")
    parser.add_argument("--local-gpus", type=int, required=True, help="GPUs beside the store")
    parser.add_argument("--remote-gpus", type=int, required=True, help="GPUs across the network")
    parser.add_argument("--tensor-parallel", type=int, default=1, help="GPUs per worker")
    parser.add_argument("--local-link", type=float, required=True, help="store to GPU, GB/s")
    parser.add_argument("--remote-link", type=float, required=True, help="network, GB/s")
    parser.add_argument("--latency-ms", type=float, default=0.0, help="network, one way")
    parser.add_argument("--workload", type=Path, required=True, help="FILE.yaml")
    parser.add_argument("--draft-lens", type=int_list, default=[4, 8, 16, 32])
    parser.add_argument("--max-p99-latency-s", type=float, help="recommend none slower")
    parser.add_argument("--json", action="store_true", help="print the whole plan as JSON")
    parser.set_defaults(handler=run)


def run(args) -> int:
    hardware = Hardware(
        device=args.hardware,
        local_gpus=args.local_gpus,
        remote_gpus=args.remote_gpus,
        store_gb_per_s=args.local_link,
        network_gb_per_s=args.remote_link,
        network_latency_ms=args.latency_ms,
        tensor_parallel=args.tensor_parallel,
    )
    workload = load_scenario(args.workload)
    result = plan(args.model, hardware, workload, tuple(args.draft_lens), args.max_p99_latency_s)
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    for name, summary in result["baselines"].items():
        print(f"{name}: {_line(summary)}")
    best = result["recommended"]
    if best is None:
        print("no VeriCache configuration meets the latency bound")
        return 0
    print(
        f"recommended: {best['compressor']}, x={best['draft_len']}, {best['num_verifiers']} "
        f"verifier(s) and {best['num_drafters']} drafter(s), {best['scheduling']} rounds: "
        f"{_line(best)}; {best['speedup']:.2f}x the best full-KV configuration"
    )
    if best["speedup"] < 1:
        print("full-KV serving is faster on this hardware and workload: VeriCache does not pay")
    print(f"device profile: {result['sources']['device']}")
    return 0


def _line(summary: dict) -> str:
    return (
        f"{summary['tokens_per_s']:.1f} tokens/s, p50 latency {summary['p50_latency_s']:.1f} s, "
        f"p99 {summary['p99_latency_s']:.1f} s"
    )
