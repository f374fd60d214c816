"""The client SDK against an in-process fake server: every method of both clients, the status code
to exception mapping, retries, timeouts, cancellation, and an import that loads no torch.

The fake servicer keeps prefixes in a dict and counts calls; it exists to test the SDK. Each test
runs against the blocking `Client` (on `grpc.server`) and the `AsyncClient` (on `grpc.aio.server`,
driven from the test thread through `BlockingAsyncClient`), so both clients pass the same suite.
"""

from __future__ import annotations

import asyncio
import hashlib
import socket
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
import pytest

from vericache.client import (
    AsyncClient,
    Client,
    Compressor,
    DeadlineExceededError,
    InvalidRequestError,
    PrefixInfo,
    PrefixNotFoundError,
    RequestCancelledError,
    ServerBusyError,
    ServerError,
    ServerUnavailableError,
)
from vericache.v1 import vericache_pb2, vericache_pb2_grpc

Code = grpc.StatusCode
STAGES = ["queued", "prefill", "compress", "store", "done"]
FOREVER = "talk forever"  # the fake streams this prompt's reply until the call ends
MAX_FAKE_TOKENS = 6  # the fake's replies stop ("stop") after this many tokens
REQUIRED_STATS = {
    "rounds", "mean_accepted_per_round", "accepted_per_round", "link_bytes", "store_bytes",
    "link_wait_s", "store_wait_s", "ttft_s", "tokens_per_s", "total_s", "num_tokens",
}  # fmt: skip


