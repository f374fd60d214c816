"""The distributed backend: verifier and drafter workers (in this process, or Ray actors across
nodes), with prefixes in the verifiers' full-KV store and catalog.

It places each request on the least busy verifier (and, for the modes that need one, drafter),
runs its rounds (rounds.py: on their own, or on the verifier's schedule, scheduled.py) and closes
its sessions on the workers when it ends, is cancelled or fails.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from vericache.errors import UnsupportedModelError, WorkerUnavailableError
from vericache.serve.api_types import ServeMode
from vericache.serve.catalog import PrefixKey, PrefixRecord
from vericache.serve.config import CoordinatorConfig
from vericache.serve.metrics import ServeMetrics
from vericache.serve.rounds import ServedRequest, run_request
from vericache.serve.scheduled import ScheduledRounds, new_scheduled_rounds
from vericache.serve.worker_api import (
    DrafterAPI,
    ModelInfo,
    VerifierAPI,
    VerifierInfo,
)


class DistributedBackend:
    def __init__(
        self,
        verifiers: list[VerifierAPI],
        drafters: list[DrafterAPI],
        config: CoordinatorConfig | None = None,
    ):
        self.verifiers = verifiers
        self.drafters = drafters
        self.config = config or CoordinatorConfig()
        self._addresses: dict[str, str] = {}  # verifier name -> its KVTransfer address
        # Verifier name -> the schedule of its VERICACHE rounds; empty: each request on its own.
        self.schedules: dict[str, ScheduledRounds] = {}

    async def start(self, metrics: ServeMetrics) -> ModelInfo:
        if not self.verifiers:
            raise WorkerUnavailableError("a coordinator needs at least one verifier")
        described = await asyncio.gather(*(v.describe() for v in self.verifiers))
        for verifier, about in zip(self.verifiers, described):
            self._addresses[verifier.name] = about.transfer_address
        drafters = await asyncio.gather(*(d.describe() for d in self.drafters))
        models = {about.model for about in [*described, *drafters]}
        if len({model.fingerprint for model in models}) != 1:
            raise UnsupportedModelError(f"workers serve different models: {sorted(models)}")
        if self.config.scheduling != "per-request" and self.drafters:
            await self._start_schedules(described, metrics)
        return described[0].model

    async def _start_schedules(self, described: list[VerifierInfo], metrics: ServeMetrics) -> None:
        """One schedule per verifier, from first estimates of a draft step and of each verifier's
        load bandwidth (measured only here: per-request rounds need neither)."""
        steps = await asyncio.gather(*(d.time_draft_step() for d in self.drafters))
        bandwidths = await asyncio.gather(*(v.measure_load_bandwidth() for v in self.verifiers))
        self.schedules = {
            verifier.name: new_scheduled_rounds(
                verifier, about, bandwidth, max(steps), self.config, metrics
            )
            for verifier, about, bandwidth in zip(self.verifiers, described, bandwidths)
        }

    async def close(self) -> None:
        await asyncio.gather(*(w.shutdown() for w in [*self.drafters, *self.verifiers]))

    # --- Prefixes: the first verifier's catalog (verifiers sharing a root share it) ---------------

    async def register(self, prefix_id: str, key: PrefixKey) -> AsyncIterator[str]:
        verifier = self.verifiers[0]
        is_registered = False
        try:
            yield "prefill"
            await verifier.prefill_prefix(key)
            yield "store"
            await verifier.store_prefix(key)
            yield "compress"
            await verifier.compress_prefix(key)
            is_registered = True
        finally:
            if not is_registered:
                # Cancelled, past its deadline or failed between stages: free the staged full KV
                # now (the verifier also expires it, for a stage still running on its thread).
                discard = verifier.discard_staged(key)
                await asyncio.shield(asyncio.gather(discard, return_exceptions=True))

    async def record(self, prefix_id: str) -> PrefixRecord:
        return await self.verifiers[0].get_prefix(prefix_id)

    async def records(self) -> list[PrefixRecord]:
        return await self.verifiers[0].list_prefixes()

    async def remove(self, prefix_id: str) -> None:
        await self.verifiers[0].delete_prefix(prefix_id)

    # --- Requests ---------------------------------------------------------------------------------

    def check_can_serve(self, mode: ServeMode) -> None:
        if mode.needs_drafter and not self.drafters:
            raise WorkerUnavailableError(f"no drafter is running to serve {mode.name}")

    async def serve(self, served: ServedRequest) -> AsyncIterator[list[int]]:
        verifier = _least_busy(self.verifiers, "verifier")
        drafter = _least_busy(self.drafters, "drafter") if served.plan.mode.needs_drafter else None
        workers = [w for w in (verifier, drafter) if w is not None]
        for worker in workers:
            worker.active += 1
        try:
            address = self._addresses[verifier.name]
            schedule = self.schedules.get(verifier.name)
            async for tokens in run_request(served, verifier, drafter, address, schedule):
                yield tokens
        finally:
            for worker in workers:
                worker.active -= 1
            # Cancelled or not, the workers drop the request's caches.
            closing = [w.close_session(served.session_id) for w in workers]
            await asyncio.shield(asyncio.gather(*closing, return_exceptions=True))


def _least_busy(workers: list, kind: str):
    if not workers:
        raise WorkerUnavailableError(f"no {kind} is running")
    return min(workers, key=lambda w: w.active)
