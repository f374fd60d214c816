"""How the coordinator calls workers: the typed handles of worker_api.py, over a transport.

`VerifierHandle` and `DrafterHandle` implement `VerifierAPI` and `DrafterAPI` once, each method
calling its namesake on the worker; a `Transport` says where that worker runs:
- `InProcess`: a `Verifier` or `Drafter` object in this process, called on a thread pool (tests,
  benchmarks);
- `OverRay`: a Ray actor of one (`vericache serve`), whose errors of our own types keep their
  type across the process boundary.
Either way a worker takes up to `MAX_CONCURRENT_CALLS` calls at once (the pool, a threaded actor):
each prepares its request on its own thread and joins the worker's batch loop, so requests that
draft or verify at the same time share forwards.

A call can also be started and its answer handed to another worker by reference
(`Transport.start`): the verifier waits for a draft call's answer on its own side, so a scheduled
round's drafts reach it without a call of their own.

A drafter sits across the slow link: `DrafterHandle` makes every call pay the link's one-way
latency out and back (`latency_s`, emulated; 0 where the network is real). A draft's answer pays
it once more on its way to the verifier, which sits beside the coordinator.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from vericache.errors import VeriCacheError, WorkerGoneError, WorkerUnavailableError
from vericache.serve.cluster_secret import ClusterSecret
from vericache.serve.store.catalog import PrefixKey, PrefixRecord
from vericache.serve.workers.kv_transfer import KVKind, fetch_kind
from vericache.serve.workers.turn_cache import TurnCache
from vericache.serve.workers.worker_api import (
    BatchingStats,
    DecodeCall,
    Decoded,
    DraftCall,
    Drafted,
    DrafterInfo,
    DrafterOpened,
    DraftInFlight,
    DraftRole,
    LocalOpened,
    LocalRound,
    LocalRoundCall,
    OpenDrafter,
    OpenLocal,
    OpenVerifier,
    Residency,
    Traffic,
    Verified,
    VerifierInfo,
    VerifierOpened,
    VerifyCall,
)
from vericache.serve.workers.worker_load import WorkerLoad

if TYPE_CHECKING:
    from vericache.serve.workers.drafter import Drafter
    from vericache.serve.workers.verifier import Verifier

log = logging.getLogger(__name__)

MAX_CONCURRENT_CALLS = 64
# The Ray concurrency group of probes (describe): a thread of its own, so that a probe never
# waits behind the calls a busy worker holds, and its silence means the worker cannot answer.
PROBE_GROUP = "probe"
T = TypeVar("T")


@dataclass(frozen=True)
class Started(Generic[T]):
    """A worker call in flight."""

    result: Awaitable[T]  # its answer, here
    answer: LocalAnswer | RayAnswer  # ...and by reference, for another worker to wait for


class Transport(Protocol):
    def start(self, method: Callable[..., T], *args: Any) -> Started[T]:
        """Starts a worker method (a bound method, or a Ray actor's method) with `args`; its
        result raises what the worker raised."""

    def start_probe(self, method: Callable[[], T]) -> Awaitable[T]:
        """Starts a method that answers at once (describe) apart from the worker's other calls,
        which it never waits behind."""

    async def release(self, worker: Any) -> None:
        """Frees what runs the worker once it has shut down."""


@dataclass(frozen=True)
class LocalAnswer:
    """A call's answer in this process: its future."""

    future: concurrent.futures.Future
    latency_s: float = 0.0  # one way, toward the worker that waits for it (emulated)

    def wait(self, timeout_s: float) -> Any:
        try:
            result = self.future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            return None
        except concurrent.futures.CancelledError:
            raise WorkerUnavailableError("the call was cancelled before it answered") from None
        time.sleep(self.latency_s)
        return result


@dataclass(frozen=True)
class RayAnswer:
    """A call's answer across processes: its Ray object reference, which the waiting worker
    fetches straight from the worker that answered."""

    ref: Any  # ray.ObjectRef
    name: str  # the answering worker's
    latency_s: float = 0.0

    def wait(self, timeout_s: float) -> Any:
        import ray

        try:
            result = ray.get(self.ref, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            return None
        except Exception as exc:  # noqa: BLE001 - translated, or raised as it is
            raise _translated(exc, self.name) from None
        time.sleep(self.latency_s)
        return result


def _translated(exc: Exception, name: str) -> Exception:
    """A Ray call's error as the caller should see it: a dead worker as `WorkerGoneError`, the
    errors a worker raised on purpose with their own type."""
    import ray

    if isinstance(exc, ray.exceptions.RayActorError):
        log.warning("worker %s is gone: %s", name, exc)
        return WorkerGoneError(f"worker {name} is gone")
    if isinstance(exc, ray.exceptions.RayTaskError) and isinstance(exc.cause, VeriCacheError):
        return exc.cause
    return exc


class InProcess:
    def __init__(self, name: str):
        self._executor = ThreadPoolExecutor(MAX_CONCURRENT_CALLS, thread_name_prefix=name)
        self._probes = ThreadPoolExecutor(1, thread_name_prefix=f"{name}-{PROBE_GROUP}")

    def start(self, method: Callable[..., T], *args: Any) -> Started[T]:
        future = self._executor.submit(functools.partial(method, *args))
        return Started(asyncio.wrap_future(future), LocalAnswer(future))

    def start_probe(self, method: Callable[[], T]) -> Awaitable[T]:
        return asyncio.wrap_future(self._probes.submit(method))

    async def release(self, worker: Any) -> None:
        # Waited for off the loop: a call still running may need the loop to finish.
        await asyncio.to_thread(self._executor.shutdown, wait=True)
        self._probes.shutdown(wait=False)


class OverRay:
    def __init__(self, name: str):
        self.name = name

    def start(self, method, *args: Any) -> Started:
        ref = method.remote(*args)
        return Started(self._result(ref), RayAnswer(ref, self.name))

    def start_probe(self, method) -> Awaitable:
        return self._result(method.options(concurrency_group=PROBE_GROUP).remote())

    async def _result(self, ref):
        try:
            return await ref
        except Exception as exc:  # noqa: BLE001 - translated, or raised as it is
            raise _translated(exc, self.name) from None

    async def release(self, worker: Any) -> None:
        import ray

        ray.kill(worker)


class _Handle:
    def __init__(self, worker: Any, transport: Transport, name: str):
        # A Verifier or Drafter object, or a Ray actor of one (whose methods run remotely).
        self.worker = worker
        self.transport = transport
        self.name = name
        # 1 while a request computes on it, else 0, over time: the share of a request's life a
        # worker beside it on its memory system slowed it (auto_path.py).
        self.busy = WorkerLoad()
        self._active = 0  # requests the coordinator has placed on it that compute there
        # Requests whose tokens come at its pace (it decodes them, or drafts them), and their
        # mean over time: what `mode: auto` weighs its paths by (auto_path.py).
        self.decoding = WorkerLoad()
        # The prefixes those requests decode over, and how many over each: rows over one prefix
        # read it once per forward, so a request joins its prefix's rows for little. Both change
        # together (`start_pacing`, `stop_pacing`).
        self.paced_prefixes: Counter[str | None] = Counter()
        # The prefixes whose full KV it holds for its own sessions as its last probe said: a warm
        # drafter node's host tier (warm_node.py); none on a verifier, which holds them all.
        self.warm_prefixes: frozenset[str] = frozenset()
        # The prefixes whose full KV a drafter's device holds, as its last probe said: its FULL
        # sessions over them fetch nothing.
        self.full_prefixes: frozenset[str] = frozenset()
        # Its arithmetic (`ModelInfo.numerics`), as its last probe said: a warm drafter node
        # verifies a request only where it matches the verifier's.
        self.numerics = ""
        self.memory_system = ""  # `ModelInfo.memory_system`, as its last probe said
        # What it keeps of finished turns, as the coordinator reckons it (turn_cache.py): set
        # from its budget once described, emptied when it restarts.
        self.turns = TurnCache(0)
        # False from a call that found the worker gone until a probe finds it answering again (a
        # restarted actor): the coordinator places nothing on a worker that is not alive.
        self._alive = True
        # Calls that found the worker gone: an answer to a probe sent before the latest of them
        # may come from the worker as it was before it died, and is no sign that it is back.
        self.num_times_gone = 0
        # Times it came back: a call started before the latest may fail with the death of the
        # worker as it was then, and is no sign that the worker that came back is gone.
        self.num_times_back = 0
        self._watchers: list[Callable[[], None]] = []

    @property
    def active(self) -> int:
        return self._active

    @active.setter
    def active(self, value: int) -> None:
        self._active = value
        self.busy.count = 1 if value else 0

    def start_pacing(self, prefix_id: str | None) -> None:
        """A request over `prefix_id` now comes at its pace (`decoding`, `paced_prefixes`)."""
        self.decoding.count += 1
        self.paced_prefixes[prefix_id] += 1

    def stop_pacing(self, prefix_id: str | None) -> None:
        self.decoding.count -= 1
        self.paced_prefixes[prefix_id] -= 1
        if not self.paced_prefixes[prefix_id]:
            del self.paced_prefixes[prefix_id]

    @property
    def is_alive(self) -> bool:
        return self._alive

    def watch(self, on_change: Callable[[], None]) -> None:
        """Calls `on_change` at once whenever `is_alive` changes: on the event loop, where every
        call and probe that marks the worker runs."""
        self._watchers.append(on_change)

    def mark_gone(self, num_times_back: int | None = None) -> None:
        """Marks the worker not alive; with `num_times_back`, only if it has not come back since
        the call that found it gone started then."""
        if num_times_back is not None and num_times_back != self.num_times_back:
            return
        self.num_times_gone += 1
        self._set_alive(False)

    def mark_back(self, num_times_gone: int) -> bool:
        """Marks the worker alive after a probe sent when it had been found gone
        `num_times_gone` times; returns whether it is alive now."""
        if num_times_gone == self.num_times_gone and not self._alive:
            self.num_times_back += 1
            self._set_alive(True)
        return self._alive

    def _set_alive(self, alive: bool) -> None:
        if alive != self._alive:
            self._alive = alive
            for on_change in self._watchers:
                on_change()

    async def _call(self, method: Callable[..., T], *args: Any) -> T:
        num_times_back = self.num_times_back
        return await self._answered(self.transport.start(method, *args).result, num_times_back)

    async def _probe(self, method: Callable[[], T]) -> T:
        num_times_back = self.num_times_back
        return await self._answered(self.transport.start_probe(method), num_times_back)

    async def _answered(self, result: Awaitable[T], num_times_back: int) -> T:
        try:
            return await result
        except WorkerGoneError:
            self.mark_gone(num_times_back)
            raise

    async def shutdown(self) -> None:
        """Shuts the worker down (its sessions, servers and store), then what runs it."""
        try:
            await self._call(self.worker.shutdown)
        except WorkerUnavailableError:
            pass
        await self.transport.release(self.worker)


class VerifierHandle(_Handle):
    worker: Verifier

    async def describe(self) -> VerifierInfo:
        return await self._probe(self.worker.describe)

    async def measure_load_bandwidth(self) -> float:
        return await self._call(self.worker.measure_load_bandwidth)

    async def prefill_prefix(self, key: PrefixKey) -> None:
        return await self._call(self.worker.prefill_prefix, key)

    async def store_prefix(self, key: PrefixKey) -> Traffic:
        return await self._call(self.worker.store_prefix, key)

    async def compress_prefix(self, key: PrefixKey) -> PrefixRecord:
        return await self._call(self.worker.compress_prefix, key)

    async def discard_staged(self, key: PrefixKey) -> bool:
        return await self._call(self.worker.discard_staged, key)

    async def get_prefix(self, prefix_id: str) -> PrefixRecord:
        return await self._call(self.worker.get_prefix, prefix_id)

    async def list_prefixes(self) -> list[PrefixRecord]:
        return await self._call(self.worker.list_prefixes)

    async def delete_prefix(self, prefix_id: str) -> PrefixRecord:
        return await self._call(self.worker.delete_prefix, prefix_id)

    async def open(self, call: OpenVerifier) -> VerifierOpened:
        return await self._call(self.worker.open, call)

    async def verify(self, call: VerifyCall) -> Verified:
        return await self._call(self.worker.verify, call)

    async def decode(self, call: DecodeCall) -> Decoded:
        return await self._call(self.worker.decode, call)

    async def close_session(self, session_id: str) -> None:
        return await self._call(self.worker.close_session, session_id)

    async def batching(self) -> BatchingStats:
        return await self._call(self.worker.batching)

    async def residency(self) -> Residency:
        return await self._call(self.worker.residency)


class DrafterHandle(_Handle):
    worker: Drafter

    def __init__(
        self,
        worker: Any,
        transport: Transport,
        name: str,
        secret: ClusterSecret,
        latency_s: float = 0.0,
    ):
        super().__init__(worker, transport, name)
        self.secret = secret  # the coordinator's half: it grants each session its fetch
        self.latency_s = latency_s  # one way, across the slow link

    async def _call(self, method: Callable[..., T], *args: Any) -> T:
        return await self._across_link(super()._call(method, *args))

    async def _across_link(self, call: Awaitable[T]) -> T:
        if self.latency_s > 0:
            await asyncio.sleep(self.latency_s)  # the call goes out...
        result = await call
        if self.latency_s > 0:
            await asyncio.sleep(self.latency_s)  # ...and its answer comes back
        return result

    async def describe(self) -> DrafterInfo:
        return await self._across_link(self._probe(self.worker.describe))

    async def time_draft_step(self) -> float:
        return await self._call(self.worker.time_draft_step)

    async def open(self, call: OpenDrafter) -> DrafterOpened:
        """Opens the session with its grant to fetch the prefix's KV (the kind its role uses),
        and a DRAFT session's to stream the prefix's full KV into the node's host tier."""
        grant = self.secret.grant(call.session_id, call.prefix_id, fetch_kind(call.role))
        tier_grant = ""
        if call.role is DraftRole.DRAFT and call.warms_host_tier:
            tier_grant = self.secret.grant(call.session_id, call.prefix_id, KVKind.FULL)
        call = dataclasses.replace(call, fetch_grant=grant, host_tier_grant=tier_grant)
        return await self._call(self.worker.open, call)

    async def open_local(self, call: OpenLocal) -> LocalOpened:
        return await self._call(self.worker.open_local, call)

    async def local_round(self, call: LocalRoundCall) -> LocalRound:
        return await self._call(self.worker.local_round, call)

    async def draft(self, call: DraftCall) -> Drafted:
        return await self.draft_ahead(call).drafted

    def draft_ahead(self, call: DraftCall) -> DraftInFlight:
        """Starts a draft call at once, its way out across the link paid on the drafter's side
        (`DraftCall.arrives_in_s`), so that its answer exists by reference from now on."""
        call = dataclasses.replace(call, arrives_in_s=call.arrives_in_s + self.latency_s)
        started = self.transport.start(self.worker.draft, call)
        answer = dataclasses.replace(started.answer, latency_s=self.latency_s)
        answered = self._answered(self._back(started.result), self.num_times_back)
        return DraftInFlight(answered, answer)

    async def _back(self, result: Awaitable[T]) -> T:
        answered = await result
        if self.latency_s > 0:
            await asyncio.sleep(self.latency_s)  # the answer comes back across the link
        return answered

    async def decode(self, call: DecodeCall) -> Decoded:
        return await self._call(self.worker.decode, call)

    async def close_session(self, session_id: str) -> None:
        return await self._call(self.worker.close_session, session_id)

    async def batching(self) -> BatchingStats:
        return await self._call(self.worker.batching)