class Abort(Exception):
    """Raised or streamed by FakeState: the servicer ends the call with this status."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code, self.details = code, details


@dataclass
class FakeState:
    """What the fake server holds and counts; a fresh one for each test."""

    prefixes: dict[str, vericache_pb2.PrefixInfo] = field(default_factory=dict)
    calls: Counter = field(default_factory=Counter)
    requests: dict[str, list] = field(default_factory=lambda: defaultdict(list))
    # method -> statuses to fail its next calls with, before any message
    failures: dict[str, list[tuple[grpc.StatusCode, str]]] = field(
        default_factory=lambda: defaultdict(list)
    )
    fail_after_first_chunk: tuple[grpc.StatusCode, str] | None = None
    omit_stats: bool = False
    cancelled: threading.Event = field(default_factory=threading.Event)

    def answer(self, method: str, request):
        """The reply (a list of messages, or an iterator, for streams); raises Abort."""
        self.calls[method] += 1
        self.requests[method].append(request)
        if self.failures[method]:
            raise Abort(*self.failures[method].pop(0))
        return getattr(self, method)(request)

    def PutPrefix(self, request):  # noqa: N802 - the RPC's name
        content = request.text if request.HasField("text") else list(request.token_ids.ids)
        key = repr((content, request.compressor.SerializeToString(deterministic=True)))
        prefix_id = "p" + hashlib.sha256(key.encode()).hexdigest()[:12]
        num_tokens = len(content.split()) if isinstance(content, str) else len(content)
        if prefix_id in self.prefixes:
            done = dict(stage="done", num_tokens=num_tokens, done=True, existed=True)
            return [vericache_pb2.PutPrefixProgress(prefix_id=prefix_id, **done)]
        self.prefixes[prefix_id] = vericache_pb2.PrefixInfo(
            prefix_id=prefix_id, num_tokens=num_tokens, compressor=request.compressor,
            full_kv_bytes=1000 * num_tokens, compressed_kv_bytes=100 * num_tokens,
        )  # fmt: skip
        return [
            vericache_pb2.PutPrefixProgress(
                prefix_id=prefix_id, stage=stage, num_tokens=num_tokens, done=stage == "done"
            )
            for stage in STAGES
        ]

    def GetPrefix(self, request):  # noqa: N802
        if request.prefix_id not in self.prefixes:
            raise Abort(Code.NOT_FOUND, f"no prefix {request.prefix_id}: register it first")
        return self.prefixes[request.prefix_id]

    def ListPrefixes(self, request):  # noqa: N802
        return vericache_pb2.ListPrefixesResponse(prefixes=self.prefixes.values())

    def DeletePrefix(self, request):  # noqa: N802
        return vericache_pb2.DeletePrefixResponse(
            deleted=self.prefixes.pop(request.prefix_id, None) is not None
        )

    def Generate(self, request):  # noqa: N802
        if request.prefix_id and request.prefix_id not in self.prefixes:
            raise Abort(Code.NOT_FOUND, f"no prefix {request.prefix_id}: register it first")
        if request.prompt == FOREVER:
            chunk = vericache_pb2.TokenChunk(text=" again", token_ids=[7])
            return (vericache_pb2.GenerateResponse(chunk=chunk) for _ in range(2000))
        num_tokens = min(request.max_tokens, MAX_FAKE_TOKENS)
        replies = []
        for start in range(0, num_tokens, 2):  # two accepted tokens per round
            ids = list(range(100 + start, 100 + min(start + 2, num_tokens)))
            text = "".join(f" w{i - 100}" for i in ids)
            replies.append(vericache_pb2.GenerateResponse(chunk={"text": text, "token_ids": ids}))
        if self.fail_after_first_chunk:
            return [replies[0], Abort(*self.fail_after_first_chunk)]
        if not self.omit_stats:
            replies.append(vericache_pb2.GenerateResponse(stats=_stats(request, num_tokens)))
        return replies


def _stats(request, num_tokens: int) -> vericache_pb2.GenerateStats:
    accepted = [min(2, num_tokens - start) for start in range(0, num_tokens, 2)]
    return vericache_pb2.GenerateStats(
        finish_reason="length" if request.max_tokens <= MAX_FAKE_TOKENS else "stop",
        num_tokens=num_tokens, rounds=len(accepted), accepted_per_round=accepted,
        mean_accepted_per_round=num_tokens / len(accepted), link_bytes=4096, store_bytes=8192,
        link_wait_s=0.01, store_wait_s=0.02, ttft_s=0.03, tokens_per_s=100.0, total_s=0.06,
    )  # fmt: skip


class FakeServicer(vericache_pb2_grpc.VeriCacheServicer):
    """The blocking servicer over FakeState."""

    def __init__(self):
        self.state = FakeState()

    def _unary(self, method, request, context):
        try:
            return self.state.answer(method, request)
        except Abort as abort:
            context.abort(abort.code, abort.details)

    def _stream(self, method, request, context):
        is_endless = getattr(request, "prompt", None) == FOREVER
        if is_endless:  # never ends by itself: an end is a cancel
            context.add_callback(self.state.cancelled.set)
        try:
            for reply in self.state.answer(method, request):
                if isinstance(reply, Abort):
                    raise reply
                yield reply
                time.sleep(0.01 if is_endless else 0)
        except Abort as abort:
            context.abort(abort.code, abort.details)

    def PutPrefix(self, request, context):  # noqa: N802
        return self._stream("PutPrefix", request, context)

    def Generate(self, request, context):  # noqa: N802
        return self._stream("Generate", request, context)

    def GetPrefix(self, request, context):  # noqa: N802
        return self._unary("GetPrefix", request, context)

    def ListPrefixes(self, request, context):  # noqa: N802
        return self._unary("ListPrefixes", request, context)

    def DeletePrefix(self, request, context):  # noqa: N802
        return self._unary("DeletePrefix", request, context)


class AsyncFakeServicer(FakeServicer):
    """The asyncio servicer over FakeState."""

    async def _unary(self, method, request, context):
        try:
            return self.state.answer(method, request)
        except Abort as abort:
            await context.abort(abort.code, abort.details)

    async def _stream(self, method, request, context):
        is_endless = getattr(request, "prompt", None) == FOREVER
        if is_endless:
            context.add_done_callback(lambda _: self.state.cancelled.set())
        try:
            for reply in self.state.answer(method, request):
                if isinstance(reply, Abort):
                    raise reply
                yield reply
                await asyncio.sleep(0.01 if is_endless else 0)
        except Abort as abort:
            await context.abort(abort.code, abort.details)

    # gRPC's asyncio server tells handler kinds apart by their definition: each is written out.
    async def PutPrefix(self, request, context):  # noqa: N802
        async for reply in self._stream("PutPrefix", request, context):
            yield reply

    async def Generate(self, request, context):  # noqa: N802
        async for reply in self._stream("Generate", request, context):
            yield reply

    async def GetPrefix(self, request, context):  # noqa: N802
        return await self._unary("GetPrefix", request, context)

    async def ListPrefixes(self, request, context):  # noqa: N802
        return await self._unary("ListPrefixes", request, context)

    async def DeletePrefix(self, request, context):  # noqa: N802
        return await self._unary("DeletePrefix", request, context)


class LoopThread:
    """An event loop in a thread of its own, for the aio server and the async clients."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coroutine, timeout: float = 10):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


