"""`vericache serve`: the gRPC API over Ray verifiers and drafters, until interrupted.

`--local` starts a Ray instance of its own on this machine offering one `verifier` and N `drafter`
resources (all its ports on loopback when --host is: cli/local_ray.py);
`--address auto` (or HOST:PORT) joins a running cluster whose nodes offer them (cluster/, k8s/).
`--long-context` serves from this process alone, no Ray: one long-context engine (compressed KV on
the device, full KV in host memory) within `--memory-budget`, over a link of `--pcie-bandwidth`
(without --long-context, the verifiers hold their full-KV loads from the store to it).

Callers need an API key from `--api-keys-file` (serve/front/auth.py has its format) unless the
server starts with `--insecure-no-auth`; `--tls-cert` and `--tls-key` serve over TLS. The three
files default to $VERICACHE_API_KEYS_FILE, $VERICACHE_TLS_CERT_FILE and $VERICACHE_TLS_KEY_FILE; TLS
files named only by those variables are used if both exist (the k8s Secret is optional).
`--health-port` serves grpc.health.v1 alone in plaintext, for probes that cannot speak TLS.
`--http-port` also serves the OpenAI-compatible HTTP API (serve/front/openai_api.py), with the same
keys and TLS.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from vericache.cli.generate import add_long_context_arguments, check_device, long_context_config
from vericache.cli.local_ray import is_loopback, start_ray
from vericache.engine.link import LinkSpec, parse_bandwidth, parse_size
from vericache.errors import InvalidRequestError
from vericache.model.loader import DEFAULT_MODEL, DTYPES, cache_root
from vericache.serve.config import (
    DEFAULT_MODES,
    SCHEDULING_POLICIES,
    CoordinatorConfig,
    DrafterConfig,
    VerifierConfig,
    WorkerConfig,
)
from vericache.serve.front.auth import Access, ApiKeys, TlsFiles
from vericache.serve.logs import configure_logging

if TYPE_CHECKING:
    from vericache.serve.launch.server import HttpSettings

log = logging.getLogger("vericache.serve.summary")


def add_parser(commands) -> None:
    parser = commands.add_parser(
        "serve", help="serve the gRPC API on Ray drafters and verifiers, or --long-context"
    )
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--local", action="store_true", help="start a Ray instance of its own here")
    where.add_argument("--address", help="join a running Ray cluster ('auto' or HOST:PORT)")
    parser.add_argument("--host", default="127.0.0.1", help="API address (0.0.0.0: every one)")
    parser.add_argument("--port", type=int, default=50051)
    parser.add_argument(
        "--transfer-host",
        help="where the verifiers' KV transfer service listens for drafters (default: loopback "
        "when --host is loopback, else the verifier node's address)",
    )
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
    parser.add_argument(
        "--turn-cache-bytes",
        default="1GiB",
        help="finished turns' full KV a worker keeps for the next turn to reuse (0: none)",
    )
    parser.add_argument(
        "--turn-host-bytes",
        default="0",
        help="host memory for the kept turns the device's budget pushes out (0: none)",
    )
    parser.add_argument(
        "--prefix-cache-bytes",
        help="a verifier's copies of prefixes' full KV, one per prefix, shared by its sessions "
        "(default: the GPU memory left after the weights, --resident-bytes and "
        "--turn-cache-bytes; on CPU, a "
        "quarter of the RAM)",
    )
    parser.add_argument(
        "--drafter-cache-bytes",
        help="a drafter's copies of the prefixes it fetched, shared by its sessions (default: "
        "the GPU memory left after the weights; on CPU, a quarter of the RAM)",
    )
    parser.add_argument(
        "--host-tier-bytes",
        default="0",
        help="a drafter node's host memory for the full KV of the prefixes it drafts on, streamed "
        "over the link in the background; once a prefix's is there, the node verifies its own "
        "sessions' rounds (default 0: every verification on a verifier beside the store)",
    )
    parser.add_argument("--draft-len", type=int, default=30, help="default tokens per draft")
    parser.add_argument(
        "--scheduling",
        choices=SCHEDULING_POLICIES,
        default="per-request",
        help="distributed VERICACHE rounds: each request on its own (batched in the workers), "
        "or planned across requests by the staggering scheduler (or lock-step, the paper's "
        "baseline)",
    )
    parser.add_argument("--max-running", type=int, default=16)
    parser.add_argument("--max-waiting", type=int, default=64)
    parser.add_argument(
        "--max-migrations",
        type=int,
        default=2,
        help="times a request whose worker died goes on elsewhere before it fails (UNAVAILABLE)",
    )
    parser.add_argument(
        "--max-output-tokens", type=int, default=4096, help="the most max_tokens a request may ask"
    )
    parser.add_argument("--placement-timeout", type=float, default=300.0, help="seconds")
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="seconds running requests may take to finish after SIGTERM (new ones are refused)",
    )
    parser.add_argument(
        "--metrics-port", type=int, help="serve Prometheus /metrics over HTTP on this port"
    )
    parser.add_argument(
        "--http-port",
        type=int,
        help="also serve the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
        "/v1/models, /health, /metrics) on this port",
    )
    parser.add_argument(
        "--max-n",
        type=int,
        default=16,
        help="the most choices (`n`) one OpenAI-API request may ask for; each is a request",
    )
    parser.add_argument(
        "--auto-prefix-min-tokens",
        type=int,
        help="register a system turn of this many tokens or more by itself once a tenant has "
        "sent it twice (SnapKV 4x; requests naming no prefix use their tenant's matching one "
        "either way)",
    )
    parser.add_argument(
        "--cost-profile", default="",
        help="the device profile `mode: auto` prices its paths with: a bundled name or the JSON "
        "`vericache calibrate` writes (default: the workers' GPU's datasheet, or a CPU's prior; "
        "what requests take corrects it either way)",
    )  # fmt: skip
    parser.add_argument(
        "--default-mode", choices=DEFAULT_MODES, default="auto",
        help="the mode of a request over a prefix that names none (auto: the fastest lossless "
        "path; a request without a prefix is full_local)",
    )  # fmt: skip
    parser.add_argument(
        "--served-model-name",
        help="the model id of the HTTP API (default: the model's name, a directory's last part)",
    )
    parser.add_argument(
        "--log-format",
        choices=["text", "json"],
        default="text",
        help="server logs on stderr: text, or one JSON object per line (request ids as fields)",
    )
    parser.add_argument(
        "--log-interval",
        type=float,
        default=10.0,
        help="seconds between one-line summaries on stderr (tokens/s, accepted per round); 0: none",
    )
    add_long_context_arguments(parser)
    add_access_arguments(parser)
    parser.set_defaults(handler=run)


def add_access_arguments(parser) -> None:
    access = parser.add_argument_group("access")
    access.add_argument(
        "--api-keys-file",
        type=Path,
        help="tenants and their API keys, JSON ($VERICACHE_API_KEYS_FILE)",
    )
    access.add_argument(
        "--insecure-no-auth", action="store_true", help="no API keys: every caller is one tenant"
    )
    access.add_argument("--tls-cert", type=Path, help="PEM certificate ($VERICACHE_TLS_CERT_FILE)")
    access.add_argument("--tls-key", type=Path, help="PEM private key ($VERICACHE_TLS_KEY_FILE)")
    access.add_argument(
        "--health-port", type=int, help="also serve grpc.health.v1 alone, in plaintext, here"
    )


def access_from_args(args, environ=os.environ) -> Access:
    """The API keys, TLS files and health port the options (or environment) name; checked."""
    keys_file = args.api_keys_file or environ.get("VERICACHE_API_KEYS_FILE") or None
    if args.insecure_no_auth and args.api_keys_file:
        raise InvalidRequestError("--insecure-no-auth and --api-keys-file exclude each other")
    if not args.insecure_no_auth and keys_file is None:
        raise InvalidRequestError(
            "serve needs API keys (--api-keys-file or $VERICACHE_API_KEYS_FILE), or "
            "--insecure-no-auth to let every caller in"
        )
    api_keys = None if args.insecure_no_auth else ApiKeys.load(Path(keys_file))
    return Access(api_keys, _tls_files(args, environ), args.health_port)


def _tls_files(args, environ) -> TlsFiles | None:
    if args.tls_cert or args.tls_key:
        if not (args.tls_cert and args.tls_key):
            raise InvalidRequestError("TLS needs both --tls-cert and --tls-key")
        tls = TlsFiles(args.tls_cert, args.tls_key)
        tls.read()  # both readable, or a clear error now
        return tls
    cert, key = environ.get("VERICACHE_TLS_CERT_FILE"), environ.get("VERICACHE_TLS_KEY_FILE")
    if cert and key and Path(cert).is_file() and Path(key).is_file():
        return TlsFiles(Path(cert), Path(key))
    return None


def worker_options(args) -> dict:
    """What every worker (or the long-context engine) loads: model, dtype, device, threads."""
    return dict(
        model=args.model, dtype=args.dtype, device=args.device,
        num_threads=args.threads_per_worker,
    )  # fmt: skip


def transfer_host(args) -> str | None:
    """The KV transfer service binds only where told: --transfer-host, or loopback for a server
    on loopback (drafters on other nodes could not reach it anyway); None: the node's address."""
    if args.transfer_host:
        return args.transfer_host
    return args.host if is_loopback(args.host) else None


