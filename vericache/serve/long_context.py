"""Serving in long-context mode (the paper's Pipeline 1) from one process, without Ray.

The same vericache.v1 API as the distributed server, over one `LongContextEngine` that keeps each
request's compressed KV on the device and its full KV in host memory, reloaded for each
verification, within a device-memory budget (`vericache serve --long-context`).

What differs from the distributed coordinator, which this one extends:
- Prefixes are records (token ids, whether they are a chat system turn, the compressor), kept in
  this process's memory: registering one makes no KV. A request naming a prefix gets the prefix as
  its context and the prefix's compressor; the engine prefills every request itself and keeps its
  full KV in host memory, so no full-KV store is needed. Prefixes do not outlive the process.
- Modes VERICACHE and FULL_LOCAL (the full-KV baseline under the same budget); FULL_REMOTE and
  LOSSY need drafters and are invalid here. The engine runs one mode at a time: a request of the
  other mode waits until the running ones finish (engine_loop.py), it is never refused for it.
- A request the engine refuses (its KV does not fit the budget beside the weights, or its full-KV
  load spans the scheduler's window) fails with INVALID_ARGUMENT and the engine's message.
- Statistics: link_bytes and store_bytes are 0; the engine's loads over PCIe are engine-wide.
Request checks, admission (RESOURCE_EXHAUSTED past max_running + max_waiting) and the streamed
text deltas, stop strings held back, are the distributed coordinator's own.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from vericache.compress import build_compressor
from vericache.engine.device_memory import slot_bytes
from vericache.engine.engine import EngineConfig
from vericache.engine.long_context import LongContextEngine
from vericache.engine.long_context_config import LongContextConfig
from vericache.engine.request import DecodeMode, Request
from vericache.errors import InvalidRequestError, PrefixNotFoundError
from vericache.serve.auth import Access
from vericache.serve.catalog import PrefixRecord, check_prefix_id, compressor_only
from vericache.serve.config import CoordinatorConfig, WorkerConfig
from vericache.serve.coordinator import Coordinator, stream_responses
from vericache.serve.engine_loop import (
    EngineEvent,
    EngineLoop,
    RequestFailed,
    RequestFinished,
    TokensCommitted,
)
from vericache.serve.metrics import ServeMetrics, metered
from vericache.serve.rounds import Mode, RequestPlan, ServedRequest
from vericache.serve.server import BackgroundServer
from vericache.serve.worker import ModelInfo, load_worker_model
from vericache.v1 import vericache_pb2 as pb

_ENGINE_MODES = {Mode.VERICACHE: DecodeMode.VERICACHE, Mode.FULL_LOCAL: DecodeMode.FULL}


class LongContextCoordinator(Coordinator):
    def __init__(
        self,
        engine_loop: EngineLoop,
        info: ModelInfo,
        tokenizer,
        slot_bytes: int,
        config: CoordinatorConfig | None = None,
    ):
        super().__init__([], [], tokenizer, config)
        self.engine_loop = engine_loop
        self.info = info
        self.metrics = ServeMetrics(info.model)
        self._slot_bytes = slot_bytes  # one token of full KV, as the engine holds it
        self._prefixes: dict[str, PrefixRecord] = {}
        self._last_metered = None  # the engine's last iteration in the metrics
        engine_loop.on_iteration = self._meter_iteration

    async def start(self) -> LongContextCoordinator:
        return self

    async def close(self) -> None:
        await asyncio.to_thread(self.engine_loop.close)

    # --- Prefixes: records in memory --------------------------------------------------------------

    async def _register(
        self, prefix_id: str, token_ids: list[int], chat: bool, spec: dict
    ) -> AsyncIterator[str]:
        full_kv_bytes = len(token_ids) * self._slot_bytes
        record = PrefixRecord(
            prefix_id, tuple(token_ids), chat, compressor_only(spec), full_kv_bytes,
            compressed_kv_bytes=0,
        )  # fmt: skip
        self._prefixes[prefix_id] = record
        return
        yield  # no stage: the engine prefills and compresses each request itself

    async def _record(self, prefix_id: str) -> PrefixRecord:
        check_prefix_id(prefix_id)
        record = self._prefixes.get(prefix_id)
        if record is None:
            raise PrefixNotFoundError(f"no prefix {prefix_id!r} is registered")
        return record

    async def _records(self) -> list[PrefixRecord]:
        return sorted(self._prefixes.values(), key=lambda record: record.prefix_id)

    async def _remove(self, prefix_id: str) -> None:
        if self._prefixes.pop(prefix_id, None) is None:
            raise PrefixNotFoundError(f"no prefix {prefix_id!r} is registered")

    # --- Generation: through the engine's loop ----------------------------------------------------

    def _check_can_serve(self, mode: int) -> None:
        if mode not in _ENGINE_MODES:
            raise InvalidRequestError(
                f"mode {Mode.Name(mode)} needs drafters: a long-context server runs VERICACHE "
                "and FULL_LOCAL"
            )

    async def _serve(self, plan: RequestPlan) -> AsyncIterator[pb.GenerateResponse]:
        served = self._served(plan)
        events: asyncio.Queue[EngineEvent] = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def deliver(event: EngineEvent) -> None:  # on the engine's thread
            with contextlib.suppress(RuntimeError):  # the server's loop has stopped
                loop.call_soon_threadsafe(events.put_nowait, event)

        submission = self.engine_loop.submit(await self._engine_request(plan), deliver)
        try:
            responses = stream_responses(served, _committed(served, events))
            async for message in metered(self.metrics, served, responses):
                yield message
        finally:
            self.engine_loop.cancel(submission)  # a no-op once it finished

    def _meter_iteration(self, engine) -> None:
        """After each engine iteration (on its thread): device memory in use, and the iteration
        the scheduler planned (batch sizes, link utilisation, planned memory high-water mark)."""
        self.metrics.set_device_memory(engine.memory.in_use_bytes)
        scheduled = engine.scheduler.metrics
        if scheduled.iterations and scheduled.iterations[-1] is not self._last_metered:
            self._last_metered = scheduled.iterations[-1]
            self.metrics.iteration_planned(self._last_metered, scheduled.peak_memory_bytes)

    async def _engine_request(self, plan: RequestPlan) -> Request:
        mode = _ENGINE_MODES[plan.mode]
        compressor = None
        if mode is DecodeMode.VERICACHE:
            spec = (await self._record(plan.prefix_id)).compressor
            compressor = build_compressor(spec["name"], **spec["params"])
        return Request(
            plan.prompt_ids, plan.num_prefix_tokens, plan.params, mode, compressor,
            plan.draft_len, plan.session_id,
        )  # fmt: skip


async def _committed(
    served: ServedRequest, events: asyncio.Queue[EngineEvent]
) -> AsyncIterator[list[int]]:
    """The engine's committed tokens, batch by batch, through the request's own stop checks (the
    engine's, token for token), which also place the text's cut at a stop string."""
    while True:
        event = await events.get()
        if isinstance(event, RequestFailed):
            raise event.error
        if isinstance(event, TokensCommitted):
            yield served.commit(event.token_ids)
            continue
        assert isinstance(event, RequestFinished)
        output = event.output
        yield served.commit(output.token_ids[len(served.output_ids) :])
        served.finish_reason = output.finish_reason
        served.rounds = output.stats.rounds
        served.accepted_per_round = list(output.stats.accepted_per_round)
        served.drafted_per_round = list(output.stats.drafted_per_round)
        return


async def start_long_context_coordinator(
    worker: WorkerConfig,
    long_context: LongContextConfig,
    config: CoordinatorConfig | None = None,
) -> LongContextCoordinator:
    """Loads the model once; a failed engine iteration restarts the engine over the same one."""
    loaded, runner, info = await asyncio.to_thread(load_worker_model, worker)

    def make_engine() -> LongContextEngine:
        return LongContextEngine(runner, loaded.tokenizer, EngineConfig(), long_context)

    engine_loop = await asyncio.to_thread(EngineLoop, make_engine)
    token_bytes = slot_bytes(runner.config, runner.dtype.itemsize)
    return LongContextCoordinator(engine_loop, info, loaded.tokenizer, token_bytes, config)


class LongContextServer(BackgroundServer):
    """A long-context server (one engine, no workers) on an event loop of its own thread."""

    def __init__(
        self,
        worker: WorkerConfig,
        long_context: LongContextConfig,
        address: str = "127.0.0.1:0",
        config: CoordinatorConfig | None = None,
        start_timeout_s: float = 600.0,
        access: Access | None = None,
    ):
        self._long_context = long_context
        super().__init__(worker, worker.model, address, config, start_timeout_s, access)

    async def _start_coordinator(self, worker: WorkerConfig, model: str, config) -> Coordinator:
        return await start_long_context_coordinator(worker, self._long_context, config)
