"""The one small interface between the serving front and what serves: `ServingBackend`.

The front (coordinator.py) owns everything a caller sees the same way whichever backend serves:
tenants and their limits, admission, request checks, prompts, streamed text deltas and metrics.
A backend owns prefixes and decoding:
- the distributed server (distributed.py): verifier and drafter workers, in this process or on
  Ray, with prefixes in the verifiers' store and catalog;
- the long-context server (long_context.py): one long-context engine in this process, with
  prefixes kept as records in its memory.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Protocol, runtime_checkable

from vericache.serve.api_types import ServeMode
from vericache.serve.backends.metrics import ServeMetrics
from vericache.serve.backends.path_costs import PathOption
from vericache.serve.backends.rounds import ServedRequest
from vericache.serve.store.catalog import PrefixKey, PrefixRecord
from vericache.serve.workers.worker_api import ModelInfo


@runtime_checkable
class ServingBackend(Protocol):
    async def start(self, metrics: ServeMetrics) -> ModelInfo:
        """Starts serving; metrics records what only the backend sees (iterations, memory)."""

    async def close(self) -> None: ...

    def is_serving(self) -> bool:
        """Whether health should say SERVING: some worker of every kind is up."""

    def check_can_serve(self, mode: ServeMode) -> None:
        """Raises a typed error when this backend cannot serve `mode` (now, or ever)."""

    def path_options(self, prefix_id: str, after_prefix: tuple[int, ...]) -> list[PathOption]:
        """The lossless paths a request over the prefix may take now, each on the worker that
        would serve it and that worker's load (`mode: auto`, path_costs.py)."""

    def register(self, prefix_id: str, key: PrefixKey) -> AsyncIterator[str]:
        """Makes what a new prefix needs; yields each stage's name as it begins."""

    async def record(self, prefix_id: str) -> PrefixRecord:
        """The registered prefix of that id; PrefixNotFoundError if none."""

    async def records(self) -> list[PrefixRecord]: ...

    async def remove(self, prefix_id: str) -> None: ...

    def serve(self, served: ServedRequest) -> AsyncIterator[list[int]]:
        """Decodes a checked request, committing through `served`; yields each batch of tokens
        committed. Closing the iterator early frees what the request holds."""


@runtime_checkable
class AnnouncesServing(Protocol):
    """A backend that says at once when `is_serving` may have changed (its workers' deaths and
    returns), so that health never lags them; health polls a backend that does not."""

    def watch_serving(self, on_change: Callable[[], None]) -> None:
        """Calls `on_change` on the event loop's thread whenever `is_serving` may have changed."""