class BlockingAsyncClient:
    """Runs an AsyncClient's coroutines on the loop thread, so the suite drives both clients."""

    def __init__(self, loop: LoopThread, target: str, **kwargs):
        async def connect():
            return AsyncClient(target, **kwargs)

        self.loop = loop
        self.client = loop.run(connect())

    def __getattr__(self, name):
        method = getattr(self.client, name)
        return lambda *args, **kwargs: self.loop.run(method(*args, **kwargs))

    def stream(self, *args, **kwargs) -> BlockingAsyncStream:
        return BlockingAsyncStream(self.loop, self.client.stream(*args, **kwargs))


class BlockingAsyncStream:
    def __init__(self, loop: LoopThread, stream):
        self.loop, self.stream = loop, stream

    def __iter__(self):
        return self

    def __next__(self) -> str:
        try:
            return self.loop.run(self.stream.__anext__())
        except StopAsyncIteration:
            raise StopIteration from None

    def result(self):
        return self.loop.run(self.stream.result())

    def close(self) -> None:
        self.loop.run(self.stream.aclose())

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


async def start_aio_server(servicer) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server()
    vericache_pb2_grpc.add_VeriCacheServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


@dataclass
class Servers:
    servicer: FakeServicer
    port: int
    aio_servicer: AsyncFakeServicer
    aio_port: int
    loop: LoopThread


@pytest.fixture(scope="module")
def servers():
    servicer = FakeServicer()
    server = grpc.server(ThreadPoolExecutor(max_workers=4))
    vericache_pb2_grpc.add_VeriCacheServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    loop, aio_servicer = LoopThread(), AsyncFakeServicer()
    aio_server, aio_port = loop.run(start_aio_server(aio_servicer))
    yield Servers(servicer, port, aio_servicer, aio_port, loop)
    server.stop(None)
    loop.run(aio_server.stop(None))
    loop.stop()


@dataclass
class Fake:
    state: FakeState
    kind: str  # "sync" or "async"
    servers: Servers
    clients: list = field(default_factory=list)

    def connect(self, target: str | None = None, **kwargs):
        """A client of this test's kind; fast retries unless the test says otherwise."""
        kwargs.setdefault("backoff_s", 0.01)
        if self.kind == "sync":
            client = Client(target or f"127.0.0.1:{self.servers.port}", **kwargs)
        else:
            target = target or f"127.0.0.1:{self.servers.aio_port}"
            client = BlockingAsyncClient(self.servers.loop, target, **kwargs)
        self.clients.append(client)
        return client


@pytest.fixture(params=["sync", "async"])
def fake(request, servers):
    state = FakeState()
    servers.servicer.state = servers.aio_servicer.state = state
    fake = Fake(state, request.param, servers)
    yield fake
    for client in fake.clients:
        client.close()


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
    assert request.mode == vericache_pb2.VERICACHE and request.max_tokens == 256
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


# --- errors -------------------------------------------------------------------------------------

LOCAL_ERRORS = {
    "no-content": (lambda c: c.put_prefix(), "exactly one of text= and token_ids="),
    "two-contents": (lambda c: c.put_prefix("x", token_ids=[1]), "exactly one of"),
    "bad-token": (lambda c: c.put_prefix(token_ids=[1, -1]), "token_ids"),
    "bad-ratio": (lambda c: c.put_prefix("x", ratio=0), "ratio must be > 0"),
    "bad-mode": (lambda c: c.generate("x", mode="greedy"), "full_local, full_remote, lossy"),
    "bad-max-tokens": (lambda c: c.generate("x", max_tokens=0), "max_tokens"),
    "bad-draft-len": (lambda c: c.stream("x", draft_len=0), "draft_len"),
    "empty-prefix-id": (lambda c: c.get_prefix(""), "prefix_id"),
    "bad-timeout": (lambda c: c.list_prefixes(timeout=-1), "timeout"),
}  # fmt: skip


@pytest.mark.parametrize("call, message", LOCAL_ERRORS.values(), ids=LOCAL_ERRORS)
def test_bad_arguments_fail_before_any_rpc(fake, call, message):
    client = fake.connect()
    with pytest.raises(InvalidRequestError, match=message):
        call(client)
    assert sum(fake.state.calls.values()) == 0