def worker_configs(args) -> tuple[VerifierConfig, DrafterConfig]:
    common = worker_options(args)
    verifier = VerifierConfig(
        **common,
        root=args.root or cache_root() / "store",
        resident_bytes=parse_size(args.resident_bytes),
        turn_cache_bytes=parse_size(args.turn_cache_bytes),
        turn_host_bytes=parse_size(args.turn_host_bytes),
        prefix_cache_bytes=_size_or_none(args.prefix_cache_bytes),
        link=LinkSpec.parse(args.link_bandwidth, args.link_latency),
        load_bandwidth=parse_bandwidth(args.pcie_bandwidth) if args.pcie_bandwidth else None,
        transfer_host=transfer_host(args),
    )
    drafter = DrafterConfig(
        **common,
        turn_cache_bytes=parse_size(args.turn_cache_bytes),
        turn_host_bytes=parse_size(args.turn_host_bytes),
        kv_cache_bytes=_size_or_none(args.drafter_cache_bytes),
        host_tier_bytes=parse_size(args.host_tier_bytes),
    )
    return verifier, drafter


def _size_or_none(text: str | None) -> int | None:
    """A size flag's bytes; None where it was not given (the worker sizes it from its memory)."""
    return None if text is None else parse_size(text)


def coordinator_config(args) -> CoordinatorConfig:
    return CoordinatorConfig(
        default_draft_len=args.draft_len,
        scheduling=args.scheduling,
        max_running=args.max_running,
        max_waiting=args.max_waiting,
        max_output_tokens=args.max_output_tokens,
        max_n=args.max_n,
        max_migrations=args.max_migrations,
        auto_prefix_min_tokens=args.auto_prefix_min_tokens,
        cost_profile=args.cost_profile,
        default_mode=args.default_mode,
    )


