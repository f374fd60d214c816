"""`vericache prefix put|list|get|delete`: registered prefixes of a running server.

`--api-key` (default $VERICACHE_API_KEY) authenticates; `--tls-ca FILE` connects over TLS trusting
that CA. A tenant sees only its own prefixes."""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

from vericache.errors import InvalidRequestError

DEFAULT_SERVER = "127.0.0.1:50051"


def add_parser(commands) -> None:
    parser = commands.add_parser("prefix", help="register, list, inspect or delete prefixes")
    actions = parser.add_subparsers(dest="action", required=True)
    put = actions.add_parser("put", help="register FILE's text as a prefix; prints its id")
    put.add_argument("file", type=Path)
    put.add_argument("--compressor", default="snapkv", help="`vericache compressors` lists them")
    put.add_argument("--ratio", type=float, help="compression ratio (token dropping)")
    put.add_argument("--bits", type=int, help="bits per value (quantization)")
    put.add_argument(
        "--compressed-dtype",
        choices=("bfloat16", "float16"),  # the server checks them: no torch import in a client
        help="16-bit storage of the kept tokens (token dropping; default: the model's dtype)",
    )
    put.add_argument("--quiet", action="store_true", help="no progress on stderr")
    actions.add_parser("list", help="every registered prefix")
    get = actions.add_parser("get", help="one prefix")
    get.add_argument("prefix_id")
    delete = actions.add_parser("delete", help="delete one prefix")
    delete.add_argument("prefix_id")
    for action in actions.choices.values():
        action.add_argument("--server", default=DEFAULT_SERVER, help="HOST:PORT of the API")
        action.add_argument("--timeout", type=float, default=600.0, help="seconds")
        add_connection_arguments(action)
    parser.set_defaults(handler=run)


def add_connection_arguments(parser) -> None:
    """--api-key and --tls-ca, for every command that talks to a server."""
    parser.add_argument("--api-key", help="the server's API key (default: $VERICACHE_API_KEY)")
    parser.add_argument("--tls-ca", type=Path, help="PEM CA certificate: connect over TLS")


def connection_options(args) -> dict:
    """Client keyword arguments from --api-key and --tls-ca."""
    root_certificates = None
    if args.tls_ca is not None:
        try:
            root_certificates = args.tls_ca.read_bytes()
        except OSError as exc:
            raise InvalidRequestError(f"cannot read --tls-ca: {exc}") from None
    return {"api_key": args.api_key, "root_certificates": root_certificates}


def run(args) -> int:
    from vericache.client import Client

    with Client(args.server, timeout=args.timeout, **connection_options(args)) as client:
        if args.action == "put":
            print(_put(client, args))
        elif args.action == "list":
            print(json.dumps([dataclasses.asdict(p) for p in client.list_prefixes()], indent=2))
        elif args.action == "get":
            print(json.dumps(dataclasses.asdict(client.get_prefix(args.prefix_id)), indent=2))
        else:
            print(json.dumps({"deleted": client.delete_prefix(args.prefix_id)}))
    return 0


def _put(client, args) -> str:
    if not args.file.is_file():
        raise InvalidRequestError(f"{args.file} is not a file")

    began = {"stage": None, "at": time.perf_counter()}

    def report(progress) -> None:
        """Each stage with the seconds it took, once the next one begins."""
        now = time.perf_counter()
        if began["stage"] not in (None, "queued") and not args.quiet:
            seconds = now - began["at"]
            print(f"{began['stage']}: {seconds:.1f} s", file=sys.stderr, flush=True)
        if progress.stage == "done" and not args.quiet:
            known = " (registered already)" if progress.existed else ""
            print(f"done: {progress.num_tokens} tokens{known}", file=sys.stderr, flush=True)
        began.update(stage=progress.stage, at=now)

    text = args.file.read_text()
    return client.put_prefix(
        text,
        compressor=args.compressor,
        ratio=args.ratio,
        bits=args.bits,
        dtype=args.compressed_dtype,
        on_progress=report,
    )
