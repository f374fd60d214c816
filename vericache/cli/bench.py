"""`vericache bench NAME [--quick] [--json OUT] [--plot OUT.png] ...`: benchmarks under bench/.

Each benchmark module has add_arguments(parser), run(args) -> dict with a top-level `summary`, and
plot(result, path). Modules are imported only when their benchmark runs.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

from vericache.bench import BENCHMARKS
from vericache.cli.parser import OneLineErrorParser


def add_parser(commands) -> None:
    parser = commands.add_parser("bench", help="run a benchmark: JSON with a summary, PNG plot")
    parser.add_argument("benchmark", choices=sorted(BENCHMARKS))
    parser.add_argument("options", nargs=argparse.REMAINDER, help="the benchmark's own options")
    parser.set_defaults(handler=run)


def parse_benchmark_args(name: str, argv: list[str]):
    module = importlib.import_module(BENCHMARKS[name])
    parser = OneLineErrorParser(prog=f"vericache bench {name}", description=module.__doc__)
    parser.add_argument("--quick", action="store_true", help="a reduced run (minutes on 2 cores)")
    parser.add_argument("--json", type=Path, help="write the whole result here")
    parser.add_argument("--plot", type=Path, help="write a PNG plot here")
    module.add_arguments(parser)
    return module, parser.parse_args(argv)


def run(args) -> int:
    module, bench_args = parse_benchmark_args(args.benchmark, args.options)
    result = module.run(bench_args)
    if bench_args.json:
        bench_args.json.parent.mkdir(parents=True, exist_ok=True)
        bench_args.json.write_text(json.dumps(result, indent=2) + "\n")
    if bench_args.plot:
        bench_args.plot.parent.mkdir(parents=True, exist_ok=True)
        module.plot(result, bench_args.plot)
    json.dump({"benchmark": args.benchmark, "summary": result["summary"]}, sys.stdout, indent=2)
    print()
    return 0
