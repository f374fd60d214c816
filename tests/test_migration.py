"""Workers that die in the middle of a request: the request goes on from its last committed token
on another worker, or on the same one once it is back, and streams what it would have streamed."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.serve_fixtures import CONTEXT, start_server, wait_for
from vericache.client import Client, ServerUnavailableError
from vericache.errors import WorkerGoneError
from vericache.scheduler.placement import ranking
from vericache.serve.config import CoordinatorConfig

PROMPT = "Which function multiplies by three?"


class Dying:
    """A transport whose worker dies at its `at`-th call of `method` (that call fails, and every
    call after it) until `revive()`: what a killed Ray actor looks like until it has restarted."""

    def __init__(self, inner, method: str, at: int):
        self.inner, self.method, self.at = inner, method, at
        self.calls, self.dead = 0, False

    def start(self, method, *args):
        if not self.dead and method.__name__ == self.method:
            self.calls += 1
            self.dead = self.calls == self.at
        if self.dead:
            return self.inner.start(_gone)
        return self.inner.start(method, *args)

    def start_probe(self, method):
        if self.dead:
            return self.inner.start_probe(_gone)
        return self.inner.start_probe(method)

    async def release(self, worker) -> None:
        await self.inner.release(worker)

    def revive(self) -> None:
        self.dead = False
        self.at = 0  # dies no more


def _gone():
    raise WorkerGoneError("the worker is gone")


def kill(handle, method: str, at: int) -> Dying:
    handle.transport = Dying(handle.transport, method, at)
    return handle.transport


def health(server) -> int:
    import grpc

    with grpc.insecure_channel(server.target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=10).status


def streamed(client: Client, prefix_id: str, mode: str) -> tuple[str, list[int], str]:
    with client.stream(PROMPT, prefix_id=prefix_id, mode=mode, max_tokens=48, draft_len=4) as s:
        text = "".join(s)
        result = s.result()
    return text, result.token_ids, result.finish_reason


@pytest.fixture
def served(tiny_chat_checkpoint, tmp_path):
    def start(num_drafters: int, **config):
        server = start_server(
            tiny_chat_checkpoint, tmp_path, num_drafters=num_drafters,
            config=CoordinatorConfig(worker_wait_s=30, **config),
        )  # fmt: skip
        client = Client(server.target, timeout=120, retries=0)
        prefix_id = client.put_prefix(CONTEXT, compressor="streamingllm", ratio=4)
        reference = client.generate(PROMPT, prefix_id=prefix_id, mode="full_local", max_tokens=48)
        started.append((server, client))
        return server, client, prefix_id, reference

    started = []
    yield start
    for server, client in started:
        client.close()
        server.stop()


def holder_first(server, prefix_id: str) -> list:
    """The drafters, the one placement sends the prefix's requests to first."""
    drafters = server.coordinator.backend.drafters
    order = ranking(prefix_id, [drafter.name for drafter in drafters])
    return [drafters[i] for i in order]


def test_a_dead_drafter_moves_its_request_to_another_and_the_stream_is_unchanged(served):
    server, client, prefix_id, reference = served(num_drafters=2)
    first, second = holder_first(server, prefix_id)
    dying = kill(first, "draft", at=3)  # the request's third round finds its drafter gone
    text, token_ids, reason = streamed(client, prefix_id, "vericache")
    assert (text, token_ids, reason) == (reference.text, reference.token_ids, "length")
    assert dying.dead and not first.is_alive and second.is_alive
    assert health(server) == health_pb2.HealthCheckResponse.SERVING  # a drafter is up
    dying.revive()
    assert wait_for(lambda: first.is_alive, timeout_s=10)  # the probe brings it back


