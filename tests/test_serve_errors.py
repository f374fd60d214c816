"""Every status code of the API, cancellation, and a server that keeps serving after each."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from tests.serve_fixtures import (
    CONTEXT,
    a_tenth_of_its_time,
    open_sessions,
    start_server,
    wait_for,
)
from vericache.client import Client
from vericache.client.errors import (
    DeadlineExceededError,
    PrefixNotFoundError,
    ServerBusyError,
    ServerUnavailableError,
)
from vericache.compress import build_compressor
from vericache.serve.config import CoordinatorConfig
from vericache.serve.store.catalog import PrefixKey
from vericache.v1 import vericache_pb2 as pb
from vericache.v1 import vericache_pb2_grpc

LONG_PROMPT = "Count slowly. " * 400  # past the tiny model's 512 positions


@pytest.fixture(scope="module")
def server(tiny_chat_checkpoint, tmp_path_factory):
    # One request at a time and no queue: a second concurrent request is refused.
    config = CoordinatorConfig(max_running=1, max_waiting=0, decode_chunk=2)
    root = tmp_path_factory.mktemp("errors")
    with start_server(tiny_chat_checkpoint, root, num_drafters=1, config=config) as running:
        yield running


@pytest.fixture(scope="module")
def prefix_id(server):
    with Client(server.target, timeout=60) as client:
        return client.put_prefix(CONTEXT, compressor="streamingllm", ratio=4)


def _code(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as caught:
        result = call()
        if not isinstance(result, pb.PrefixInfo):
            list(result)  # streams fail on iteration
    return caught.value.code()


def _generate(stub, **fields):
    return lambda: stub.Generate(
        pb.GenerateRequest(max_tokens=4, prompt="hi", **fields), timeout=30
    )


def _put(stub, **fields):
    return lambda: stub.PutPrefix(pb.PutPrefixRequest(**fields), timeout=30)


def test_bad_generate_requests_are_invalid_arguments(stub, prefix_id):
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    assert _code(_generate(stub, prefix_id=prefix_id, draft_len=0)) == invalid
    assert _code(_generate(stub, prefix_id=prefix_id, draft_len=10_000)) == invalid
    assert _code(_generate(stub, prefix_id=prefix_id, mode=99)) == invalid
    assert _code(_generate(stub, mode=pb.VERICACHE)) == invalid  # no prefix to draft over
    long = pb.GenerateRequest(prompt=LONG_PROMPT, max_tokens=4, mode=pb.FULL_LOCAL)
    assert _code(lambda: stub.Generate(long, timeout=30)) == invalid
    empty = pb.GenerateRequest(prefix_id=prefix_id, prompt="", max_tokens=4)
    assert _code(lambda: stub.Generate(empty, timeout=30)) == invalid


def test_bad_prefixes_are_invalid_arguments(stub):
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    ok = pb.Compressor(name="streamingllm", ratio=4)
    assert _code(_put(stub, text="x", compressor=pb.Compressor(name="nope"))) == invalid
    assert _code(_put(stub, text="x", compressor=pb.Compressor(name="kivi", bits=3))) == invalid
    assert _code(_put(stub, text="x", compressor=pb.Compressor(name="kivi", ratio=4))) == invalid
    int8 = pb.Compressor(name="streamingllm", ratio=4, dtype="int8")
    assert _code(_put(stub, text="x", compressor=int8)) == invalid
    quantized = pb.Compressor(name="kivi", bits=4, dtype="bfloat16")
    assert _code(_put(stub, text="x", compressor=quantized)) == invalid
    assert _code(_put(stub, text="", compressor=ok)) == invalid
    assert _code(_put(stub, compressor=ok)) == invalid
    too_big = pb.TokenIds(ids=[1 << 30])
    assert _code(_put(stub, token_ids=too_big, compressor=ok)) == invalid
    too_long = pb.TokenIds(ids=[5] * 600)
    assert _code(_put(stub, token_ids=too_long, compressor=ok)) == invalid


def test_unknown_prefixes_are_not_found(stub):
    not_found = grpc.StatusCode.NOT_FOUND
    for prefix_id in ("pfx-" + "0" * 32, "../../etc/passwd", "x"):
        assert _code(_generate(stub, prefix_id=prefix_id)) == not_found
        get = pb.GetPrefixRequest(prefix_id=prefix_id)
        assert _code(lambda: stub.GetPrefix(get, timeout=30)) == not_found  # noqa: B023


def test_a_full_server_refuses_with_resource_exhausted(server, prefix_id):
    with Client(server.target, timeout=60) as client:
        with client.stream(
            "Go on.", prefix_id=prefix_id, mode="full_local", max_tokens=200
        ) as busy:
            next(iter(busy))  # running: the only slot is taken
            with pytest.raises(ServerBusyError):
                client.generate("hi", prefix_id=prefix_id, mode="vericache", max_tokens=4)
    assert wait_for(lambda: open_sessions(server) == 0)


def test_no_drafter_is_unavailable_and_full_local_still_serves(tiny_chat_checkpoint, tmp_path):
    with start_server(tiny_chat_checkpoint, tmp_path, num_drafters=0) as server:
        with Client(server.target, timeout=60, retries=1, backoff_s=0.01) as client:
            prefix_id = client.put_prefix(CONTEXT, compressor="streamingllm", ratio=4)
            for mode in ("vericache", "full_remote", "lossy"):
                with pytest.raises(ServerUnavailableError):
                    client.generate("hi", prefix_id=prefix_id, mode=mode, max_tokens=4)
            result = client.generate("hi", prefix_id=prefix_id, mode="full_local", max_tokens=4)
            assert len(result.token_ids) == 4


def test_a_passed_deadline_stops_the_work(server):
    with Client(server.target) as client:
        timeout_s = a_tenth_of_its_time(
            lambda: client.generate("Count.", mode="full_local", max_tokens=400)
        )
        with pytest.raises(DeadlineExceededError):
            client.generate("Count.", mode="full_local", max_tokens=400, timeout=timeout_s)
    assert wait_for(lambda: open_sessions(server) == 0)


def test_a_cancelled_stream_closes_the_sessions_on_the_workers(server, prefix_id):
    with Client(server.target, timeout=60) as client:
        stream = client.stream(
            "Go on.", prefix_id=prefix_id, mode="vericache", max_tokens=300, draft_len=2
        )
        next(iter(stream))
        assert open_sessions(server) == 2  # the verifier's and the drafter's
        stream.close()
        assert wait_for(lambda: open_sessions(server) == 0)
        # The slot is free again, and the server serves as before.
        result = client.generate("hi", prefix_id=prefix_id, mode="vericache", max_tokens=6)
        assert len(result.token_ids) == 6


STAGED_TTL_S = 0.5


@pytest.fixture
def staging_server(tiny_chat_checkpoint, tmp_path):
    with start_server(
        tiny_chat_checkpoint, tmp_path, num_drafters=1, staged_ttl_s=STAGED_TTL_S
    ) as running:
        yield running


def test_a_registration_abandoned_after_prefill_leaves_no_staged_kv(staging_server, monkeypatch):
    server = staging_server
    verifier = server.coordinator.backend.verifiers[0].worker
    # Hold the store stage until the client has cancelled: the compress stage never comes.
    entered, release, stored = threading.Event(), threading.Event(), threading.Event()
    real_store = verifier.store_prefix

    def held_store(key):
        entered.set()
        release.wait(30)
        try:
            return real_store(key)
        finally:
            stored.set()

    monkeypatch.setattr(verifier, "store_prefix", held_store)
    with grpc.insecure_channel(server.target) as channel:
        compressor = pb.Compressor(name="streamingllm", ratio=4)
        stream = vericache_pb2_grpc.VeriCacheStub(channel).PutPrefix(
            pb.PutPrefixRequest(text=CONTEXT, compressor=compressor), timeout=60
        )
        prefix_id = next(stream).prefix_id
        assert entered.wait(30)
        assert verifier.prefixes.staged_bytes > 0  # the prefill's full KV, staged for the store
        stream.cancel()
    # The coordinator discards it at once, while the store stage still runs on its thread.
    assert wait_for(lambda: verifier.prefixes.staged_bytes == 0, timeout_s=10)
    release.set()
    assert stored.wait(30)
    assert verifier.prefixes.staged_bytes > 0  # abandoned between its calls
    monkeypatch.undo()

    time.sleep(STAGED_TTL_S)
    with Client(server.target, timeout=60) as client:
        with pytest.raises(PrefixNotFoundError):
            client.get_prefix(prefix_id)  # any request sweeps the expired entries
        assert verifier.prefixes.staged_bytes == 0
        # Registering again finds the full KV in the store and completes.
        assert client.put_prefix(CONTEXT, compressor="streamingllm", ratio=4) == prefix_id
        assert verifier.prefixes.staged_bytes == 0
        assert (
            len(
                client.generate("hi", prefix_id=prefix_id, mode="vericache", max_tokens=4).token_ids
            )
            == 4
        )


def test_a_store_stage_whose_staged_kv_was_dropped_prefills_again(staging_server):
    verifier = staging_server.coordinator.backend.verifiers[0].worker
    token_ids = tuple(range(5, 45))
    key = PrefixKey(token_ids, False, build_compressor("streamingllm", ratio=4))
    verifier.prefill_prefix(key)
    assert verifier.discard_staged(key)  # what a coordinator does for a cancelled put
    assert not verifier.discard_staged(key) and verifier.prefixes.staged_bytes == 0
    assert verifier.store_prefix(key).store_bytes > 0
    assert verifier.prefixes.store.contains(token_ids)
    record = verifier.compress_prefix(key)
    assert record.token_ids == token_ids and verifier.prefixes.staged_bytes == 0
