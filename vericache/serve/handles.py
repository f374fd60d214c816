"""How the coordinator calls workers: one interface over in-process objects and Ray actors.

Either way a worker takes up to `MAX_CONCURRENT_CALLS` calls at once (an in-process thread pool, a
threaded Ray actor): each prepares its request on its own thread and joins the worker's batch loop
(batching.py), so requests that draft or verify at the same time share forwards. While some
requests verify on the verifier, others draft on the drafters.
"""

from __future__ import annotations

import abc
import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from vericache.errors import VeriCacheError, WorkerUnavailableError

MAX_CONCURRENT_CALLS = 64


class WorkerHandle(abc.ABC):
    """A worker the coordinator may place requests on; `active` counts its open sessions."""

    def __init__(self, name: str):
        self.name = name
        self.active = 0

    @abc.abstractmethod
    async def call(self, method: str, *args) -> Any:
        """Runs `method` of the worker with `args`; raises what the worker raised."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Shuts the worker down (its sessions, servers and store)."""


class LocalWorker(WorkerHandle):
    def __init__(self, worker, name: str):
        super().__init__(name)
        self.worker = worker
        self._executor = ThreadPoolExecutor(MAX_CONCURRENT_CALLS, thread_name_prefix=name)

    async def call(self, method: str, *args) -> Any:
        loop = asyncio.get_running_loop()
        bound = functools.partial(getattr(self.worker, method), *args)
        return await loop.run_in_executor(self._executor, bound)

    async def close(self) -> None:
        await self.call("shutdown")
        self._executor.shutdown(wait=True)


class RayWorker(WorkerHandle):
    def __init__(self, actor, name: str):
        super().__init__(name)
        self.actor = actor

    async def call(self, method: str, *args) -> Any:
        import ray

        try:
            return await getattr(self.actor, method).remote(*args)
        except ray.exceptions.RayActorError as exc:
            raise WorkerUnavailableError(f"worker {self.name} is gone: {exc}") from None
        except ray.exceptions.RayTaskError as exc:
            # Errors the worker raised on purpose keep their type across the process boundary.
            if isinstance(exc.cause, VeriCacheError):
                raise exc.cause from None
            raise

    async def close(self) -> None:
        import ray

        try:
            await self.call("shutdown")
        except WorkerUnavailableError:
            pass
        ray.kill(self.actor)
