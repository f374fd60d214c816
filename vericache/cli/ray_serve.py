"""`vericache serve` as a Ray Serve application, the form KubeRay's RayService deploys
(k8s/rayservice.yaml).

A RayService upgrades a cluster by starting a new one beside it and moving traffic once the new one
serves, and restarts what fails; it needs a Serve application to do so. This application is the
server `vericache serve --address auto` runs on a RayCluster's head, in one Serve replica:

- the coordinator, which places the verifier and drafter actors by their Ray resources
  (serve/launch/cluster.py) and owns them, so they end with the replica and a restarted replica
  places new ones;
- the gRPC API, listening on `port` in the replica's process;
- the OpenAI-compatible HTTP API (serve/front/openai_api.py) as the deployment's ingress: Serve's
  proxy serves it on Serve's HTTP port, with the same API keys.

One replica, because a coordinator owns its requests' rounds and sessions: two replicas would be two
servers over two sets of workers, which is what a second RayService is for.

The application's `args` are `vericache serve`'s options, named as `--help` spells them without
the dashes (`{"verifiers": 1, "draft-len": 30, "insecure-no-auth": true}`), parsed by the same
parser, so each means what it does on the command line. Options that say where the server runs or
listens for HTTP are Serve's to decide and are refused.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import logging

from ray import serve

from vericache.cli.generate import long_context_config
from vericache.cli.main import build_parser
from vericache.cli.serve import (
    access_from_args,
    coordinator_config,
    served_model_name,
    worker_configs,
)
from vericache.errors import InvalidRequestError, WorkerUnavailableError
from vericache.serve.front.api import start_server
from vericache.serve.front.openai_api import openai_app
from vericache.serve.launch.cluster import ray_workers, start_coordinator
from vericache.serve.logs import configure_logging

log = logging.getLogger("vericache.serve.summary")

# Options Serve decides, and why: each is refused with its reason.
SERVE_DECIDES = {
    "local": "the application runs on the Ray cluster Serve runs on",
    "address": "the application runs on the Ray cluster Serve runs on",
    "long-context": "a RayService serves verifier and drafter workers; serve --long-context "
    "from one process instead",
    "http-port": "Serve's proxy serves the HTTP API on Serve's own port (http_options.port)",
    "metrics-port": "/metrics is served on Serve's HTTP port",
}
DEPLOYMENT_NAME = "VeriCache"
# Serve's own cap on requests in the replica, kept above the coordinator's limits so that every
# request reaches them and is refused, when it is, with the OpenAI-shaped 429 rather than queued
# at the proxy.
MIN_ONGOING_REQUESTS = 1024


def serve_argv(options: dict[str, object]) -> list[str]:
    """`vericache serve`'s command line for the application's args."""
    argv = ["serve"]
    for name, value in options.items():
        if name in SERVE_DECIDES:
            raise InvalidRequestError(f"the application takes no {name!r}: {SERVE_DECIDES[name]}")
        if value is True:
            argv.append(f"--{name}")
        elif value is not False and value is not None:
            argv += [f"--{name}", str(value)]
    return argv


def parse_options(options: dict[str, object]) -> argparse.Namespace:
    """The application's args as `vericache serve` reads them, checked as it checks them (all but
    the access files, which only the replica's node may hold)."""
    refusal = io.StringIO()
    try:
        with contextlib.redirect_stderr(refusal):
            args = build_parser().parse_args(serve_argv(options))
    except SystemExit:
        message = refusal.getvalue().strip().removeprefix("vericache serve: error: ")
        raise InvalidRequestError(f"the application's args: {message}") from None
    long_context_config(args, pcie_alone=True)
    coordinator_config(args)
    worker_configs(args)
    return args


@serve.deployment(
    name=DEPLOYMENT_NAME, num_replicas=1, ray_actor_options={"num_cpus": 0},
    health_check_period_s=10, health_check_timeout_s=30,
)  # fmt: skip
@serve.ingress()
class VeriCacheServer:
    """The server in one Serve replica; Serve runs its constructor and its HTTP handlers on one
    event loop, the one the coordinator and the gRPC API run on."""

    async def __init__(self, options: dict[str, object]):
        args = parse_options(options)
        configure_logging(args.log_format)
        access = access_from_args(args)
        verifier, drafter = worker_configs(args)
        verifiers, drafters = await asyncio.to_thread(
            ray_workers, verifier, drafter, args.verifiers, args.drafters, args.placement_timeout
        )
        self._coordinator = await start_coordinator(
            verifiers, drafters, args.model, coordinator_config(args)
        )
        try:
            self._api = await start_server(self._coordinator, f"{args.host}:{args.port}", access)
        except BaseException:
            await self._coordinator.close()
            raise
        self._app = openai_app(self._coordinator, access, served_model_name(args))
        self._drain_s = args.drain_timeout
        self._closed = False
        interval = args.log_interval if args.log_interval > 0 else None
        self._summaries = asyncio.create_task(self._log_summaries(interval)) if interval else None

    def __serve_build_asgi_app__(self):
        return self._app

    async def check_health(self) -> None:
        """Serve restarts a replica whose check fails. A worker down is not such a failure (the
        coordinator moves its requests, and Ray restarts the actor); a server closed is."""
        if self._closed:
            raise WorkerUnavailableError("the server has stopped")

    async def __del__(self) -> None:
        """Serve calls this once the replica's HTTP requests have ended (or its graceful shutdown
        timeout has passed): gRPC calls get the drain timeout too, then the workers end."""
        if self._closed:
            return
        self._closed = True
        if self._summaries is not None:
            self._summaries.cancel()
        await self._api.stop(self._drain_s)
        await self._coordinator.close()

    async def _log_summaries(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            log.info("summary: %s", self._coordinator.metrics.summary_line())


def build(options: dict[str, object]) -> serve.Application:
    """The application KubeRay's serveConfigV2 names (`import_path: vericache.cli.ray_serve:build`,
    `args:` the options); bad options fail the deployment with the reason, before anything
    starts."""
    args = parse_options(options)
    config = coordinator_config(args)
    admitted = config.max_running + config.max_waiting
    deployment = VeriCacheServer.options(
        max_ongoing_requests=max(MIN_ONGOING_REQUESTS, 4 * admitted),
        graceful_shutdown_timeout_s=args.drain_timeout,
    )
    return deployment.bind(options)
