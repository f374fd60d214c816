"""A whole VeriCache server (its coordinator and the gRPC API) on an event loop of its own thread.

`vericache serve` runs one until interrupted; `make demo`, the benchmarks and the tests start one,
talk to it through the client SDK like any user, and stop it. `distributed_server` serves over
verifier and drafter workers; `long_context_server` (long_context.py) over one engine.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable

from vericache.serve.api import start_server
from vericache.serve.auth import Access
from vericache.serve.config import CoordinatorConfig
from vericache.serve.coordinator import Coordinator
from vericache.serve.handles import DrafterHandle, VerifierHandle

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
    ):
        self.access = access  # None: no API keys, no TLS (tests, benchmarks on loopback)
        self._api = None  # the gRPC servers, once started
        self.health_port: int | None = None
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
        self.run(self._stop(grace_s), timeout_s=grace_s + 120)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)

    async def _stop(self, grace_s: float) -> None:
        await self._api.stop(grace_s)
        await self.coordinator.close()

    def __enter__(self) -> BackgroundServer:
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()


def distributed_server(
    workers: WorkerFactory,
    model: str,
    address: str = "127.0.0.1:0",
    config: CoordinatorConfig | None = None,
    start_timeout_s: float = 600.0,
    access: Access | None = None,
) -> BackgroundServer:
    """A server over the workers `workers` makes (in this process, or Ray actors)."""
    from vericache.serve.launch import start_coordinator

    async def start() -> Coordinator:
        verifiers, drafters = await asyncio.to_thread(workers)
        return await start_coordinator(verifiers, drafters, model, config)

    return BackgroundServer(start, address, start_timeout_s, access)
