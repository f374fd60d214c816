"""`vericache serve`: the gRPC API over Ray verifiers and drafters, until interrupted.

`--local` starts a Ray instance on this machine offering one `verifier` and N `drafter` resources;
`--address auto` (or HOST:PORT) joins a running cluster whose nodes offer them (cluster/, k8s/).
`--long-context` serves from this process alone, no Ray: one long-context engine (compressed KV on
the device, full KV in host memory) within `--memory-budget`, over a link of `--pcie-bandwidth`.
"""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path

from vericache.cli.generate import add_long_context_arguments, long_context_config
from vericache.errors import InvalidRequestError
from vericache.model.loader import DEFAULT_MODEL, DTYPES, cache_root
from vericache.serve.config import CoordinatorConfig, DrafterConfig, VerifierConfig, WorkerConfig
from vericache.serve.link import LinkSpec, parse_size


def add_parser(commands) -> None:
    parser = commands.add_parser(
        "serve", help="serve the gRPC API on Ray drafters and verifiers, or --long-context"
    )
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--local", action="store_true", help="start a Ray instance here")
    where.add_argument("--address", help="join a running Ray cluster ('auto' or HOST:PORT)")
    parser.add_argument("--host", default="127.0.0.1", help="API address (0.0.0.0: every one)")
    parser.add_argument("--port", type=int, default=50051)
    parser.add_argument("--verifiers", type=int, default=1)
    parser.add_argument("--drafters", type=int, default=2)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--device", default="auto", help="cpu, cuda, or auto (cuda if present)")
    parser.add_argument("--threads-per-worker", type=int, help="torch threads per worker")
    parser.add_argument("--root", type=Path, help="the verifiers' store and prefix catalog")
    parser.add_argument("--link-bandwidth", help="emulated slow link, e.g. 1.2GB/s (off: real)")
    parser.add_argument("--link-latency", help="emulated one-way link latency, e.g. 2ms")
    parser.add_argument("--resident-bytes", default="4GiB", help="full KV a verifier keeps")
    parser.add_argument("--drafter-cache-bytes", default="4GiB", help="a drafter's prefix LRU")
    parser.add_argument("--draft-len", type=int, default=30, help="default tokens per draft")
    parser.add_argument("--max-running", type=int, default=16)
    parser.add_argument("--max-waiting", type=int, default=64)
    parser.add_argument("--placement-timeout", type=float, default=300.0, help="seconds")
    add_long_context_arguments(parser)
    parser.set_defaults(handler=run)


def worker_options(args) -> dict:
    """What every worker (or the long-context engine) loads: model, dtype, device, threads."""
    return dict(
        model=args.model, dtype=args.dtype, device=args.device,
        num_threads=args.threads_per_worker,
    )  # fmt: skip


def worker_configs(args) -> tuple[VerifierConfig, DrafterConfig]:
    common = worker_options(args)
    verifier = VerifierConfig(
        **common,
        root=args.root or cache_root() / "store",
        resident_bytes=parse_size(args.resident_bytes),
        link=LinkSpec.parse(args.link_bandwidth, args.link_latency),
    )
    drafter = DrafterConfig(**common, kv_cache_bytes=parse_size(args.drafter_cache_bytes))
    return verifier, drafter


def coordinator_config(args) -> CoordinatorConfig:
    return CoordinatorConfig(
        default_draft_len=args.draft_len,
        max_running=args.max_running,
        max_waiting=args.max_waiting,
    )


def start_ray(args) -> None:
    import ray

    if args.local:
        resources = {"verifier": args.verifiers, "drafter": args.drafters}
        ray.init(resources=resources, include_dashboard=False, log_to_driver=False)
    else:
        ray.init(address=args.address, log_to_driver=False)


def run(args) -> int:
    # Checks every option before anything starts.
    long_context = long_context_config(args)
    is_on_ray = args.local or args.address
    if long_context is not None and is_on_ray:
        raise InvalidRequestError("--long-context serves from this process: drop --local/--address")
    if long_context is None and not is_on_ray:
        raise InvalidRequestError("serve needs one of --local, --address or --long-context")
    config = coordinator_config(args)
    if long_context is not None:
        server = start_long_context(args, long_context, config)
    else:
        server = start_on_ray(args, config)
    print(f"VeriCache serving on {server.target}", flush=True)
    stopped = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stopped.set())
    stopped.wait()
    print("Stopping...", file=sys.stderr, flush=True)
    server.stop()
    return 0


def start_on_ray(args, config: CoordinatorConfig):
    from vericache.serve.launch import ray_workers
    from vericache.serve.server import BackgroundServer

    verifier, drafter = worker_configs(args)
    start_ray(args)

    def workers():
        return ray_workers(verifier, drafter, args.verifiers, args.drafters, args.placement_timeout)

    print(f"Starting {args.verifiers} verifier(s) and {args.drafters} drafter(s)...", flush=True)
    return BackgroundServer(workers, args.model, f"{args.host}:{args.port}", config)


def start_long_context(args, long_context, config: CoordinatorConfig):
    from vericache.serve.long_context import LongContextServer

    worker = WorkerConfig(**worker_options(args))
    print("Starting the long-context engine...", flush=True)
    return LongContextServer(worker, long_context, f"{args.host}:{args.port}", config)
