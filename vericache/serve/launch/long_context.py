"""Starts a long-context server: one process, one engine, no workers (`vericache serve
--long-context`; backends/long_context.py says what it serves and how)."""

from __future__ import annotations

import asyncio

from vericache.engine.device_memory import slot_bytes
from vericache.engine.engine_config import EngineConfig
from vericache.engine.long_context import LongContextEngine
from vericache.engine.long_context_config import LongContextConfig
from vericache.serve.backends.engine_loop import EngineLoop
from vericache.serve.backends.long_context import LongContextBackend
from vericache.serve.config import CoordinatorConfig, WorkerConfig
from vericache.serve.front.auth import Access
from vericache.serve.front.coordinator import Coordinator
from vericache.serve.launch.server import BackgroundServer, HttpSettings
from vericache.serve.workers.worker import load_worker_model


async def start_long_context_coordinator(
    worker: WorkerConfig,
    long_context: LongContextConfig,
    config: CoordinatorConfig | None = None,
) -> Coordinator:
    """Loads the model once; a failed engine iteration restarts the engine over the same one."""
    model = await asyncio.to_thread(load_worker_model, worker)
    loaded, runner, info = model.loaded, model.runner, model.info

    def make_engine() -> LongContextEngine:
        return LongContextEngine(runner, loaded.tokenizer, EngineConfig(), long_context)

    engine_loop = await asyncio.to_thread(EngineLoop, make_engine)
    token_bytes = slot_bytes(runner.config, runner.dtype.itemsize)
    backend = LongContextBackend(engine_loop, info, token_bytes)
    return await Coordinator(backend, loaded.tokenizer, worker.model, config).start()


def long_context_server(
    worker: WorkerConfig,
    long_context: LongContextConfig,
    address: str = "127.0.0.1:0",
    config: CoordinatorConfig | None = None,
    start_timeout_s: float = 600.0,
    access: Access | None = None,
    http: HttpSettings | None = None,
) -> BackgroundServer:
    """A long-context server (one engine, no workers) on an event loop of its own thread."""

    async def start() -> Coordinator:
        return await start_long_context_coordinator(worker, long_context, config)

    return BackgroundServer(start, address, start_timeout_s, access, http)