def test_a_verifier_that_restarts_takes_its_request_back(served):
    server, client, prefix_id, reference = served(num_drafters=1)
    (verifier,) = server.coordinator.backend.verifiers
    dying = kill(verifier, "verify", at=3)
    outcome = {}
    thread = threading.Thread(
        target=lambda: outcome.update(got=streamed(client, prefix_id, "vericache"))
    )
    thread.start()
    assert wait_for(lambda: dying.dead, timeout_s=60)
    assert wait_for(lambda: health(server) == health_pb2.HealthCheckResponse.NOT_SERVING)
    with pytest.raises(ServerUnavailableError):  # needs a verifier: refused at once
        client.generate(PROMPT, prefix_id=prefix_id, mode="full_local", max_tokens=2)
    time.sleep(0.5)
    dying.revive()  # "restarted": a new process, as its start says
    verifier.worker.startup = dataclasses.replace(verifier.worker.startup, process="restarted")
    thread.join(120)
    assert outcome["got"] == (reference.text, reference.token_ids, "length")
    assert wait_for(lambda: health(server) == health_pb2.HealthCheckResponse.SERVING)
    # Its restart is timed, from the call that found it gone to the probe that found it back.
    metrics = server.coordinator.metrics
    labels = {"model_name": metrics.model_name, "kind": "verifier"}
    sample = metrics.registry.get_sample_value
    assert sample("vericache:worker_restart_seconds_count", labels) == 1
    assert 0.5 <= sample("vericache:worker_restart_seconds_sum", labels) < 30


@pytest.mark.parametrize("mode", ["full_local", "full_remote"])
def test_a_request_decoding_alone_goes_on_after_its_worker_died(served, mode):
    server, client, prefix_id, reference = served(num_drafters=2)
    backend = server.coordinator.backend
    worker = backend.verifiers[0] if mode == "full_local" else backend.drafters[0]
    dying = kill(worker, "decode", at=2)
    if mode == "full_local":  # the only verifier: back after a moment
        threading.Timer(1.0, dying.revive).start()
    text, token_ids, reason = streamed(client, prefix_id, mode)
    assert (text, token_ids, reason) == (reference.text, reference.token_ids, "length")


def test_past_max_migrations_the_request_is_unavailable(served):
    server, client, prefix_id, _ = served(num_drafters=2, max_migrations=0)
    kill(holder_first(server, prefix_id)[0], "draft", at=2)
    with pytest.raises(ServerUnavailableError):
        streamed(client, prefix_id, "vericache")
    # The other drafter serves the next request.
    assert len(client.generate(PROMPT, prefix_id=prefix_id, max_tokens=8).token_ids) == 8


def test_a_request_on_a_staggered_schedule_moves_to_another_drafter(served):
    server, client, prefix_id, reference = served(num_drafters=2, scheduling="staggered")
    first, second = holder_first(server, prefix_id)
    kill(first, "draft", at=3)
    kill(second, "draft", at=10**6)  # counts its calls
    text, token_ids, reason = streamed(client, prefix_id, "vericache")
    assert (text, token_ids, reason) == (reference.text, reference.token_ids, "length")
    assert not first.is_alive and second.transport.calls > 0


def test_a_stream_goes_on_only_on_a_worker_of_its_arithmetic(served):
    # Batch-invariant kernels give one kind of device the same bits, not two kinds: a FULL_REMOTE
    # stream whose drafter died waits for one of its kind rather than change its bits midway.
    server, client, prefix_id, reference = served(num_drafters=2)
    first, second = holder_first(server, prefix_id)
    info = second.worker.info
    second.worker.info = dataclasses.replace(info, numerics=info.numerics + ":elsewhere")
    assert wait_for(lambda: second.numerics != first.numerics)
    opened_on_second = []
    original = second.open

    async def recording(call):
        opened_on_second.append(call.session_id)
        return await original(call)

    second.open = recording
    dying = kill(first, "decode", at=2)
    threading.Timer(1.0, dying.revive).start()  # back after a moment
    text, token_ids, reason = streamed(client, prefix_id, "full_remote")
    assert (text, token_ids, reason) == (reference.text, reference.token_ids, "length")
    assert dying.calls >= 2 and opened_on_second == []  # it waited for the first drafter
