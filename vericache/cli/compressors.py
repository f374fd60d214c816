"""`vericache compressors [--json]`: the registry, with each method's kind, mode and defaults."""

from __future__ import annotations

import json

from vericache.compress import COMPRESSORS
from vericache.compress.composed import composable


def add_parser(commands) -> None:
    parser = commands.add_parser("compressors", help="list the KV compressors and their parameters")
    parser.add_argument("--json", action="store_true", help="print a JSON list")
    parser.set_defaults(handler=run)


def run(args) -> int:
    described = [cls().describe() for _, cls in sorted(COMPRESSORS.items())]
    if args.json:
        print(json.dumps(described, indent=2))
        return 0
    for entry in described:
        params = ", ".join(f"{key}={value}" for key, value in entry["params"].items())
        print(f"{entry['name']:<14} {entry['kind']:<15} {entry['mode']:<8} {params}")
    print(f"\ncompose a dropper and a quantizer with '+', e.g. snapkv+kivi ({composable()})")
    return 0
