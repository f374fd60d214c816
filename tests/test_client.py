"""The client SDK's working paths against the in-process fake server (tests/client_fakes.py): every
method of both clients, cancellation, the asyncio client used natively, and an import that loads no
torch. Errors, retries and timeouts are in test_client_errors.py.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from tests.client_fakes import (
    FOREVER,
    MAX_FAKE_TOKENS,
    REQUIRED_STATS,
    STAGES,
    AsyncFakeServicer,
    FakeState,
    fake_session,
    serve_fakes,
    start_aio_server,
)
from vericache.client import (
    AsyncClient,
    Client,
    Compressor,
    PrefixInfo,
    PrefixNotFoundError,
    RequestCancelledError,
)
from vericache.v1 import vericache_pb2


@pytest.fixture(scope="module")
def servers():
    yield from serve_fakes()


@pytest.fixture(params=["sync", "async"])
def fake(request, servers):
    yield from fake_session(servers, request.param)


# --- happy paths --------------------------------------------------------------------------------


def test_put_prefix_reports_its_stages_and_is_idempotent(fake):
    client = fake.connect()
    progress = []
    prefix_id = client.put_prefix("a long shared manual", on_progress=progress.append)
    assert [p.stage for p in progress] == STAGES
    assert {p.prefix_id for p in progress} == {prefix_id}
    assert progress[-1].is_done and not progress[-1].existed and progress[-1].num_tokens == 4
    again = []
    assert client.put_prefix("a long shared manual", on_progress=again.append) == prefix_id
    assert [(p.stage, p.existed) for p in again] == [("done", True)]


def test_put_prefix_sends_token_ids_and_compressor_and_get_prefix_mirrors_them(fake):
    client = fake.connect()
    prefix_id = client.put_prefix(token_ids=[5, 6, 7], compressor="kivi", bits=2)
    request = fake.state.requests["PutPrefix"][0]
    assert list(request.token_ids.ids) == [5, 6, 7] and not request.compressor.HasField("ratio")
    info = client.get_prefix(prefix_id)
    assert info == PrefixInfo(prefix_id, 3, Compressor("kivi", None, 2), 3000, 300)
    snapkv = client.get_prefix(client.put_prefix("x", ratio=8.0))
    assert snapkv.compressor == Compressor("snapkv", 8.0, None)
    stored = client.get_prefix(client.put_prefix("y", ratio=4.0, dtype="bfloat16"))
    assert stored.compressor == Compressor("snapkv", 4.0, None, "bfloat16")


def test_list_and_delete_prefixes(fake):
    client = fake.connect()
    first, second = client.put_prefix("one"), client.put_prefix("two")
    assert sorted(info.prefix_id for info in client.list_prefixes()) == sorted([first, second])
    assert client.delete_prefix(first) is True
    assert client.delete_prefix(first) is False
    assert [info.prefix_id for info in client.list_prefixes()] == [second]
    with pytest.raises(PrefixNotFoundError, match=f"no prefix {first}: register it first"):
        client.get_prefix(first)


def test_generate_returns_text_token_ids_and_stats(fake):
    client = fake.connect()
    prefix_id = client.put_prefix("manual")
    result = client.generate(
        "hi", prefix_id=prefix_id, mode="full_remote", max_tokens=5, stop=["\n"], draft_len=4
    )
    assert result.text == " w0 w1 w2 w3 w4"
    assert result.token_ids == [100, 101, 102, 103, 104]
    assert result.finish_reason == "length"
    assert REQUIRED_STATS <= result.stats.keys()
    assert result.stats["accepted_per_round"] == [2, 2, 1] and result.stats["rounds"] == 3
    request = fake.state.requests["Generate"][0]
    assert (request.prefix_id, request.prompt, request.max_tokens) == (prefix_id, "hi", 5)
    assert request.mode == vericache_pb2.FULL_REMOTE and request.draft_len == 4
    assert list(request.stop) == ["\n"]


def test_generate_defaults(fake):
    result = fake.connect().generate("hi", stop="\n\n")
    assert result.finish_reason == "stop" and len(result.token_ids) == MAX_FAKE_TOKENS
    request = fake.state.requests["Generate"][0]
    # Unset: the server's defaults (its choice of path; the most tokens, within the API key's
    # limit).
    assert request.mode == vericache_pb2.MODE_UNSPECIFIED
    assert not request.HasField("max_tokens")
    assert request.prefix_id == "" and not request.HasField("draft_len")
    assert list(request.stop) == ["\n\n"]  # one stop string, not two newlines


def test_stream_deltas_add_up_to_the_final_text(fake):
    client = fake.connect()
    with client.stream("hi", max_tokens=6) as stream:
        deltas = list(stream)
    assert deltas == [" w0 w1", " w2 w3", " w4 w5"]
    result = stream.result()
    assert "".join(deltas) == result.text
    assert result == client.generate("hi", max_tokens=6)


def test_result_reads_what_the_loop_left(fake):
    stream = fake.connect().stream("hi")
    assert next(stream) == " w0 w1"
    assert stream.result().text == " w0 w1 w2 w3 w4 w5"
    assert list(stream) == []


# --- cancellation -------------------------------------------------------------------------------


def test_closing_a_stream_cancels_it_on_the_server(fake):
    stream = fake.connect().stream(FOREVER)
    assert next(stream) == " again"
    assert not fake.state.cancelled.is_set()
    stream.close()
    assert fake.state.cancelled.wait(5)
    assert list(stream) == []
    with pytest.raises(RequestCancelledError, match="closed before its end"):
        stream.result()


def test_breaking_out_of_a_loop_cancels_the_stream(servers):
    servers.servicer.state = state = FakeState()
    with Client(f"127.0.0.1:{servers.port}") as client:
        for delta in client.stream(FOREVER):
            assert delta == " again"
            break
        assert state.cancelled.wait(5)


def test_async_client_natively():
    async def scenario(state: FakeState):
        servicer = AsyncFakeServicer()
        servicer.state = state
        server, port = await start_aio_server(servicer)
        try:
            async with AsyncClient(f"127.0.0.1:{port}") as client:
                prefix_id = await client.put_prefix("manual")
                deltas = [delta async for delta in client.stream("hi", prefix_id=prefix_id)]
                assert "".join(deltas) == (await client.generate("hi")).text
                async with client.stream(FOREVER) as stream:
                    async for _ in stream:
                        break
                assert await asyncio.to_thread(state.cancelled.wait, 5)
        finally:
            await server.stop(None)

    asyncio.run(scenario(FakeState()))


def test_import_loads_neither_torch_nor_ray():
    code = (
        "import sys, vericache.client; "
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'ray')); "
        "assert not loaded, loaded"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
