"""The `vericache` command line (a stable contract: tools read its JSON)."""

from __future__ import annotations

import argparse
import sys

from vericache.cli import (
    bench,
    calibrate,
    compressors,
    generate,
    kv_size,
    plan,
    prefix,
    serve,
    sim,
)
from vericache.cli.parser import OneLineErrorParser
from vericache.errors import VeriCacheError


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(prog="vericache", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True, parser_class=OneLineErrorParser)
    generate.add_parser(commands)
    bench.add_parser(commands)
    calibrate.add_parser(commands)
    compressors.add_parser(commands)
    kv_size.add_parser(commands)
    serve.add_parser(commands)
    prefix.add_parser(commands)
    sim.add_parser(commands)
    plan.add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.handler(args) or 0
    except VeriCacheError as exc:
        print(f"vericache: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
