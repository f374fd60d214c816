"""`vericache sim`: a simulated deployment (vericache/sim/scenario.py) as one JSON."""

from __future__ import annotations

import json
from pathlib import Path

from vericache.sim.scenario import load_scenario, run_scenario


def add_parser(commands) -> None:
    parser = commands.add_parser("sim", help="simulate a deployment described in a scenario file")
    parser.add_argument("--scenario", type=Path, required=True, help="FILE.yaml (or .json)")
    parser.add_argument("--json", action="store_true", help="print the whole result as JSON")
    parser.add_argument("--plot", type=Path, help="PNG: throughput, link and KV over time")
    parser.set_defaults(handler=run)


def run(args) -> int:
    result = run_scenario(load_scenario(args.scenario))
    if args.plot:
        from vericache.sim.timeline_plot import plot_timelines

        plot_timelines(result, args.plot)
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    for name in ("vericache", *result["baselines"]):
        summary = result[name]
        print(
            f"{name}: {summary['tokens_per_s']:.1f} tokens/s, p50 latency "
            f"{summary['p50_latency_s']:.1f} s, p99 {summary['p99_latency_s']:.1f} s"
        )
    print(
        f"speedup over the best full-KV configuration {result['speedup']:.2f}x; "
        f"device profile: {result['sources']['device']}"
    )
    return 0
