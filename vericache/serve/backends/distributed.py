"""The distributed backend: verifier and drafter workers (in this process, or Ray actors across
nodes), with prefixes in the verifiers' full-KV store and catalog.

It places each request on the verifier (and, for the modes that need one, the drafter) that holds
its prefix, by rendezvous hashing with load margins (scheduler/placement.py: a hot prefix spills to
the least busy worker; a request without a prefix goes there at once), runs its rounds (rounds.py)
on its verifier's schedule (scheduled.py: back to back, staggered or lock-step) and closes its
sessions on the workers when it ends, is cancelled or fails.

Workers die: a call (or the probe, twice a second) that finds its worker gone marks it not alive
(handles.py), and so does a probe that gets no answer in time; nothing is placed on it until the
probe finds it answering again (a Ray actor restarted). Each change is announced at once
(`watch_serving`): health follows it before the next request is placed. A request whose worker
died goes on from its last committed token on other workers, or on the restarted one, at most
`max_migrations` times: its new sessions open with everything committed so far, so its stream
goes on as if nothing happened (rounds.py, `ServedRequest.history`); a scheduled request leaves
its schedule with its failure and joins it again with its new sessions. `is_serving` is False
while no worker of some kind is up.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable

from vericache.engine.link import LinkSpec
from vericache.errors import UnsupportedModelError, WorkerUnavailableError
from vericache.kv.shared_prefix import PrefixCacheStats
from vericache.scheduler.placement import Candidate, place
from vericache.serve.api_types import ServeMode
from vericache.serve.backends.co_runners import CoRunnerMeter
from vericache.serve.backends.local_rounds import same_arithmetic
from vericache.serve.backends.metrics import ServeMetrics
from vericache.serve.backends.path_costs import PathOption
from vericache.serve.backends.path_options import path_options
from vericache.serve.backends.restarts import Restarts
from vericache.serve.backends.rounds import ServedRequest, run_request
from vericache.serve.backends.scheduled import BackToBack, ScheduledRounds, new_scheduled_rounds
from vericache.serve.config import CoordinatorConfig
from vericache.serve.store.catalog import PrefixKey, PrefixRecord
from vericache.serve.workers.turn_cache import TurnCache
from vericache.serve.workers.worker_api import (
    DrafterAPI,
    DrafterInfo,
    ModelInfo,
    VerifierAPI,
    VerifierInfo,
)

log = logging.getLogger(__name__)
PROBE_INTERVAL_S = 0.5  # how often every worker is asked how it is
PROBE_TIMEOUT_S = 5.0  # a worker that does not answer a probe within it is not alive


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
        self._links: dict[str, LinkSpec] = {}  # verifier name -> its link toward the drafters
        # Verifier name -> the staggered or lock-step schedule of its VERICACHE rounds; empty:
        # each request's rounds back to back.
        self.schedules: dict[str, ScheduledRounds] = {}
        self._probe: asyncio.Task | None = None
        self._metrics: ServeMetrics | None = None  # from `start` on
        self._restarts = Restarts(self.config.worker_wait_s)
        for worker in [*verifiers, *drafters]:  # each restart timed from its worker found gone
            worker.watch(functools.partial(self._on_alive_change, worker))

    async def start(self, metrics: ServeMetrics) -> ModelInfo:
        if not self.verifiers:
            raise WorkerUnavailableError("a coordinator needs at least one verifier")
        described = await asyncio.gather(*(v.describe() for v in self.verifiers))
        for verifier, about in zip(self.verifiers, described):
            self._addresses[verifier.name] = about.transfer_address
            self._links[verifier.name] = about.link
        drafters = await asyncio.gather(*(d.describe() for d in self.drafters))
        models = {about.model for about in [*described, *drafters]}
        if len({model.fingerprint for model in models}) != 1:
            raise UnsupportedModelError(f"workers serve different models: {sorted(models)}")
        self._restarts.metrics = self._metrics = metrics
        for worker, about in zip(self._workers, [*described, *drafters]):
            worker.numerics = about.model.numerics
            worker.memory_system = about.model.memory_system
            worker.turns = _turn_index(about)
            self._restarts.started(worker.name, about.startup)
            metrics.prefix_cache_reported(worker.name, about.prefix_cache, _host_tier(about))
        if self.config.scheduling != "per-request" and self.drafters:
            await self._start_schedules(described, metrics)
        self._probe = asyncio.create_task(self._probe_workers(), name="probe-workers")
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
        if self._probe is not None:
            self._probe.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._probe
        await asyncio.gather(*(schedule.close() for schedule in self.schedules.values()))
        await asyncio.gather(*(w.shutdown() for w in [*self.drafters, *self.verifiers]))

    def _catalog_verifier(self) -> VerifierAPI:
        """The verifier that answers for the catalog (verifiers sharing a root share it)."""
        for verifier in self.verifiers:
            if verifier.is_alive:
                return verifier
        raise WorkerUnavailableError("no verifier is running")

    def is_serving(self) -> bool:
        """Some worker of every kind this server has is up."""
        return self._are_up(bool(self.drafters))

    def _are_up(self, with_drafters: bool) -> bool:
        kinds = [self.verifiers, self.drafters] if with_drafters else [self.verifiers]
        return all(any(worker.is_alive for worker in kind) for kind in kinds)

    def _on_alive_change(self, worker) -> None:
        if not worker.is_alive:
            self._restarts.gone(worker.name)

    def watch_serving(self, on_change: Callable[[], None]) -> None:
        """Calls `on_change` at once whenever a worker is marked alive or not alive."""
        for worker in self._workers:
            worker.watch(on_change)

    async def _probe_workers(self) -> None:
        """Asks every worker, every PROBE_INTERVAL_S, how it is: one that died while idle is
        marked not alive before a request finds it, one that answers again is back, and the new
        port of a restarted verifier's KV transfer service is known before drafters need it."""
        while True:
            await asyncio.sleep(PROBE_INTERVAL_S)
            # All at once: a worker slow to answer delays no other's probe.
            await asyncio.gather(*(self._ask(w) for w in self._workers))

    async def _ask(self, worker) -> None:
        """One probe of a worker: alive (and, for a verifier, where its KV transfer service
        listens; its prefix cache, for the metrics) when it answers; not alive when it is gone or
        does not answer in time."""
        was_alive, num_times_gone = worker.is_alive, worker.num_times_gone
        try:
            about = await asyncio.wait_for(worker.describe(), PROBE_TIMEOUT_S)
        except TimeoutError:
            # Neither an answer nor an error: a worker that cannot say who it is cannot serve a
            # request either. Ray fails a call to a dead or restarting actor after about 2 s,
            # so the timeout is longer: that error comes first and marks it just the same.
            if was_alive:
                log.warning("worker %s did not answer within %g s", worker.name, PROBE_TIMEOUT_S)
            worker.mark_gone()
            return
        except Exception:  # noqa: BLE001 - gone (its handle marked it so), or failing: next time
            return
        is_verifier = isinstance(about, VerifierInfo)
        worker.numerics = about.model.numerics
        worker.memory_system = about.model.memory_system
        if is_verifier:
            self._addresses[worker.name] = about.transfer_address
        else:
            worker.warm_prefixes = about.warm_prefixes
            worker.full_prefixes = about.full_prefixes
        if self._metrics is not None:
            self._metrics.prefix_cache_reported(worker.name, about.prefix_cache, _host_tier(about))
        # Found gone while the probe was out: the answer may predate that, so the next one says.
        if worker.mark_back(num_times_gone) and not was_alive:
            worker.turns = _turn_index(about)  # a restarted worker keeps no turn
            kind = "verifier" if is_verifier else "drafter"
            self._restarts.back(worker.name, kind, about.startup)

    # --- Prefixes: the first verifier's catalog (verifiers sharing a root share it) ---------------

    async def register(self, prefix_id: str, key: PrefixKey) -> AsyncIterator[str]:
        verifier = self._catalog_verifier()
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
        return await self._catalog_verifier().get_prefix(prefix_id)

    async def records(self) -> list[PrefixRecord]:
        return await self._catalog_verifier().list_prefixes()

    async def remove(self, prefix_id: str) -> None:
        await self._catalog_verifier().delete_prefix(prefix_id)

    # --- Requests ---------------------------------------------------------------------------------

    def path_options(self, prefix_id: str, after_prefix: tuple[int, ...]) -> list[PathOption]:
        """The paths a request over `prefix_id` may take now (path_options.py), each on the
        worker placement would give it. A drafter of other arithmetic than the verifier's
        (`ModelInfo.numerics`) is offered for nothing: its full decoding would give other bits,
        and auto's paths all give the verifier's."""
        verifier = _placed_or_none(self.verifiers, prefix_id)
        drafter = _placed_or_none(self.drafters, prefix_id)
        if drafter is not None and verifier is not None and not same_arithmetic(drafter, verifier):
            drafter = None
        link = self._links[verifier.name] if verifier else LinkSpec()
        return path_options(verifier, drafter, self._workers, link, prefix_id, after_prefix)

    @property
    def _workers(self) -> list:
        return [*self.verifiers, *self.drafters]

    def check_can_serve(self, mode: ServeMode) -> None:
        if mode.needs_drafter and not any(d.is_alive for d in self.drafters):
            raise WorkerUnavailableError(f"no drafter is running to serve {mode.name}")
        if not any(v.is_alive for v in self.verifiers):
            raise WorkerUnavailableError("no verifier is running")

    async def serve(self, served: ServedRequest) -> AsyncIterator[list[int]]:
        """The request's committed tokens, batch by batch, on whichever workers are alive."""
        while True:
            try:
                async for tokens in self._serve_on_workers(served):
                    yield tokens
                return
            except WorkerUnavailableError:
                if not self._may_migrate(served):
                    raise
            served.num_migrations += 1
            log.warning(
                "request %s goes on elsewhere after %d tokens (migration %d)",
                served.session_id, len(served.seq.output_ids), served.num_migrations,
            )  # fmt: skip
            await self._wait_for_workers(served)
            # A verifier that restarted before a probe noticed listens on a new port: its
            # drafters could not reach it. Ask it now rather than at the next probe.
            for verifier in self.verifiers:
                if verifier.is_alive:
                    await self._ask(verifier)

    def _may_migrate(self, served: ServedRequest) -> bool:
        return served.num_migrations < self.config.max_migrations

    async def _wait_for_workers(self, served: ServedRequest) -> None:
        """Until workers that can go on with the request are alive (one of each kind it needs,
        its stream's arithmetic where it decodes), or `worker_wait_s` passed."""
        deadline = time.monotonic() + self._restarts.wait_s()
        while not self._can_place(served):
            if time.monotonic() > deadline:
                raise WorkerUnavailableError("no worker came back to go on with the request")
            await asyncio.sleep(PROBE_INTERVAL_S / 2)

    def _can_place(self, served: ServedRequest) -> bool:
        try:
            self._placed_for(served)
        except WorkerUnavailableError:
            return False
        return True

    def _placed_for(self, served: ServedRequest) -> tuple:
        """The request's verifier and drafter (None where its mode needs none). The worker whose
        forwards choose its tokens is of its stream's arithmetic, once it has one (`numerics`): a
        stream that goes on elsewhere keeps its bits, or waits for such a worker."""
        mode, prefix_id, numerics = served.plan.mode, served.plan.prefix_id, served.numerics
        on_drafter = _decodes_on_drafter(mode)
        verifier = _placed(self.verifiers, prefix_id, "verifier", "" if on_drafter else numerics)
        drafter = None
        if mode.needs_drafter:
            drafter = _placed(self.drafters, prefix_id, "drafter", numerics if on_drafter else "")
        return verifier, drafter

    async def _serve_on_workers(self, served: ServedRequest) -> AsyncIterator[list[int]]:
        prefix_id = served.plan.prefix_id
        verifier, drafter = self._placed_for(served)
        decoder = drafter if _decodes_on_drafter(served.plan.mode) else verifier
        served.numerics = served.numerics or decoder.numerics
        workers = [w for w in (verifier, drafter) if w is not None]
        # The workers whose load it counts in now: those whose forwards it runs in (a verifier
        # that only sends a FULL_REMOTE request its prefix's KV computes nothing for it).
        drafts = served.plan.mode is ServeMode.VERICACHE
        counted = [w for w in workers if w is decoder or drafts]
        for worker in counted:
            worker.active += 1
        paced = drafter or verifier  # whose forwards set its pace: the worker auto names
        paced.start_pacing(prefix_id)
        mark = paced.decoding.mark()
        # Its co-runners over its life. A VERICACHE request's verifier counts whenever busy, its
        # own verifications too (which alternate with its drafts rather than run beside them):
        # the path's correction takes that in, as its price counts the verifier busy with others.
        co_runners = CoRunnerMeter(paced, self._workers)
        served.on_warm_node = drafter is not None and prefix_id in drafter.warm_prefixes

        def release_verifier() -> None:  # its rounds moved to a warm drafter node
            if verifier in counted:
                counted.remove(verifier)
                verifier.active -= 1

        served.release_verifier = release_verifier
        try:
            address = self._addresses[verifier.name]
            schedule = self.schedules.get(verifier.name) or BackToBack(verifier)
            async for tokens in run_request(served, verifier, drafter, address, schedule):
                yield tokens
        finally:
            served.worker_load = paced.decoding.mean_since(mark)  # it included
            served.co_runners = co_runners.mean()
            paced.stop_pacing(prefix_id)
            for worker in counted:
                worker.active -= 1
            # Cancelled or not, the workers drop the request's caches (keeping its turn).
            closing = [w.close_session(served.session_id) for w in workers]
            await asyncio.shield(asyncio.gather(*closing, return_exceptions=True))
            _note_kept_turn(served, verifier, drafter)


