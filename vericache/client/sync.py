"""The blocking client of the vericache.v1 API. See `vericache.client` for an example."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator, Sequence
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


class _MessageStream:
    """The messages of one server-streaming RPC, restarted on UNAVAILABLE until one arrives."""

    def __init__(self, start: Callable[..., Iterator], retry: RetryPolicy, deadline: Deadline):
        self._start = start  # (timeout=seconds) -> a new call
        self._retry = retry
        self._deadline = deadline
        self._call = None
        self._num_failed = 0
        self._has_received = False
        self._is_done = False

    def __iter__(self) -> _MessageStream:
        return self

    def __next__(self):
        while not self._is_done:
            if self._call is None:
                self._call = self._start(timeout=self._deadline.remaining())
            try:
                message = next(self._call)
            except StopIteration:
                self._is_done = True
                raise
            except grpc.RpcError as exc:
                self._call = None
                self._wait_or_raise(exc)
                continue
            self._has_received = True
            return message
        raise StopIteration

    def _wait_or_raise(self, exc: grpc.RpcError) -> None:
        self._num_failed += 1
        delay = None
        if not self._has_received:  # a retry after a message would repeat output
            delay = self._retry.delay_before_retry(exc, self._num_failed, self._deadline)
        if delay is None:
            self._is_done = True
            raise error_from_rpc(exc) from None
        time.sleep(delay)

    def cancel(self) -> None:
        self._is_done = True
        if self._call is not None:
            self._call.cancel()


class Stream:
    """The text deltas of one generation, yielded as the server accepts tokens.

    Iterate it for the deltas; `result()` then returns the `Result` (full text, token ids, finish
    reason and statistics), reading first whatever the loop left. `close()`, leaving a `with`
    block, or dropping the stream (as breaking out of `for delta in client.stream(...)` does)
    cancels the RPC and the server stops generating.
    """

    def __init__(self, messages: _MessageStream):
        self._messages = messages
        self._accumulator = GenerateAccumulator()
        self._result: Result | None = None
        self._error: VeriCacheError | None = None
        self._is_closed = False

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> str:
        if self._is_over():
            raise StopIteration
        try:
            for message in self._messages:
                delta = self._accumulator.add(message)
                if delta:
                    return delta
            self._result = self._accumulator.finish()
        except VeriCacheError as exc:
            self._error = exc
            raise
        raise StopIteration

    def result(self) -> Result:
        """Reads to the end; raises the stream's error, or RequestCancelledError if closed."""
        for _ in self:
            pass
        if self._error is not None:
            raise self._error
        if self._result is None:
            raise RequestCancelledError(
                "the stream was closed before its end", grpc.StatusCode.CANCELLED
            )
        return self._result

    def close(self) -> None:
        """Cancels the RPC unless it has ended; the loop over this stream then stops."""
        if not self._is_over():
            self._messages.cancel()
        self._is_closed = True

    def _is_over(self) -> bool:
        return self._is_closed or self._result is not None or self._error is not None

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def __del__(self):
        if hasattr(self, "_is_closed"):  # __init__ ran
            self.close()


class Client:
    """A blocking connection to a VeriCache server.

    `timeout` bounds each method call, retries included (None: no bound; a method's own
    `timeout=` overrides it). UNAVAILABLE is retried `retries` times, waiting `backoff_s`, then
    twice as long each time, for calls that cannot repeat output: lookups, deletes, and streams
    before their first message. Every failure raises a `vericache.client.errors` type.

    `api_key` (None: $VERICACHE_API_KEY) is sent with every call. `tls=True` connects over TLS
    trusting the system's CAs; `root_certificates` (PEM bytes of the CA that signed the server's
    certificate) implies TLS and trusts those instead.
    """

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
            self._channel = grpc.insecure_channel(target)
        else:
            self._channel = grpc.secure_channel(target, settings.credentials)
        self._stub = vericache_pb2_grpc.VeriCacheStub(self._channel)

    def put_prefix(
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
        """Registers a prefix (exactly one of `text` and `token_ids`) and returns its id.

        Idempotent: the same content and compressor give the same id. `dtype` ("bfloat16" or
        "float16") keeps a token-dropping compressor's tokens in 16 bits (half the bytes to
        stream and hold). `on_progress` is called with each `Progress` the server reports
        ("queued", "prefill", ..., "done").
        """
        request = put_prefix_request(text, token_ids, compressor, ratio, bits, dtype)
        messages = self._messages(self._stub.PutPrefix, request, timeout)
        last = None
        try:
            for last in messages:
                if on_progress is not None:
                    on_progress(Progress.from_proto(last))
        finally:
            messages.cancel()  # a no-op unless on_progress raised
        return prefix_id_from_progress(last)

    def get_prefix(self, prefix_id: str, *, timeout: float | None = None) -> PrefixInfo:
        request = vericache_pb2.GetPrefixRequest(prefix_id=check_prefix_id(prefix_id))
        return PrefixInfo.from_proto(self._unary(self._stub.GetPrefix, request, timeout))

    def list_prefixes(self, *, timeout: float | None = None) -> list[PrefixInfo]:
        request = vericache_pb2.ListPrefixesRequest()
        response = self._unary(self._stub.ListPrefixes, request, timeout)
        return [PrefixInfo.from_proto(info) for info in response.prefixes]

    def delete_prefix(self, prefix_id: str, *, timeout: float | None = None) -> bool:
        """True if the prefix was deleted, False if there was none (or a retry found it gone)."""
        request = vericache_pb2.DeletePrefixRequest(prefix_id=check_prefix_id(prefix_id))
        return self._unary(self._stub.DeletePrefix, request, timeout).deleted

    def generate(self, prompt: str, **options: Unpack[GenerateOptions]) -> Result:
        """Generates a reply to `prompt`; `options` (`GenerateOptions`): the prefix, the mode,
        the budget, stops, the prefix's compressor, the timeout and the sampling keywords."""
        with self.stream(prompt, **options) as stream:
            return stream.result()

    def stream(self, prompt: str, **options: Unpack[GenerateOptions]) -> Stream:
        """As `generate`, but returns a `Stream` of text deltas; its `result()` has the stats."""
        request, timeout = generate_call(prompt, options)
        return Stream(self._messages(self._stub.Generate, request, timeout))

    def close(self) -> None:
        """Closes the channel; RPCs still running are cancelled."""
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def _deadline(self, timeout: float | None) -> Deadline:
        return Deadline(self.timeout if timeout is None else check_timeout(timeout))

    def _messages(self, method: Callable, request, timeout: float | None) -> _MessageStream:
        start = functools.partial(method, request, metadata=self._metadata)
        return _MessageStream(start, self._retry, self._deadline(timeout))

    def _unary(self, method: Callable, request, timeout: float | None):
        deadline = self._deadline(timeout)
        num_failed = 0
        while True:
            try:
                return method(request, timeout=deadline.remaining(), metadata=self._metadata)
            except grpc.RpcError as exc:
                num_failed += 1
                delay = self._retry.delay_before_retry(exc, num_failed, deadline)
                if delay is None:
                    raise error_from_rpc(exc) from None
                time.sleep(delay)