def check_local_device(args) -> None:
    """A device this machine lacks fails here, in one line, before any worker starts (a worker
    would die loading the model, and Ray would report it as a dead actor much later)."""
    if args.address:  # the workers run on the cluster's nodes, which may have what this one lacks
        return
    if args.device != "auto":  # auto: CUDA where the worker finds it, else the CPU
        check_device(args.device)


def run(args) -> int:
    # Checks every option before anything starts.
    long_context = long_context_config(args, pcie_alone=True)
    is_on_ray = args.local or args.address
    if long_context is not None and is_on_ray:
        raise InvalidRequestError("--long-context serves from this process: drop --local/--address")
    if long_context is None and not is_on_ray:
        raise InvalidRequestError("serve needs one of --local, --address or --long-context")
    config = coordinator_config(args)
    check_local_device(args)
    if not args.drain_timeout >= 0:
        raise InvalidRequestError(f"--drain-timeout must be >= 0 seconds, got {args.drain_timeout}")
    configure_logging(args.log_format)
    if long_context is None:
        worker_configs(args)  # sizes and the link parse before the access files are read
    http = http_settings(args)
    access = access_from_args(args)
    if long_context is not None:
        server = start_long_context(args, long_context, config, access, http)
    else:
        server = start_on_ray(args, config, access, http)
    print(f"VeriCache serving on {server.target}", flush=True)
    print(f"Access: {_describe(access, server)}", flush=True)
    if server.http_port is not None:
        scheme = "https" if access.tls else "http"
        print(f"OpenAI API on {scheme}://{args.host}:{server.http_port}/v1", flush=True)
    metrics = server.coordinator.metrics
    if args.metrics_port is not None:
        http, _ = metrics.start_http(args.metrics_port, args.host)
        print(f"Metrics on http://{args.host}:{http.server_port}/metrics", flush=True)
    stopped = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stopped.set())
    interval = args.log_interval if args.log_interval > 0 else None
    while not stopped.wait(interval):
        log.info("summary: %s", metrics.summary_line())
    print(f"Draining (up to {args.drain_timeout:g} s)...", file=sys.stderr, flush=True)
    server.stop(grace_s=args.drain_timeout)
    return 0


def _describe(access: Access, server) -> str:
    keys = access.api_keys
    words = [
        "TLS" if access.tls else "plaintext",
        f"{len(keys.tenants)} tenant(s)" if keys else "no API keys (--insecure-no-auth)",
    ]
    if server.health_port is not None:
        words.append(f"health on port {server.health_port}")
    return ", ".join(words)


def start_on_ray(args, config: CoordinatorConfig, access: Access, http: HttpSettings | None):
    from vericache.serve.launch.cluster import ray_workers
    from vericache.serve.launch.server import distributed_server

    verifier, drafter = worker_configs(args)
    start_ray(args)

    def workers():
        return ray_workers(verifier, drafter, args.verifiers, args.drafters, args.placement_timeout)

    print(f"Starting {args.verifiers} verifier(s) and {args.drafters} drafter(s)...", flush=True)
    address = f"{args.host}:{args.port}"
    return distributed_server(workers, args.model, address, config, access=access, http=http)


def start_long_context(
    args, long_context, config: CoordinatorConfig, access: Access, http: HttpSettings | None
):
    from vericache.serve.launch.long_context import long_context_server

    worker = WorkerConfig(**worker_options(args))
    print("Starting the long-context engine...", flush=True)
    address = f"{args.host}:{args.port}"
    return long_context_server(worker, long_context, address, config, access=access, http=http)


def http_settings(args) -> HttpSettings | None:
    """The HTTP API's port and model id; None without --http-port."""
    from vericache.serve.launch.server import HttpSettings

    if args.http_port is None:
        if args.served_model_name:
            raise InvalidRequestError("--served-model-name names the model of --http-port")
        return None
    return HttpSettings(args.http_port, served_model_name(args))


def served_model_name(args) -> str:
    """The model id of the HTTP API: --served-model-name, or the model's name (a directory's last
    part)."""
    return args.served_model_name or Path(args.model.rstrip("/")).name