def _turn_index(about: VerifierInfo | DrafterInfo) -> TurnCache:
    """The coordinator's index of the turns a worker keeps, within its budget."""
    return TurnCache(about.turn_cache_bytes, about.model.full_kv_bytes_per_token)


def _note_kept_turn(served: ServedRequest, verifier, drafter) -> None:
    """Notes the turn the worker whose full KV served the request kept as its session closed
    (turn_cache.py): its tokens after the prefix but the newest. A VERICACHE request's is its
    verifier's, or its warm drafter node's once its rounds went on there (warm_node.py)."""
    mode, prefix_id = served.plan.mode, served.plan.prefix_id
    keeper = {ServeMode.FULL_LOCAL: verifier, ServeMode.FULL_REMOTE: drafter}.get(mode)
    if mode is ServeMode.VERICACHE:
        keeper = drafter if served.num_local_rounds else verifier
    if keeper is not None and prefix_id:
        keeper.turns.keep(prefix_id, served.history[served.plan.request.num_prefix_tokens :])


def _decodes_on_drafter(mode: ServeMode) -> bool:
    """Whether a drafter's forwards choose the request's tokens (else the verifier's)."""
    return mode in (ServeMode.FULL_REMOTE, ServeMode.LOSSY)


def _placed_or_none(workers: list, prefix_id: str | None):
    """`_placed`, or None where no worker of the kind is alive."""
    try:
        return _placed(workers, prefix_id, "worker")
    except WorkerUnavailableError:
        return None


def _placed(workers: list, prefix_id: str | None, kind: str, numerics: str = ""):
    """The alive worker that holds the prefix (scheduler/placement.py), or the least busy one;
    of that arithmetic where `numerics` names one."""
    alive = [w for w in workers if w.is_alive and (not numerics or w.numerics == numerics)]
    if not alive:
        arithmetic = " of this stream's arithmetic" if numerics else ""
        raise WorkerUnavailableError(f"no {kind}{arithmetic} is running")
    candidates = [Candidate(w.name, w.active, prefix_id in w.warm_prefixes) for w in alive]
    return alive[place(prefix_id, candidates)]


def _host_tier(about: VerifierInfo | DrafterInfo) -> PrefixCacheStats | None:
    return about.host_tier if isinstance(about, DrafterInfo) else None
