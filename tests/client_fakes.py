"""The in-process fake server the client SDK tests run against, and the harness that drives both
clients through one suite.

The fake servicer keeps prefixes in a dict and counts calls; it exists to test the SDK. Each test
runs against the blocking `Client` (on `grpc.server`) and the `AsyncClient` (on `grpc.aio.server`,
driven from the test thread through `BlockingAsyncClient`), so both clients pass the same suite.
A test module wires the harness into fixtures of its own:

    @pytest.fixture(scope="module")
    def servers():
        yield from serve_fakes()

    @pytest.fixture(params=["sync", "async"])
    def fake(request, servers):
        yield from fake_session(servers, request.param)
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc

from vericache.client import AsyncClient, Client
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
        num_tokens = min(_max_tokens(request), MAX_FAKE_TOKENS)
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


def _max_tokens(request) -> int:
    """The request's max_tokens, or the real server's default where it leaves it unset."""
    return request.max_tokens if request.HasField("max_tokens") else 256


def _stats(request, num_tokens: int) -> vericache_pb2.GenerateStats:
    accepted = [min(2, num_tokens - start) for start in range(0, num_tokens, 2)]
    return vericache_pb2.GenerateStats(
        finish_reason="length" if _max_tokens(request) <= MAX_FAKE_TOKENS else "stop",
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


def serve_fakes() -> Iterator[Servers]:
    """Both fake servers, the blocking one and the asyncio one on its loop thread, for one test
    module: its `servers` fixture yields from this."""
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


def fake_session(servers: Servers, kind: str) -> Iterator[Fake]:
    """A fresh FakeState on both servers and a Fake of `kind` over them; closes the clients the
    test connected. A test module's `fake` fixture yields from this."""
    state = FakeState()
    servers.servicer.state = servers.aio_servicer.state = state
    fake = Fake(state, kind, servers)
    yield fake
    for client in fake.clients:
        client.close()