def test_bad_client_settings(fake):
    with pytest.raises(InvalidRequestError, match="retries"):
        fake.connect(retries=-1)
    with pytest.raises(InvalidRequestError, match="timeout"):
        fake.connect(timeout=0)


STATUS_ERRORS = [
    (Code.INVALID_ARGUMENT, InvalidRequestError),
    (Code.NOT_FOUND, PrefixNotFoundError),
    (Code.RESOURCE_EXHAUSTED, ServerBusyError),
    (Code.UNAVAILABLE, ServerUnavailableError),
    (Code.DEADLINE_EXCEEDED, DeadlineExceededError),
    (Code.CANCELLED, RequestCancelledError),
    (Code.INTERNAL, ServerError),
]


@pytest.mark.parametrize("code, error_type", STATUS_ERRORS, ids=[c.name for c, _ in STATUS_ERRORS])
@pytest.mark.parametrize("method", ["ListPrefixes", "Generate"])
def test_each_status_code_raises_its_type_with_the_server_detail(fake, method, code, error_type):
    client = fake.connect(retries=0)
    fake.state.failures[method].append((code, f"the server says {code.name}"))
    with pytest.raises(error_type) as raised:
        client.list_prefixes() if method == "ListPrefixes" else client.generate("hi")
    assert type(raised.value) is error_type
    assert str(raised.value) == f"the server says {code.name}"
    if isinstance(raised.value, ServerError):
        assert raised.value.code is code


def test_a_stream_without_final_stats_is_a_server_error(fake):
    fake.state.omit_stats = True
    with pytest.raises(ServerError, match="without its final statistics") as raised:
        fake.connect().generate("hi")
    assert raised.value.code is Code.INTERNAL


# --- retries and timeouts -----------------------------------------------------------------------


@pytest.mark.parametrize("method", ["ListPrefixes", "Generate", "PutPrefix"])
def test_unavailable_is_retried_until_it_succeeds(fake, method):
    client = fake.connect(retries=3)
    fake.state.failures[method] = [(Code.UNAVAILABLE, "no worker yet")] * 3
    {
        "ListPrefixes": client.list_prefixes,
        "Generate": lambda: client.generate("hi"),
        "PutPrefix": lambda: client.put_prefix("manual"),
    }[method]()
    assert fake.state.calls[method] == 4


def test_retries_give_up_after_the_limit(fake):
    client = fake.connect(retries=2)
    fake.state.failures["GetPrefix"] = [(Code.UNAVAILABLE, "no worker: start one")] * 5
    with pytest.raises(ServerUnavailableError, match="^no worker: start one$"):
        client.get_prefix("p1")
    assert fake.state.calls["GetPrefix"] == 3


@pytest.mark.parametrize("code", [Code.RESOURCE_EXHAUSTED, Code.INTERNAL])
def test_other_codes_are_not_retried(fake, code):
    client = fake.connect(retries=3)
    fake.state.failures["GetPrefix"] = [(code, "no")] * 5
    with pytest.raises(ServerError):
        client.get_prefix("p1")
    assert fake.state.calls["GetPrefix"] == 1


def test_a_stream_is_not_retried_after_it_delivered_output(fake):
    client = fake.connect(retries=3)
    fake.state.fail_after_first_chunk = (Code.UNAVAILABLE, "the verifier went away")
    stream = client.stream("hi")
    assert next(stream) == " w0 w1"
    with pytest.raises(ServerUnavailableError, match="the verifier went away"):
        next(stream)
    with pytest.raises(ServerUnavailableError):
        stream.result()
    assert list(stream) == [] and fake.state.calls["Generate"] == 1


def test_an_unreachable_server_is_unavailable_after_retries(fake):
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        target = f"127.0.0.1:{probe.getsockname()[1]}"
    with pytest.raises(ServerUnavailableError):
        fake.connect(target, retries=1, timeout=5).list_prefixes()


def test_timeouts_raise_deadline_exceeded(fake):
    with pytest.raises(DeadlineExceededError):
        fake.connect(timeout=0.2).generate(FOREVER)
    start = time.monotonic()
    with pytest.raises(DeadlineExceededError):
        fake.connect(timeout=30).generate(FOREVER, timeout=0.2)  # the call's own overrides
    assert time.monotonic() - start < 5


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
