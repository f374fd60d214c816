"""What a client sees when a call fails: status details without internals, a request id that the
server's log carries too, failures counted by code; limits checked before work is spent; a drain
that lets running streams finish."""

from __future__ import annotations

import logging
import threading
import time

import grpc
import pytest

from tests.serve_fixtures import CONTEXT, counts, start_server, wait_for
from vericache.client import Client, InvalidRequestError, ServerUnavailableError
from vericache.engine.link import LinkSpec
from vericache.serve.config import CoordinatorConfig
from vericache.v1 import vericache_pb2 as pb
from vericache.v1 import vericache_pb2_grpc

MAX_OUTPUT_TOKENS = 64


@pytest.fixture(scope="module")
def server(tiny_chat_checkpoint, tmp_path_factory):
    config = CoordinatorConfig(default_max_tokens=8, max_output_tokens=MAX_OUTPUT_TOKENS)
    root = tmp_path_factory.mktemp("statuses")
    with start_server(tiny_chat_checkpoint, root, num_drafters=1, config=config) as running:
        yield running


def failures(server) -> dict[str, float]:
    return counts(server, "request_failure", "code")


def rpc_error(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        result = call()
        if not isinstance(result, pb.ListPrefixesResponse | pb.PrefixInfo):
            list(result)  # streams fail on iteration
    return caught.value


def test_an_internal_error_shows_no_internals_and_names_its_request(
    server, stub, monkeypatch, caplog
):
    async def broken():
        raise RuntimeError("Traceback at /var/lib/secret/store.py, pid 4242, 10.0.0.7:6379")

    monkeypatch.setattr(server.coordinator.backend, "records", broken)
    before = failures(server).get("INTERNAL", 0)
    with caplog.at_level(logging.INFO, logger="vericache"):
        error = rpc_error(lambda: stub.ListPrefixes(pb.ListPrefixesRequest(), timeout=30))
    assert error.code() is grpc.StatusCode.INTERNAL
    detail = error.details()
    for secret in ("Traceback", "/var/lib", "4242", "10.0.0.7", "RuntimeError"):
        assert secret not in detail
    request_id = detail.rsplit("request id ", 1)[1].rstrip(")")
    (logged,) = [r for r in caplog.records if getattr(r, "request_id", None) == request_id]
    assert logged.exc_info is not None and "/var/lib/secret" in str(logged.exc_info[1])
    assert failures(server)["INTERNAL"] == before + 1


def test_refusals_keep_their_one_line_and_are_counted_by_code(server, stub):
    before = failures(server).get("INVALID_ARGUMENT", 0)
    request = pb.GenerateRequest(prompt="hi", mode=pb.FULL_LOCAL, draft_len=0)
    error = rpc_error(lambda: stub.Generate(request, timeout=30))
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT
    detail = error.details()
    assert detail.startswith("draft_len must lie in [1, ") and "(request id " in detail
    assert failures(server)["INVALID_ARGUMENT"] == before + 1
    success = server.coordinator.metrics.exposition().decode()
    assert 'finished_reason="error"' not in success


def test_max_tokens_zero_is_invalid_unset_is_the_default_and_a_cap_holds(server, stub):
    def generate(**fields):
        request = pb.GenerateRequest(prompt="hi", mode=pb.FULL_LOCAL, **fields)
        return list(stub.Generate(request, timeout=60))

    for max_tokens in (0, -1, MAX_OUTPUT_TOKENS + 1):
        error = rpc_error(lambda: generate(max_tokens=max_tokens))  # noqa: B023
        assert error.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert f"max_tokens must lie in [1, {MAX_OUTPUT_TOKENS}]" in error.details()
    *_, summary = generate()
    assert summary.stats.num_tokens == 8  # the server's default_max_tokens
    *_, summary = generate(max_tokens=MAX_OUTPUT_TOKENS)
    assert summary.stats.num_tokens <= MAX_OUTPUT_TOKENS


@pytest.mark.parametrize("ratio", [float("inf"), 1e9, 0.5])
def test_ratios_outside_the_stated_range_are_invalid(server, ratio):
    with Client(server.target, timeout=60) as client:
        with pytest.raises(InvalidRequestError, match=r"ratio must lie in \[1, 64\]"):
            client.put_prefix(CONTEXT, compressor="streamingllm", ratio=ratio)


def test_a_prefix_text_too_long_for_the_context_is_refused_before_tokenizing(server, stub):
    huge = pb.PutPrefixRequest(
        text="x = 1\n" * 650_000, compressor=pb.Compressor(name="streamingllm", ratio=4)
    )  # 3.9 MB
    outcome, latencies = {}, []

    def put():
        outcome["error"] = rpc_error(lambda: stub.PutPrefix(huge, timeout=60))

    thread = threading.Thread(target=put)
    thread.start()
    while thread.is_alive():
        started = time.perf_counter()
        stub.ListPrefixes(pb.ListPrefixesRequest(), timeout=30)
        latencies.append(time.perf_counter() - started)
    thread.join()
    assert outcome["error"].code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "characters: more than the model's" in outcome["error"].details()
    assert max(latencies, default=0) < 0.5  # the event loop never waited on the text


def test_a_server_drains_running_streams_and_refuses_new_calls(tiny_chat_checkpoint, tmp_path):
    # 50 ms each way per drafter call: a stream of rounds takes seconds.
    running = start_server(
        tiny_chat_checkpoint, tmp_path, num_drafters=1, link=LinkSpec(latency=0.05)
    )
    with Client(running.target, timeout=120, retries=1, backoff_s=0.01) as client:
        prefix_id = client.put_prefix(CONTEXT, compressor="streamingllm", ratio=4)
        expected = client.generate("Go on.", prefix_id=prefix_id, mode="full_local", max_tokens=48)
        with client.stream("Go on.", prefix_id=prefix_id, max_tokens=48, draft_len=4) as stream:
            text = next(iter(stream))
            stopping = threading.Thread(target=running.stop, kwargs={"grace_s": 60})
            stopping.start()
            time.sleep(0.2)  # the server has stopped admitting calls
            with pytest.raises(ServerUnavailableError):
                client.generate("hi", prefix_id=prefix_id, mode="full_local", max_tokens=2)
            text += "".join(stream)
            result = stream.result()
        assert result.finish_reason == "length"
        assert result.token_ids == expected.token_ids and text == expected.text
    stopping.join(120)
    assert not stopping.is_alive()


def test_a_cancelled_registration_stops_its_prefill_before_its_slot_is_free(
    tiny_chat_checkpoint, tmp_path, monkeypatch
):
    with start_server(tiny_chat_checkpoint, tmp_path, num_drafters=1, prefill_chunk=16) as server:
        verifier = server.coordinator.backend.verifiers[0].worker
        runner = verifier.prefixes.runner
        real_prefill, chunks = runner.prefill, []

        def slow_prefill(ids, cache, num_logits=1, chunk_size=512):
            chunks.append(len(ids))
            time.sleep(0.05)
            return real_prefill(ids, cache, num_logits, chunk_size)

        monkeypatch.setattr(runner, "prefill", slow_prefill)
        compressor = pb.Compressor(name="streamingllm", ratio=4)
        with grpc.insecure_channel(server.target) as channel:
            stream = vericache_pb2_grpc.VeriCacheStub(channel).PutPrefix(
                pb.PutPrefixRequest(text=CONTEXT, compressor=compressor), timeout=60
            )
            next(stream)
            assert wait_for(lambda: len(chunks) >= 2)
            stream.cancel()
            assert wait_for(lambda: not server.coordinator._num_active)  # the slot is free...
            stopped_at = len(chunks)
            time.sleep(0.3)
            assert len(chunks) == stopped_at  # ...once the prefill had stopped
        assert stopped_at * 16 < 250  # long before its ~300 tokens
        assert verifier.prefixes.staged_bytes == 0
        monkeypatch.undo()
        with Client(server.target, timeout=60) as client:  # registering again works
            assert client.put_prefix(CONTEXT, compressor="streamingllm", ratio=4)
