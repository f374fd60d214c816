"""The typed exceptions of the client SDK, and the one place gRPC status codes are mapped to them.

Every failed RPC becomes one of these; its message is the server's one-line detail. Bad parameters
raise `InvalidRequestError` and unknown prefixes `PrefixNotFoundError`, the same types the engine
raises in-process, so code written against either catches the same errors.
"""

from __future__ import annotations

import grpc

from vericache.errors import InvalidRequestError, PrefixNotFoundError, VeriCacheError

__all__ = [
    "AuthenticationError",
    "DataLossError",
    "DeadlineExceededError",
    "InvalidRequestError",
    "PrefixNotFoundError",
    "RequestCancelledError",
    "ServerBusyError",
    "ServerError",
    "ServerUnavailableError",
    "error_from_rpc",
]


class ServerError(VeriCacheError):
    """A failed RPC; `code` is its gRPC status. Raised as is for codes with no narrower type."""

    def __init__(self, message: str, code: grpc.StatusCode = grpc.StatusCode.UNKNOWN):
        super().__init__(message)
        self.code = code


class AuthenticationError(ServerError):
    """No API key, or one the server does not know (UNAUTHENTICATED): pass `api_key=` or set
    $VERICACHE_API_KEY."""


class ServerBusyError(ServerError):
    """The server's queue is full, or the call goes past the API key's limits
    (RESOURCE_EXHAUSTED): try again later, lower the load, or ask for less."""


class ServerUnavailableError(ServerError):
    """No server or no worker answered (UNAVAILABLE), also after the client's retries."""


class DeadlineExceededError(ServerError):
    """The call ran past its timeout (DEADLINE_EXCEEDED)."""


class DataLossError(ServerError):
    """The server's stored copy of the prefix was damaged beyond rebuilding (DATA_LOSS): register
    it again."""


class RequestCancelledError(ServerError):
    """The call was cancelled (CANCELLED), by the server or by closing its stream early."""


_SERVER_ERRORS: dict[grpc.StatusCode, type[ServerError]] = {
    grpc.StatusCode.UNAUTHENTICATED: AuthenticationError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ServerBusyError,
    grpc.StatusCode.UNAVAILABLE: ServerUnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    grpc.StatusCode.CANCELLED: RequestCancelledError,
    grpc.StatusCode.DATA_LOSS: DataLossError,
}


def error_from_rpc(exc: grpc.RpcError) -> VeriCacheError:
    """The typed exception for a failed call (sync or asyncio), with the server's detail."""
    code = exc.code()
    message = (exc.details() or "").strip() or f"the server answered {code.name} with no detail"
    if code is grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidRequestError(message)
    if code is grpc.StatusCode.NOT_FOUND:
        return PrefixNotFoundError(message)
    return _SERVER_ERRORS.get(code, ServerError)(message, code)
