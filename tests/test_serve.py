"""The served system end to end through gRPC: every mode, prefixes, concurrency, residency."""

from __future__ import annotations

import concurrent.futures

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.compressor_table import api_arguments, pick
from tests.serve_fixtures import CONTEXT, open_sessions, start_server, wait_for
from vericache.client import Client
from vericache.client.errors import PrefixNotFoundError
from vericache.serve.workers.worker_api import Residency

PROMPT = "Which function multiplies by three?"
# Rows of the shared table as the SDK names them; the hard H2O row also keeps its tokens in
# bfloat16: 16-bit draft KV streamed to the drafter, evicted online.
SERVED = [
    *(
        api_arguments(row) | ({"dtype": "bfloat16"} if row == pick("h2o")[1] else {})
        for row in pick("streamingllm", "kivi", "h2o")
    ),
    {"compressor": "snapkv+kivi", "ratio": 4, "bits": 4},  # a composition, named as users name it
]


@pytest.fixture(scope="module")
def server(tiny_chat_checkpoint, tmp_path_factory):
    with start_server(tiny_chat_checkpoint, tmp_path_factory.mktemp("serve")) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    with Client(server.target, timeout=120) as connected:
        yield connected


@pytest.mark.parametrize("choice", SERVED, ids=lambda choice: "-".join(map(str, choice.values())))
def test_vericache_and_full_remote_equal_full_local(client, server, choice):
    prefix_id = client.put_prefix(CONTEXT, **choice)
    results = {
        mode: client.generate(PROMPT, prefix_id=prefix_id, mode=mode, max_tokens=48, draft_len=6)
        for mode in ("full_local", "vericache", "full_remote", "lossy")
    }
    reference = results["full_local"]
    assert len(reference.token_ids) == 48 and reference.finish_reason == "length"
    for mode in ("vericache", "full_remote"):
        assert results[mode].token_ids == reference.token_ids, mode
        assert results[mode].text == reference.text
    vericache = results["vericache"].stats
    assert vericache["rounds"] < 48  # rounds yield several tokens each
    assert vericache["link_bytes"] > 0
    # The verifier holds one copy of the prefix's full KV: the first request to need it read it
    # from the store (here full_local, or an earlier case's over the same text), none after it.
    assert vericache["store_bytes"] == results["full_remote"].stats["store_bytes"] == 0
    # LOSSY is what it is: output of the right length, over the compressed KV only.
    lossy = results["lossy"]
    assert len(lossy.token_ids) == 48 and lossy.stats["store_bytes"] == 0
    assert wait_for(lambda: open_sessions(server) == 0)


def test_the_full_kv_crosses_the_link_only_for_full_remote(client, server):
    # A compressor no other test registers: the drafters' LRUs have not seen this prefix.
    prefix_id = client.put_prefix(CONTEXT, compressor="streamingllm", ratio=6)
    info = client.get_prefix(prefix_id)
    assert info.compressed_kv_bytes < info.full_kv_bytes / 3
    # The drafters' LRUs are cold for this prefix: the first request of a kind pays the transfer.
    remote = client.generate(PROMPT, prefix_id=prefix_id, mode="full_remote", max_tokens=4)
    assert remote.stats["link_bytes"] > info.full_kv_bytes / 2
    # Its drafter now holds the full KV and says so: auto prices its next FULL_REMOTE request
    # over the prefix with no fetch once a probe has told the coordinator.
    drafters = server.coordinator.backend.drafters
    assert any(prefix_id in d.worker.describe().full_prefixes for d in drafters)
    assert wait_for(lambda: any(prefix_id in d.full_prefixes for d in drafters))
    lossy = client.generate(PROMPT, prefix_id=prefix_id, mode="lossy", max_tokens=4)
    assert 0 < lossy.stats["link_bytes"] < info.full_kv_bytes / 3


def test_put_prefix_is_idempotent_and_reports_progress(client):
    stages = []
    first = client.put_prefix(CONTEXT + "# v2\n", compressor="snapkv", ratio=4)
    again = client.put_prefix(
        CONTEXT + "# v2\n", compressor="snapkv", ratio=4, on_progress=stages.append
    )
    assert first == again
    assert [p.stage for p in stages] == ["queued", "done"] and stages[-1].existed
    other = client.put_prefix(CONTEXT + "# v2\n", compressor="snapkv", ratio=2)
    assert other != first  # the compressor is part of the id


def test_progress_of_a_new_prefix_walks_every_stage(client):
    stages = []
    client.put_prefix(token_ids=list(range(10, 200)), compressor="tova", ratio=2,
                      on_progress=stages.append)  # fmt: skip
    assert [p.stage for p in stages] == ["queued", "prefill", "store", "compress", "done"]
    assert stages[-1].num_tokens == 190 and not stages[-1].existed


def test_token_id_prefixes_are_continued_by_the_prompt(client):
    prefix_id = client.put_prefix(token_ids=list(range(100, 400)), compressor="kivi", bits=4)
    full = client.generate("def f(", prefix_id=prefix_id, mode="full_local", max_tokens=24)
    vericache = client.generate("def f(", prefix_id=prefix_id, max_tokens=24, draft_len=5)
    assert vericache.token_ids == full.token_ids


