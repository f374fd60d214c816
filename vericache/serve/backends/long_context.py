"""The long-context backend (the paper's Pipeline 1): serving from one process, without Ray.

The same vericache.v1 API and serving front (front/coordinator.py) as the distributed server, over
a `LongContextBackend` (launch/long_context.py starts it): one `LongContextEngine` that keeps each
request's compressed KV on the device and its full KV in host memory, reloaded for each
verification, within a device-memory budget (`vericache serve --long-context`). What the backend
does its own way:
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
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from vericache.errors import InvalidRequestError, PrefixNotFoundError
from vericache.scheduler.path_choice import ServingPath
from vericache.serve.api_types import ServeMode
from vericache.serve.backends.engine_loop import (
    EngineEvent,
    EngineLoop,
    RequestFailed,
    RequestFinished,
    TokensCommitted,
)
from vericache.serve.backends.metrics import ServeMetrics
from vericache.serve.backends.path_costs import PathOption
from vericache.serve.backends.rounds import ServedRequest
from vericache.serve.store.catalog import PrefixKey, PrefixRecord
from vericache.serve.workers.worker_api import ModelInfo

_ENGINE_MODES = (ServeMode.VERICACHE, ServeMode.FULL_LOCAL, ServeMode.AUTO)


class LongContextBackend:
    def __init__(self, engine_loop: EngineLoop, info: ModelInfo, slot_bytes: int):
        self.engine_loop = engine_loop
        self.info = info
        self._slot_bytes = slot_bytes  # one token of full KV, as the engine holds it
        self._prefixes: dict[str, PrefixRecord] = {}
        self._metrics: ServeMetrics | None = None
        self._last_metered = None  # the engine's last iteration in the metrics
        self._num_serving = 0  # requests in the engine now

    async def start(self, metrics: ServeMetrics) -> ModelInfo:
        self._metrics = metrics
        self.engine_loop.on_iteration = self._meter_iteration
        return self.info

    async def close(self) -> None:
        await asyncio.to_thread(self.engine_loop.close)

    # --- Prefixes: records in memory --------------------------------------------------------------

    async def register(self, prefix_id: str, key: PrefixKey) -> AsyncIterator[str]:
        full_kv_bytes = len(key.token_ids) * self._slot_bytes
        spec = key.compressor.spec()
        self._prefixes[prefix_id] = PrefixRecord(
            prefix_id, key.token_ids, key.chat, spec, full_kv_bytes, 0, key.tenant, key.automatic
        )
        return
        yield  # no stage: the engine prefills and compresses each request itself

    async def record(self, prefix_id: str) -> PrefixRecord:
        record = self._prefixes.get(prefix_id)
        if record is None:
            raise PrefixNotFoundError(f"no prefix {prefix_id!r} is registered")
        return record

    async def records(self) -> list[PrefixRecord]:
        return sorted(self._prefixes.values(), key=lambda record: record.prefix_id)

    async def remove(self, prefix_id: str) -> None:
        if self._prefixes.pop(prefix_id, None) is None:
            raise PrefixNotFoundError(f"no prefix {prefix_id!r} is registered")

    # --- Requests: through the engine's loop ------------------------------------------------------

    def is_serving(self) -> bool:
        return self.engine_loop.is_running  # one engine in this process

    def path_options(self, prefix_id: str, after_prefix: tuple[int, ...]) -> list[PathOption]:
        """Its one engine runs VeriCache, verifying over the full KV in host memory, or full-KV
        decoding; its load, the requests in it."""
        load = self._num_serving
        return [
            PathOption(ServingPath.VERICACHE, "engine", load, is_warm=True),
            PathOption(ServingPath.FULL_LOCAL, "engine", load),
        ]

    def check_can_serve(self, mode: ServeMode) -> None:
        if mode not in _ENGINE_MODES:
            raise InvalidRequestError(
                f"mode {mode.name} needs drafters: a long-context server runs VERICACHE and "
                "FULL_LOCAL"
            )

    async def serve(self, served: ServedRequest) -> AsyncIterator[list[int]]:
        events: asyncio.Queue[EngineEvent] = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def deliver(event: EngineEvent) -> None:  # on the engine's thread
            with contextlib.suppress(RuntimeError):  # the server's loop has stopped
                loop.call_soon_threadsafe(events.put_nowait, event)

        submission = self.engine_loop.submit(served.plan.request, deliver)
        self._num_serving += 1
        served.worker_load = self._num_serving
        try:
            async for tokens in _committed(served, events):
                yield tokens
        finally:
            self._num_serving -= 1
            self.engine_loop.cancel(submission)  # a no-op once it finished

    def _meter_iteration(self, engine) -> None:
        """After each engine iteration (on its thread): device memory in use, and the iteration
        the scheduler planned (batch sizes, link utilisation, planned memory high-water mark)."""
        self._metrics.set_device_memory(engine.memory.in_use_bytes)
        scheduled = engine.scheduler.metrics
        if scheduled.iterations and scheduled.iterations[-1] is not self._last_metered:
            self._last_metered = scheduled.iterations[-1]
            self._metrics.iteration_planned(self._last_metered, scheduled.peak_memory_bytes)


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
            yield served.commit(event.token_ids, tuple(event.logprobs))
            continue
        assert isinstance(event, RequestFinished)
        output, seq = event.output, served.seq
        done = len(seq.output_ids)
        yield served.commit(output.token_ids[done:], tuple((output.logprobs or [])[done:]))
        if not seq.is_finished:
            seq.finish(output.finish_reason)
        seq.stats.rounds = output.stats.rounds
        seq.stats.accepted_per_round = list(output.stats.accepted_per_round)
        seq.stats.drafted_per_round = list(output.stats.drafted_per_round)
        return
