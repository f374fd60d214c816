"""The OpenAI-compatible HTTP API (`vericache serve --http-port`), beside the gRPC API over the same
coordinator: what the openai client, LangChain, curl and load generators speak.

- GET /v1/models; POST /v1/completions and /v1/chat/completions, whole or streamed as server-sent
  events (`data: {chunk}` lines, then `data: [DONE]`; `stream_options.include_usage` adds a last
  chunk with the usage). A response, or a stream's chunk with the finish reason, carries a
  `vericache` block (rounds, accepted per round, link bytes, seed), and `usage`.
- GET /health: 200, or 503 while no worker of a needed kind is up. GET /metrics: the server's
  Prometheus registry, as `--metrics-port` serves it.
- Errors have OpenAI's shape, `{"error": {"message", "type", "param", "code"}}` (openai_errors.py),
  and status: 400 bad request (a body that is not UTF-8 JSON, unknown fields and wrong types
  included), 401 no or wrong key, 404 unknown model or prefix, 429 over a limit, 503 unavailable,
  504 past its timeout, 500 anything else (its message says only that it failed). Every message
  ends with the request id that the server's log line of the refusal carries, with the tenant.
- Auth: `Authorization: Bearer <key>` against the same tenants as gRPC, checked before anything
  else reads the request: a caller without a valid key hears 401 whatever its body holds.
- `return_token_ids` (vLLM's field) adds each choice's output token ids (`token_ids`), whole or
  per chunk.
- A client that disconnects mid-stream stops its request: the stream's generator is closed, which
  closes the coordinator's, which ends the request's sessions and frees the tenant's slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.types import ASGIApp, Receive, Scope, Send

from vericache.errors import DeadlineExceededError, WorkerUnavailableError
from vericache.serve.api_types import GenerateSummary, OutputChunk
from vericache.serve.front.auth import Access, Tenant, UnauthenticatedError
from vericache.serve.front.coordinator import Coordinator
from vericache.serve.front.openai_errors import (
    ModelNotFoundError,
    error_body,
    error_of,
    handle_errors,
)
from vericache.serve.front.openai_schema import ChatCompletionRequest, CompletionRequest


class _Authenticated:
    """ASGI middleware: every request gets its request id, and the API key of every /v1/ request
    is checked before its body is read or its route chosen; the tenant goes on in the request's
    state."""

    def __init__(self, app: ASGIApp, access: Access):
        self.app, self.access = app, access

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        state["request_id"] = uuid.uuid4().hex
        if scope["path"].startswith("/v1/"):
            metadata = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]]
            try:
                state["tenant"] = self.access.tenant_for(metadata)
            except UnauthenticatedError as exc:
                status, body = error_of(exc, state["request_id"], None)
                await JSONResponse(body, status)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def openai_app(coordinator: Coordinator, access: Access, model_name: str) -> FastAPI:
    """The HTTP API over `coordinator`; `model_name` is the one id /v1/models lists."""
    app = FastAPI(title="VeriCache", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(_Authenticated, access=access)
    handle_errors(app)

    def tenant(request: Request) -> Tenant:
        return request.state.tenant  # checked by _Authenticated

    def check_model(name: str) -> None:
        if name != model_name:
            raise ModelNotFoundError(
                f"the model {name!r} does not exist: this server serves {model_name!r}"
            )

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        tenant(request)
        entry = {"id": model_name, "object": "model", "created": 0, "owned_by": "vericache"}
        return {"object": "list", "data": [entry]}

    @app.get("/health")
    async def health() -> Response:
        if coordinator.backend.is_serving():
            return JSONResponse({"status": "ok"})
        body = error_body("no worker of a kind requests need is up", "service_unavailable", 503)
        return JSONResponse(body, 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(
            generate_latest(coordinator.metrics.registry), media_type=CONTENT_TYPE_LATEST
        )

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        check_model(body.model)
        return await _respond(coordinator, tenant(request), body, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        check_model(body.model)
        return await _respond(coordinator, tenant(request), body, request, chat=True)

    app.state.model_name = model_name
    return app


async def _respond(coordinator, tenant: Tenant, body, request: Request, chat: bool) -> Response:
    request_id = request.state.request_id  # given by _Authenticated
    events = coordinator.generate(body.generate_call(), tenant, request_id)
    if body.timeout_s is not None:
        events = _within(events, body.timeout_s)
    reply = _Reply(request_id, tenant, request.app.state.model_name, chat, body.return_token_ids)
    first = await _first_event(events)  # refusals answer with their status, before any stream
    if body.stream:
        stream = reply.stream(first, events, body.include_usage)
        return StreamingResponse(stream, media_type="text/event-stream")
    async with contextlib.aclosing(events):
        texts, token_ids, summary = [], [], first
        async for event in _chain(first, events):
            if isinstance(event, OutputChunk):
                texts.append(event.text)
                token_ids += event.token_ids
            else:
                summary = event
    return JSONResponse(reply.whole("".join(texts), token_ids, summary))


async def _first_event(events: AsyncIterator):
    try:
        return await anext(events)
    except BaseException:
        await events.aclose()
        raise


async def _within(events: AsyncIterator, timeout_s: float) -> AsyncIterator:
    """`events` until `timeout_s` from now; then DeadlineExceededError, and `events` closed, which
    stops the request and frees its slot."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    async with contextlib.aclosing(events):
        while True:
            try:
                async with asyncio.timeout_at(deadline):
                    event = await anext(events)
            except StopAsyncIteration:
                return
            except TimeoutError:
                raise DeadlineExceededError(
                    f"the request did not finish within its timeout_s of {timeout_s:g} s"
                ) from None
            yield event


