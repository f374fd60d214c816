"""Health that never lies: a worker found gone by any call, or silent to its probe, makes health
NOT_SERVING at once, before the next request is refused; an answer that may predate its death
does not bring it back, and the next real one does."""

from __future__ import annotations

import asyncio
import threading

import pytest
from grpc_health.v1 import health_pb2

from tests.serve_fixtures import start_server, wait_for
from tests.test_migration import health, kill
from vericache.client import Client, ServerUnavailableError
from vericache.errors import WorkerGoneError
from vericache.kv.shared_prefix import SharedPrefixes
from vericache.serve.backends import distributed
from vericache.serve.backends.distributed import DistributedBackend
from vericache.serve.config import CoordinatorConfig
from vericache.serve.front import api
from vericache.serve.workers.handles import InProcess, VerifierHandle
from vericache.serve.workers.worker_api import DrafterInfo, ModelInfo, WorkerStartup

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
PROMPT = "Which function multiplies by three?"


@pytest.fixture
def server(tiny_chat_checkpoint, tmp_path, monkeypatch):
    # Health polls no more: whatever it says in this test, it heard from the workers at once.
    monkeypatch.setattr(api, "HEALTH_INTERVAL_S", 3600.0)
    config = CoordinatorConfig(max_migrations=0)  # a request whose verifier died is refused
    with start_server(tiny_chat_checkpoint, tmp_path, num_drafters=1, config=config) as running:
        yield running


def test_health_is_not_serving_as_soon_as_a_call_finds_the_verifier_gone(server):
    (verifier,) = server.coordinator.backend.verifiers
    assert health(server) == SERVING
    dying = kill(verifier, "decode", at=1)
    with Client(server.target, timeout=60, retries=0) as client:
        with pytest.raises(ServerUnavailableError):
            client.generate(PROMPT, mode="full_local", max_tokens=8)
        assert dying.dead and not verifier.is_alive
        assert health(server) == NOT_SERVING  # with no sleep in between
        with pytest.raises(ServerUnavailableError, match="no verifier"):
            client.generate(PROMPT, mode="full_local", max_tokens=8)
        dying.revive()
        assert wait_for(lambda: health(server) == SERVING)  # the probe found it answering
        assert len(client.generate(PROMPT, mode="full_local", max_tokens=4).token_ids) == 4


class _Worker:
    """A worker whose describe answers when `answer` is set."""

    def __init__(self):
        self.answer = threading.Event()

    def describe(self) -> DrafterInfo:
        self.answer.wait(30)
        model = ModelInfo("m", "sha256:m", 8, 8, (), 1, numerics="cpu:test:float32")
        return DrafterInfo(model, WorkerStartup(0.0, 0.0, 0.0), SharedPrefixes(1).stats())


def _backend() -> tuple[DistributedBackend, VerifierHandle, _Worker, list[bool]]:
    worker = _Worker()
    handle = VerifierHandle(worker, InProcess("probed"), "probed")
    backend = DistributedBackend([handle], [])
    changes = []
    backend.watch_serving(lambda: changes.append(backend.is_serving()))
    return backend, handle, worker, changes


def test_a_worker_silent_to_its_probe_is_not_alive_until_it_answers(monkeypatch):
    monkeypatch.setattr(distributed, "PROBE_TIMEOUT_S", 0.05)
    backend, handle, worker, changes = _backend()
    asyncio.run(backend._ask(handle))
    assert not handle.is_alive and changes == [False]
    worker.answer.set()
    asyncio.run(backend._ask(handle))
    assert handle.is_alive and changes == [False, True]


def test_a_probe_answer_that_may_predate_a_death_does_not_bring_the_worker_back():
    backend, handle, worker, changes = _backend()

    async def probe_while_a_call_finds_it_gone() -> None:
        probe = asyncio.create_task(backend._ask(handle))
        await asyncio.sleep(0.05)
        handle.mark_gone()  # a call found it gone while the probe was out
        worker.answer.set()
        await probe

    asyncio.run(probe_while_a_call_finds_it_gone())
    assert not handle.is_alive and changes == [False]
    asyncio.run(backend._ask(handle))  # a probe sent after the death
    assert handle.is_alive and changes == [False, True]


async def _gone() -> None:
    raise WorkerGoneError("the worker is gone")


def test_a_death_reported_by_a_call_from_before_the_worker_came_back_leaves_it_alive():
    backend, handle, worker, changes = _backend()
    worker.answer.set()

    async def restart_then_late_errors() -> None:
        before_the_restart = handle.num_times_back
        handle.mark_gone()
        await backend._ask(handle)  # the restarted worker answers
        assert handle.is_alive
        with pytest.raises(WorkerGoneError):  # a call made to the worker that died fails late
            await handle._answered(_gone(), before_the_restart)
        assert handle.is_alive and changes == [False, True]
        with pytest.raises(WorkerGoneError):  # a call made to the worker that came back
            await handle._answered(_gone(), handle.num_times_back)
        assert not handle.is_alive and changes == [False, True, False]

    asyncio.run(restart_then_late_errors())
