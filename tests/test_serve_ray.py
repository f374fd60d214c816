"""The served system on real Ray: a verifier node and a drafter node (the session's `ray_cluster`),
actors placed by their custom resources, reached through gRPC."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from tests.serve_fixtures import CONTEXT, counts, wait_for
from vericache.client import Client, ServerUnavailableError
from vericache.errors import WorkerUnavailableError
from vericache.serve.config import DrafterConfig, VerifierConfig
from vericache.serve.launch.server import distributed_server

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.ray
PROMPT = "Which function multiplies by five?"


@pytest.fixture(scope="module")
def cluster(ray_cluster):
    return ray_cluster


@pytest.fixture(scope="module")
def configs(tiny_chat_checkpoint, tmp_path_factory):
    model = str(tiny_chat_checkpoint)
    root = tmp_path_factory.mktemp("ray-store")
    verifier = VerifierConfig(model=model, root=root, transfer_host="127.0.0.1", num_threads=1)
    return verifier, DrafterConfig(model=model, num_threads=1)


@pytest.fixture(scope="module")
def server(cluster, configs):
    from vericache.serve.launch.cluster import ray_workers

    verifier, drafter = configs
    workers = lambda: ray_workers(verifier, drafter, 1, 1, placement_timeout_s=120)  # noqa: E731
    with distributed_server(workers, verifier.model) as running:
        yield running


def _actors(server) -> list:
    """The server's verifier and drafter actors."""
    coordinator = server.coordinator
    return [coordinator.backend.verifiers[0].worker, coordinator.backend.drafters[0].worker]


def _on_actor(actor, function):
    return ray.get(actor.__ray_call__.remote(function))


def test_actors_land_on_the_nodes_with_their_resource(server, cluster):
    node_of = lambda self: ray.get_runtime_context().get_node_id()  # noqa: E731
    verifier_node, drafter_node = (_on_actor(a, node_of) for a in _actors(server))
    assert verifier_node == cluster.head_node.node_id
    assert drafter_node != verifier_node


def test_every_mode_through_grpc_on_ray(server):
    with Client(server.target, timeout=120) as client:
        prefix_id = client.put_prefix(CONTEXT, compressor="h2o", ratio=4)
        assert client.put_prefix(CONTEXT, compressor="h2o", ratio=4) == prefix_id
        results = {
            mode: client.generate(
                PROMPT, prefix_id=prefix_id, mode=mode, max_tokens=40, draft_len=6
            )
            for mode in ("full_local", "vericache", "full_remote", "lossy")
        }
    reference = results["full_local"].token_ids
    assert results["vericache"].token_ids == reference
    assert results["full_remote"].token_ids == reference
    assert len(results["lossy"].token_ids) == 40
    assert results["vericache"].stats["link_bytes"] > 0


def test_cancelling_stops_the_work_on_the_actors(server):
    with Client(server.target, timeout=120) as client:
        prefix_id = client.put_prefix(CONTEXT, compressor="streamingllm", ratio=4)
        with client.stream(PROMPT, prefix_id=prefix_id, max_tokens=400, draft_len=2) as stream:
            next(iter(stream))

        def sessions() -> int:
            return sum(_on_actor(a, lambda self: self.num_sessions) for a in _actors(server))

        assert wait_for(lambda: sessions() == 0, timeout_s=30)
        assert len(client.generate(PROMPT, prefix_id=prefix_id, max_tokens=5).token_ids) == 5


def test_a_missing_resource_is_reported_after_the_placement_timeout(cluster, configs):
    from vericache.serve.launch.cluster import ray_workers

    verifier, drafter = configs
    # The cluster has one `drafter` unit, held by the server's drafter when that test ran.
    with pytest.raises(WorkerUnavailableError, match="drafter"):
        ray_workers(verifier, drafter, 0, 3, placement_timeout_s=3)


def _pid(handle) -> int:
    return _on_actor(handle.worker, lambda self: os.getpid())


def _restarted(handle, pid: int) -> bool:
    try:
        return _pid(handle) != pid
    except ray.exceptions.RayActorError:  # still restarting
        return False


@pytest.mark.parametrize("kind", ["drafters", "verifiers"])
def test_a_killed_worker_restarts_and_its_request_streams_on_unchanged(server, kind):
    """SIGKILL of a worker's process mid-stream: Ray restarts the actor, the coordinator notices
    it gone and back, and the request goes on there from its last committed token."""
    backend = server.coordinator.backend
    handle, drafter = getattr(backend, kind)[0], backend.drafters[0]
    before = sum(counts(server, "request_migrations", "model_name").values())
    with Client(server.target, timeout=180, retries=0) as client:
        prefix_id = client.put_prefix(CONTEXT, compressor="streamingllm", ratio=4)
        reference = client.generate(PROMPT, prefix_id=prefix_id, mode="full_local", max_tokens=48)
        pid = _pid(handle)
        drafter.latency_s = 0.05  # rounds of 100 ms or more: the kill lands mid-stream
        try:
            with client.stream(
                PROMPT, prefix_id=prefix_id, mode="vericache", max_tokens=48, draft_len=2
            ) as stream:
                text = next(iter(stream))
                os.kill(pid, signal.SIGKILL)
                text += "".join(stream)
                result = stream.result()
        finally:
            drafter.latency_s = 0.0
    assert text == reference.text and result.token_ids == reference.token_ids
    assert result.finish_reason == "length"
    after = sum(counts(server, "request_migrations", "model_name").values())
    assert after >= before + 1  # it did go on after the kill
    assert _pid(handle) != pid and handle.is_alive  # a new process


def test_a_verifier_killed_during_put_prefix_leaves_no_half_registered_prefix(server):
    handle = server.coordinator.backend.verifiers[0]
    text = "# killed while registering\n" + CONTEXT
    with Client(server.target, timeout=180, retries=0) as client:
        pid = _pid(handle)
        outcome = {}

        def put():
            try:
                outcome["id"] = client.put_prefix(text, compressor="kivi", bits=2)
            except Exception as exc:  # noqa: BLE001 - what the client saw is the result
                outcome["error"] = exc

        registering = threading.Thread(target=put)
        registering.start()
        time.sleep(0.1)  # the registration is on its way through its stages
        os.kill(pid, signal.SIGKILL)
        registering.join(180)
        assert wait_for(lambda: _restarted(handle, pid), timeout_s=120)
        assert wait_for(lambda: server.coordinator.backend.is_serving(), timeout_s=30)
        if "error" in outcome:
            assert isinstance(outcome["error"], ServerUnavailableError)
        # Whatever the kill cut, every listed prefix is whole: it serves.
        for listed in client.list_prefixes():
            assert client.generate(PROMPT, prefix_id=listed.prefix_id, max_tokens=2).token_ids
        registered = client.put_prefix(text, compressor="kivi", bits=2)
        assert outcome.get("id", registered) == registered
        ids = [p.prefix_id for p in client.list_prefixes()]
        assert ids.count(registered) == 1
        assert len(client.generate(PROMPT, prefix_id=registered, max_tokens=4).token_ids) == 4
