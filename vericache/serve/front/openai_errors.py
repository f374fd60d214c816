"""The HTTP API's errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, from
whatever refused the request: a typed error, a body that is not JSON (or not UTF-8), one that does
not fit the schema, or the framework's own refusals (no such route or method).

Every error's message ends with the request id, which the server's log line of the refusal carries
too, with the caller's tenant; anything unexpected is a 500 that says no more than that it failed.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from vericache.errors import (
    DataLossError,
    DeadlineExceededError,
    InvalidRequestError,
    PrefixNotFoundError,
    QueueFullError,
    UnsupportedModelError,
    VeriCacheError,
    WorkerUnavailableError,
)
from vericache.serve.front.auth import Tenant, UnauthenticatedError

log = logging.getLogger(__name__)

# A typed error's HTTP status and OpenAI error type, in the order they are matched.
_ERRORS: list[tuple[type[Exception], int, str]] = [
    (UnauthenticatedError, 401, "authentication_error"),
    (InvalidRequestError, 400, "invalid_request_error"),
    (UnsupportedModelError, 400, "invalid_request_error"),
    (PrefixNotFoundError, 404, "not_found_error"),
    (QueueFullError, 429, "rate_limit_error"),
    (WorkerUnavailableError, 503, "service_unavailable"),
    (DataLossError, 500, "data_loss"),
    (DeadlineExceededError, 504, "timeout"),
]


class ModelNotFoundError(VeriCacheError):
    """The request names a model this server does not serve."""


def error_body(message: str, error_type: str, code: int, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def refusal(
    message: str,
    status: int,
    error_type: str,
    request_id: str,
    tenant: Tenant | None,
    param: str | None = None,
) -> dict:
    """The body of a refusal, logged with the request id and the caller's tenant (None: no valid
    API key, or not known yet)."""
    name = tenant.name if tenant is not None else None
    extra = {"request_id": request_id, "code": status, "tenant": name}
    log.info("HTTP request refused for tenant %r: %s", name, message, extra=extra)
    return error_body(f"{message} (request id {request_id})", error_type, status, param)


def error_of(exc: Exception, request_id: str, tenant: Tenant | None) -> tuple[int, dict]:
    """The status and body that answer `exc`."""
    if isinstance(exc, ModelNotFoundError):
        return 404, refusal(str(exc), 404, "invalid_request_error", request_id, tenant, "model")
    for error_type, status, name in _ERRORS:
        if isinstance(exc, error_type):
            return status, refusal(str(exc), status, name, request_id, tenant)
    name = tenant.name if tenant is not None else None
    extra = {"request_id": request_id, "code": 500, "tenant": name}
    log.error("HTTP request failed for tenant %r", name, exc_info=exc, extra=extra)
    return 500, error_body(
        f"the request failed on the server (request id {request_id})", "api_error", 500
    )


def _about(request: Request) -> tuple[str, Tenant | None]:
    """The request id and tenant the API's middleware gave the request (no tenant outside /v1/)."""
    return getattr(request.state, "request_id", "-"), getattr(request.state, "tenant", None)


def _bad_body(exc: RequestValidationError) -> tuple[str, str | None]:
    """What is wrong with a body that is not JSON or does not fit the schema, and where."""
    first = exc.errors()[0]
    where = ".".join(str(part) for part in first["loc"] if part != "body")
    if first["type"] == "json_invalid":
        return f"the request body is not valid JSON: {first['ctx']['error']}", None
    if not where:
        return "the request body must be a JSON object", None
    return f"{where}: {first['msg']}", where


def handle_errors(app: FastAPI) -> None:
    """Answers every error the app's routes or FastAPI itself raise in OpenAI's shape."""

    @app.exception_handler(RequestValidationError)
    async def bad_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, where = _bad_body(exc)
        body = refusal(message, 400, "invalid_request_error", *_about(request), where)
        return JSONResponse(body, 400)

    @app.exception_handler(HTTPException)
    async def refused_by_framework(request: Request, exc: HTTPException) -> JSONResponse:
        message = str(exc.detail)
        if isinstance(exc.__cause__, UnicodeDecodeError):  # JSON must be UTF-8 (or -16, -32)
            message = "the request body is not valid JSON: its bytes are not UTF-8 text"
        error_type = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        body = refusal(message, exc.status_code, error_type, *_about(request))
        return JSONResponse(body, exc.status_code, headers=exc.headers)

    @app.exception_handler(VeriCacheError)
    @app.exception_handler(Exception)  # anything else: a 500 in OpenAI's shape, saying no more
    async def refused(request: Request, exc: Exception) -> JSONResponse:
        status, body = error_of(exc, *_about(request))
        return JSONResponse(body, status)