def test_list_get_and_delete(client):
    prefix_id = client.put_prefix(CONTEXT + "# to delete\n", compressor="streamingllm", ratio=2)
    assert prefix_id in {p.prefix_id for p in client.list_prefixes()}
    info = client.get_prefix(prefix_id)
    assert info.compressor.name == "streamingllm" and info.compressor.ratio == 2
    assert info.num_tokens > 100 and info.full_kv_bytes > info.compressed_kv_bytes > 0
    assert client.delete_prefix(prefix_id)
    assert not client.delete_prefix(prefix_id)  # gone already
    assert prefix_id not in {p.prefix_id for p in client.list_prefixes()}
    with pytest.raises(PrefixNotFoundError):
        client.get_prefix(prefix_id)
    with pytest.raises(PrefixNotFoundError):
        client.generate(PROMPT, prefix_id=prefix_id, max_tokens=4)


def test_generate_without_prefix_decodes_full_local(client):
    result = client.generate(PROMPT, mode="full_local", max_tokens=8)
    assert len(result.token_ids) == 8 and result.stats["link_bytes"] == 0


def test_stop_strings_end_every_mode_at_the_same_place(client):
    prefix_id = client.put_prefix(CONTEXT, compressor="streamingllm", ratio=4)
    reference = client.generate(PROMPT, prefix_id=prefix_id, mode="full_local", max_tokens=40)
    stop = reference.text[10:14]
    assert stop.strip(), reference.text
    ends = {
        mode: client.generate(PROMPT, prefix_id=prefix_id, mode=mode, max_tokens=40, stop=[stop])
        for mode in ("full_local", "vericache", "full_remote")
    }
    for result in ends.values():
        assert result.finish_reason == "stop" and stop not in result.text
        assert result.token_ids == ends["full_local"].token_ids
        assert result.text == ends["full_local"].text


def test_streamed_deltas_add_up_to_the_text(client):
    prefix_id = client.put_prefix(CONTEXT, compressor="streamingllm", ratio=4)
    with client.stream(PROMPT, prefix_id=prefix_id, max_tokens=32, draft_len=4) as stream:
        deltas = list(stream)
        result = stream.result()
    assert len(deltas) > 1 and "".join(deltas) == result.text
    assert result.stats["ttft_s"] > 0 and result.stats["tokens_per_s"] > 0


def test_concurrent_requests_on_one_and_several_prefixes(client, server):
    prefixes = [
        client.put_prefix(CONTEXT, compressor="streamingllm", ratio=4),
        client.put_prefix(CONTEXT + "# other\n", compressor="kivi", bits=4),
    ]
    jobs = [(p, prompt) for p in prefixes for prompt in (PROMPT, "Explain scale_3.")] * 2

    def run(job, mode):
        prefix_id, prompt = job
        return client.generate(prompt, prefix_id=prefix_id, mode=mode, max_tokens=24).token_ids

    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        together = list(pool.map(lambda job: run(job, "vericache"), jobs))
    alone = [run(job, "full_local") for job in jobs]
    assert together == alone
    # Requests running at once shared forwards on the drafters and on the verifier.
    backend = server.coordinator.backend
    for workers in (backend.drafters, backend.verifiers):
        assert max(w.worker.batching().max_batch for w in workers) > 1


def test_health_and_reflection(server):
    with grpc.insecure_channel(server.target) as channel:
        check = health_pb2_grpc.HealthStub(channel).Check
        for service in ("", "vericache.v1.VeriCache"):
            response = check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert response.status == health_pb2.HealthCheckResponse.SERVING
        from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        (answer,) = list(stub.ServerReflectionInfo(iter([request]), timeout=10))
        names = {s.name for s in answer.list_services_response.service}
        assert {"vericache.v1.VeriCache", "grpc.health.v1.Health"} <= names


def test_bounded_residency_reloads_from_the_shared_copy_and_stays_exact(
    tiny_chat_checkpoint, tmp_path
):
    # A budget below one request's full KV: every round rebuilds the session's full KV from the
    # verifier's one copy of the prefix, which only the first request read from the store.
    with start_server(tiny_chat_checkpoint, tmp_path, num_drafters=1, resident_bytes=1) as server:
        with Client(server.target, timeout=120) as client:
            prefix_id = client.put_prefix(CONTEXT, compressor="streamingllm", ratio=4)
            full_kv = client.get_prefix(prefix_id).full_kv_bytes
            full = client.generate(PROMPT, prefix_id=prefix_id, mode="full_local", max_tokens=32)
            exact = client.generate(PROMPT, prefix_id=prefix_id, max_tokens=32, draft_len=4)
        assert exact.token_ids == full.token_ids
        assert full.stats["store_bytes"] == full_kv and exact.stats["store_bytes"] == 0
        residency = server.run(_residency(server))
        # Nothing stays resident, and no more than one request's full KV ever was.
        assert residency.bytes == 0 and 0 < residency.peak_bytes < 2 * full_kv


async def _residency(server) -> Residency:
    return await server.coordinator.backend.verifiers[0].residency()


def test_prefixes_survive_a_restart(tiny_chat_checkpoint, tmp_path):
    with start_server(tiny_chat_checkpoint, tmp_path, num_drafters=1) as server:
        with Client(server.target, timeout=120) as client:
            prefix_id = client.put_prefix(CONTEXT, compressor="kivi", bits=2)
            before = client.generate(PROMPT, prefix_id=prefix_id, max_tokens=16)
    with start_server(tiny_chat_checkpoint, tmp_path, num_drafters=1) as server:
        with Client(server.target, timeout=120) as client:
            assert [p.prefix_id for p in client.list_prefixes()] == [prefix_id]
            after = client.generate(PROMPT, prefix_id=prefix_id, max_tokens=16)
    assert after.token_ids == before.token_ids