async def _chain(first, events: AsyncIterator) -> AsyncIterator:
    yield first
    async for event in events:
        yield event


class _Reply:
    """The response bodies of one request, OpenAI's shapes for completions or chat."""

    def __init__(
        self, request_id: str, tenant: Tenant, model: str, chat: bool, with_token_ids: bool = False
    ):
        self.request_id = request_id
        self.tenant = tenant  # for the log line of an error in the stream
        self.with_token_ids = with_token_ids
        self.id = ("chatcmpl-" if chat else "cmpl-") + request_id
        self.chunk_kind = "chat.completion.chunk" if chat else "text_completion"
        self.model = model
        self.chat = chat
        self.created = int(time.time())

    def _base(self, kind: str) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def whole(self, text: str, token_ids: list[int], summary: GenerateSummary) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}}
        else:
            choice = {"index": 0, "text": text, "logprobs": None}
        choice["finish_reason"] = summary.finish_reason
        if self.with_token_ids:
            choice["token_ids"] = token_ids
        kind = "chat.completion" if self.chat else "text_completion"
        return self._base(kind) | {
            "choices": [choice], "usage": _usage(summary), "vericache": _vericache(summary),
        }  # fmt: skip

    def _chunk(
        self, text: str | None, finish_reason: str | None, first: bool, token_ids=()
    ) -> dict:
        if self.chat:
            delta = {"role": "assistant"} if first else {}
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None}
        choice["finish_reason"] = finish_reason
        if self.with_token_ids:
            choice["token_ids"] = list(token_ids)
        return self._base(self.chunk_kind) | {"choices": [choice]}

    async def stream(self, first, events: AsyncIterator, include_usage: bool) -> AsyncIterator[str]:
        """Server-sent events; closed early (the client went away), it closes `events`, which
        stops the request. An error after the stream began comes as an `error` event."""
        is_first = True
        async with contextlib.aclosing(events):
            try:
                async for event in _chain(first, events):
                    if isinstance(event, OutputChunk):
                        # Text held back still carries its tokens, where they are asked for.
                        if event.text or is_first or (self.with_token_ids and event.token_ids):
                            yield _sse(self._chunk(event.text, None, is_first, event.token_ids))
                            is_first = False
                        continue
                    # The last chunk with a choice carries the vericache block, usage or not.
                    last = self._chunk(None, event.finish_reason, is_first)
                    yield _sse(last | {"vericache": _vericache(event)})
                    if include_usage:
                        usage = {"usage": _usage(event), "vericache": _vericache(event)}
                        yield _sse(self._base(self.chunk_kind) | {"choices": []} | usage)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the status line is sent: tell it in the stream
                _, body = error_of(exc, self.request_id, self.tenant)
                yield _sse(body)
        yield "data: [DONE]\n\n"


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def _usage(summary: GenerateSummary) -> dict:
    return {
        "prompt_tokens": summary.prompt_tokens,
        "completion_tokens": summary.num_tokens,
        "total_tokens": summary.prompt_tokens + summary.num_tokens,
        "prompt_tokens_details": {"cached_tokens": summary.cached_tokens},
    }


def _vericache(summary: GenerateSummary) -> dict:
    return {
        "rounds": summary.rounds,
        "mean_accepted_per_round": summary.mean_accepted_per_round,
        "accepted_per_round": list(summary.accepted_per_round),
        "link_bytes": summary.link_bytes,
        "seed": summary.seed,
    }


class HttpServer:
    """uvicorn serving the app on the coordinator's event loop."""

    def __init__(self, app: FastAPI, host: str, port: int, access: Access):
        tls = access.tls
        config = uvicorn.Config(
            app, host=host, port=port, log_level="warning", lifespan="off", access_log=False,
            ssl_certfile=str(tls.cert) if tls else None, ssl_keyfile=str(tls.key) if tls else None,
        )  # fmt: skip
        self._server = uvicorn.Server(config)
        self._task: asyncio.Task | None = None

    async def start(self) -> int:
        """Serves in the background; returns the port (the one picked, for port 0)."""
        self._task = asyncio.create_task(self._server.serve())
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises why it could not start
                raise WorkerUnavailableError("the HTTP server stopped as it started")
            await asyncio.sleep(0.01)
        (server,) = self._server.servers
        return server.sockets[0].getsockname()[1]

    async def stop(self, grace_s: float) -> None:
        """Stops taking connections; streams still running get `grace_s` to finish."""
        if self._task is None:
            return
        self._server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self._task), grace_s + 1)
        except TimeoutError:
            self._server.force_exit = True
            await self._task
