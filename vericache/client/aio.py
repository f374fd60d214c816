"""The asyncio client of the vericache.v1 API: `Client`'s methods as coroutines.

Create an `AsyncClient` inside the event loop that uses it (gRPC's asyncio channel belongs to one
loop). The retry rules, timeouts and errors are those of the blocking `Client`.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Sequence
from typing import Any, Unpack

import grpc

from vericache.client.channel import channel_settings
from vericache.client.errors import RequestCancelledError, VeriCacheError, error_from_rpc
from vericache.client.protocol import (
    GenerateAccumulator,
    check_prefix_id,
    generate_call,
    prefix_id_from_progress,
    put_prefix_request,
)
from vericache.client.retry import Deadline, RetryPolicy, check_timeout
from vericache.client.types import GenerateOptions, PrefixInfo, Progress, Result
from vericache.v1 import vericache_pb2, vericache_pb2_grpc


class _AsyncMessageStream:
    """The messages of one server-streaming RPC, restarted on UNAVAILABLE until one arrives."""

    def __init__(self, start: Callable[..., Any], retry: RetryPolicy, deadline: Deadline):
        self._start = start  # (timeout=seconds) -> a new call
        self._retry = retry
        self._deadline = deadline
        self._call = None
        self._num_failed = 0
        self._has_received = False
        self._is_done = False

    async def next(self):
        """The next message, or None once the stream has ended."""
        while not self._is_done:
            if self._call is None:
                self._call = self._start(timeout=self._deadline.remaining())
            try:
                message = await self._call.read()
            except grpc.RpcError as exc:
                self._call = None
                await self._wait_or_raise(exc)
                continue
            if message is grpc.aio.EOF:
                self._is_done = True
                return None
            self._has_received = True
            return message
        return None

    async def _wait_or_raise(self, exc: grpc.RpcError) -> None:
        self._num_failed += 1
        delay = None
        if not self._has_received:  # a retry after a message would repeat output
            delay = self._retry.delay_before_retry(exc, self._num_failed, self._deadline)
        if delay is None:
            self._is_done = True
            raise error_from_rpc(exc) from None
        await asyncio.sleep(delay)

    def cancel(self) -> None:
        self._is_done = True
        if self._call is not None:
            self._call.cancel()


class AsyncStream:
    """The text deltas of one generation, as an async iterator; see `Stream`.

    `await stream.result()` returns the `Result` with the statistics; `await stream.aclose()` or
    leaving an `async with` block cancels the RPC.
    """

    def __init__(self, messages: _AsyncMessageStream):
        self._messages = messages
        self._accumulator = GenerateAccumulator()
        self._result: Result | None = None
        self._error: VeriCacheError | None = None
        self._is_closed = False

    def __aiter__(self) -> AsyncStream:
        return self

    async def __anext__(self) -> str:
        if self._is_over():
            raise StopAsyncIteration
        try:
            while (message := await self._messages.next()) is not None:
                delta = self._accumulator.add(message)
                if delta:
                    return delta
            self._result = self._accumulator.finish()
        except VeriCacheError as exc:
            self._error = exc
            raise
        raise StopAsyncIteration

    async def result(self) -> Result:
        """Reads to the end; raises the stream's error, or RequestCancelledError if closed."""
        async for _ in self:
            pass
        if self._error is not None:
            raise self._error
        if self._result is None:
            raise RequestCancelledError(
                "the stream was closed before its end", grpc.StatusCode.CANCELLED
            )
        return self._result

    async def aclose(self) -> None:
        """Cancels the RPC unless it has ended; the loop over this stream then stops."""
        if not self._is_over():
            self._messages.cancel()
        self._is_closed = True

    def _is_over(self) -> bool:
        return self._is_closed or self._result is not None or self._error is not None

    async def __aenter__(self) -> AsyncStream:
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.aclose()


