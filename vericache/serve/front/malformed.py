"""Requests whose bytes are no message of their method: undecodable protobuf, or a string field
that is not UTF-8.

gRPC decodes a request before any handler runs, and a decoding error there answers UNKNOWN with
the exception's class in the detail, before the API key is looked at. `TolerantDecoding` (a server
interceptor) makes the decoding of one service's requests never fail: bytes that do not decode
become a `MalformedRequest`, which the handler refuses (`check_decoded`) where it refuses every
other bad request, after the caller's key: INVALID_ARGUMENT with a request id, logged and counted
like any refusal.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc

from vericache.errors import InvalidRequestError

# How to rebuild a method handler of each kind, with another request deserializer.
_HANDLER_KINDS = {
    "unary_unary": grpc.unary_unary_rpc_method_handler,
    "unary_stream": grpc.unary_stream_rpc_method_handler,
    "stream_unary": grpc.stream_unary_rpc_method_handler,
    "stream_stream": grpc.stream_stream_rpc_method_handler,
}


@dataclass(frozen=True)
class MalformedRequest:
    """What a request that did not decode is handed to its handler as."""


def check_decoded(request: Any, method: str) -> None:
    """Raises InvalidRequestError if `request` did not decode."""
    if isinstance(request, MalformedRequest):
        raise InvalidRequestError(
            f"the request is not a valid {method} message: it is not protobuf, or a string field "
            "is not UTF-8"
        )


def tolerant(deserialize: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    """`deserialize`, except that bytes it cannot decode become a MalformedRequest."""

    def deserialize_or_mark(raw: bytes) -> Any:
        try:
            return deserialize(raw)
        except Exception:  # noqa: BLE001 - whatever the bytes are, the handler refuses them
            return MalformedRequest()

    return deserialize_or_mark


class TolerantDecoding(grpc.aio.ServerInterceptor):
    """Decodes the requests of `service` ("package.Service") with `tolerant` deserializers; other
    services' (health, reflection) are left as they are."""

    def __init__(self, service: str):
        self._prefix = f"/{service}/"
        self._handlers: dict[str, grpc.RpcMethodHandler] = {}  # method -> its tolerant handler

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = handler_call_details.method
        if not method.startswith(self._prefix):
            return await continuation(handler_call_details)
        if method not in self._handlers:
            handler = await continuation(handler_call_details)
            if handler is None or handler.request_deserializer is None:
                return handler  # an unknown method: gRPC answers UNIMPLEMENTED
            self._handlers[method] = _with_tolerant_decoding(handler)
        return self._handlers[method]


def _with_tolerant_decoding(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    for kind, rebuild in _HANDLER_KINDS.items():
        behavior = getattr(handler, kind)
        if behavior is not None:
            return rebuild(
                behavior,
                request_deserializer=tolerant(handler.request_deserializer),
                response_serializer=handler.response_serializer,
            )
    return handler
