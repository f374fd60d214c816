"""A whole VeriCache server (its coordinator and the gRPC API) on an event loop of its own thread.

With `HttpSettings` it also serves the OpenAI-compatible HTTP API (openai_api.py) on the same loop.
`vericache serve` runs one until interrupted; `make demo`, the benchmarks and the tests start one,
talk to it through the client SDK like any user, and stop it. `distributed_server` serves over
verifier and drafter workers; `long_context_server` (long_context.py) over one engine.
"""

from __future__ import annotations

import asyncio
import faulthandler
import logging
import sys
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from vericache.serve.config import CoordinatorConfig
from vericache.serve.front.api import start_server
from vericache.serve.front.auth import Access
from vericache.serve.front.coordinator import Coordinator
from vericache.serve.workers.handles import DrafterHandle, VerifierHandle


@dataclass(frozen=True)
class HttpSettings:
    """The OpenAI-compatible HTTP API beside the gRPC one (serve/front/openai_api.py)."""

    port: int  # 0: a free one
    model_name: str  # the id /v1/models lists and requests name


log = logging.getLogger(__name__)

# How long past its grace a stage of a stop may take before the stop goes on without it: gRPC's
# asyncio server can fail to finish its stop after a streaming call was cancelled (grpc/grpc
# issue 28999), and one stuck stage must not keep the rest of the server (its workers) running.
STOP_STAGE_MARGIN_S = 30.0

# Starts the coordinator; runs on the server's event loop.
CoordinatorFactory = Callable[[], Awaitable[Coordinator]]
# () -> (verifiers, drafters); runs on a thread of the server's.
WorkerFactory = Callable[[], tuple[list[VerifierHandle], list[DrafterHandle]]]


class BackgroundServer:
    def __init__(
        self,
        start_coordinator: CoordinatorFactory,
        address: str = "127.0.0.1:0",
        start_timeout_s: float = 600.0,
        access: Access | None = None,
        http: HttpSettings | None = None,
    ):
        self.access = access  # None: no API keys, no TLS (tests, benchmarks on loopback)
        self._api = None  # the gRPC servers, once started
        self.health_port: int | None = None
        self._http_settings = http  # None: no OpenAI-compatible HTTP API
        self._http = None  # ...its server, once started
        self.http_port: int | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="vericache-server", daemon=True
        )
        self._thread.start()
        self.coordinator: Coordinator | None = None
        started = asyncio.run_coroutine_threadsafe(
            self._start(start_coordinator, address), self._loop
        )
        try:
            self.port = started.result(start_timeout_s)
        except BaseException:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(30)
            raise
        self.host = address.rsplit(":", 1)[0]

    async def _start(self, start_coordinator: CoordinatorFactory, address: str) -> int:
        self.coordinator = await start_coordinator()
        self._api = await start_server(self.coordinator, address, self.access)
        self.health_port = self._api.health_port
        if self._http_settings is not None:
            from vericache.serve.front.openai_api import HttpServer, openai_app

            settings, access = self._http_settings, self.access or Access()
            app = openai_app(self.coordinator, access, settings.model_name)
            self._http = HttpServer(app, address.rsplit(":", 1)[0], settings.port, access)
            self.http_port = await self._http.start()
        return self._api.port

    @property
    def target(self) -> str:
        return f"{self.host}:{self.port}"

    def run(self, coroutine, timeout_s: float | None = None):
        """Runs a coroutine on the server's loop (e.g. to inspect the coordinator)."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout_s)

    def stop(self, grace_s: float = 5.0) -> None:
        """Drains, then stops: new calls are refused at once (UNAVAILABLE), running ones finish
        within `grace_s` (then they are cancelled), and the workers shut down."""
        if not self._thread.is_alive():
            return
        try:
            self.run(self._stop(grace_s), timeout_s=grace_s + 3 * STOP_STAGE_MARGIN_S)
        except TimeoutError:
            # What every thread was doing, for the log: a stop that hangs is a bug to find.
            faulthandler.dump_traceback(all_threads=True)
            raise
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)

    async def _stop(self, grace_s: float) -> None:
        stopping = [self._api.stop(grace_s)]
        if self._http is not None:
            stopping.append(self._http.stop(grace_s))
        await _bounded(asyncio.gather(*stopping), grace_s + STOP_STAGE_MARGIN_S, "the API")
        await _bounded(self.coordinator.close(), STOP_STAGE_MARGIN_S, "the coordinator")

    def __enter__(self) -> BackgroundServer:
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()


async def _bounded(stage: Awaitable, timeout_s: float, name: str) -> None:
    """Awaits one stage of a stop; one that outlasts `timeout_s` is logged with every task's
    stack (where it waits) and left behind, and the stop goes on."""
    try:
        await asyncio.wait_for(stage, timeout_s)
    except TimeoutError:
        log.error("%s did not stop within %.0f s; the stop goes on without it", name, timeout_s)
        for task in asyncio.all_tasks():
            task.print_stack(file=sys.stderr)


def distributed_server(
    workers: WorkerFactory,
    model: str,
    address: str = "127.0.0.1:0",
    config: CoordinatorConfig | None = None,
    start_timeout_s: float = 600.0,
    access: Access | None = None,
    http: HttpSettings | None = None,
) -> BackgroundServer:
    """A server over the workers `workers` makes (in this process, or Ray actors)."""
    from vericache.serve.launch.cluster import start_coordinator

    async def start() -> Coordinator:
        verifiers, drafters = await asyncio.to_thread(workers)
        return await start_coordinator(verifiers, drafters, model, config)

    return BackgroundServer(start, address, start_timeout_s, access, http)