class AsyncClient:
    """An asyncio connection to a VeriCache server; arguments and rules as in `Client`."""

    def __init__(
        self,
        target: str,
        *,
        timeout: float | None = None,
        retries: int = 3,
        backoff_s: float = 0.2,
        api_key: str | None = None,
        tls: bool = False,
        root_certificates: bytes | None = None,
    ):
        self.target = target
        self.timeout = check_timeout(timeout)
        self._retry = RetryPolicy(retries, backoff_s)
        settings = channel_settings(api_key, tls, root_certificates)
        self._metadata = settings.metadata
        if settings.credentials is None:
            self._channel = grpc.aio.insecure_channel(target)
        else:
            self._channel = grpc.aio.secure_channel(target, settings.credentials)
        self._stub = vericache_pb2_grpc.VeriCacheStub(self._channel)

    async def put_prefix(
        self,
        text: str | None = None,
        *,
        token_ids: Sequence[int] | None = None,
        compressor: str = "snapkv",
        ratio: float | None = None,
        bits: int | None = None,
        dtype: str | None = None,
        on_progress: Callable[[Progress], None] | None = None,
        timeout: float | None = None,
    ) -> str:
        """Registers a prefix and returns its id; see `Client.put_prefix`."""
        request = put_prefix_request(text, token_ids, compressor, ratio, bits, dtype)
        messages = self._messages(self._stub.PutPrefix, request, timeout)
        last = None
        try:
            while (message := await messages.next()) is not None:
                last = message
                if on_progress is not None:
                    on_progress(Progress.from_proto(message))
        finally:
            messages.cancel()  # a no-op unless on_progress raised
        return prefix_id_from_progress(last)

    async def get_prefix(self, prefix_id: str, *, timeout: float | None = None) -> PrefixInfo:
        request = vericache_pb2.GetPrefixRequest(prefix_id=check_prefix_id(prefix_id))
        return PrefixInfo.from_proto(await self._unary(self._stub.GetPrefix, request, timeout))

    async def list_prefixes(self, *, timeout: float | None = None) -> list[PrefixInfo]:
        request = vericache_pb2.ListPrefixesRequest()
        response = await self._unary(self._stub.ListPrefixes, request, timeout)
        return [PrefixInfo.from_proto(info) for info in response.prefixes]

    async def delete_prefix(self, prefix_id: str, *, timeout: float | None = None) -> bool:
        """True if the prefix was deleted, False if there was none (or a retry found it gone)."""
        request = vericache_pb2.DeletePrefixRequest(prefix_id=check_prefix_id(prefix_id))
        return (await self._unary(self._stub.DeletePrefix, request, timeout)).deleted

    async def generate(self, prompt: str, **options: Unpack[GenerateOptions]) -> Result:
        """Generates a reply to `prompt`; see `Client.generate`."""
        async with self.stream(prompt, **options) as stream:
            return await stream.result()

    def stream(self, prompt: str, **options: Unpack[GenerateOptions]) -> AsyncStream:
        """As `generate`, but an `AsyncStream` of text deltas (not a coroutine: `async for` it)."""
        request, timeout = generate_call(prompt, options)
        return AsyncStream(self._messages(self._stub.Generate, request, timeout))

    async def close(self) -> None:
        """Closes the channel; RPCs still running are cancelled."""
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.close()

    def _deadline(self, timeout: float | None) -> Deadline:
        return Deadline(self.timeout if timeout is None else check_timeout(timeout))

    def _messages(self, method: Callable, request, timeout: float | None) -> _AsyncMessageStream:
        start = functools.partial(method, request, metadata=self._metadata)
        return _AsyncMessageStream(start, self._retry, self._deadline(timeout))

    async def _unary(self, method: Callable, request, timeout: float | None):
        deadline = self._deadline(timeout)
        num_failed = 0
        while True:
            try:
                return await method(request, timeout=deadline.remaining(), metadata=self._metadata)
            except grpc.RpcError as exc:
                num_failed += 1
                delay = self._retry.delay_before_retry(exc, num_failed, deadline)
                if delay is None:
                    raise error_from_rpc(exc) from None
                await asyncio.sleep(delay)
