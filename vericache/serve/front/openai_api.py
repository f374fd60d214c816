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
- `n` choices (at most `--max-n`): each a Generate of its own over the same prompt, choice i
  seeded with seed + i (without a seed each draws its own); they share the prefix and batch on
  its worker like any requests (openai_reply.py interleaves their chunks).
- Chat with `tools` (tool_choice "auto"): the output is read for calls by the parser the chat
  template asks for (tools.py), and answered as OpenAI does: `message.tool_calls` with ids and
  `finish_reason: "tool_calls"`; streamed, each call as one `delta.tool_calls` entry once its
  block has ended, the text around the calls as content.
- A client that disconnects mid-stream stops its request: the stream's generator is closed, which
  closes the coordinator's, which ends the request's sessions and frees the tenant's slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.types import ASGIApp, Receive, Scope, Send

from vericache.errors import DeadlineExceededError, InvalidRequestError, WorkerUnavailableError
from vericache.serve.front.auth import Access, Tenant, UnauthenticatedError
from vericache.serve.front.coordinator import Coordinator
from vericache.serve.front.openai_errors import (
    ModelNotFoundError,
    error_body,
    error_of,
    handle_errors,
)
from vericache.serve.front.openai_logprobs import TokenTexts
from vericache.serve.front.openai_reply import Reply, collect
from vericache.serve.front.openai_schema import ChatCompletionRequest, CompletionRequest
from vericache.serve.front.tools import tool_parser_for


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
    app.state.tool_parser = tool_parser_for(coordinator.tokenizer)
    app.state.token_texts = TokenTexts(coordinator.tokenizer)
    return app


async def _respond(coordinator, tenant: Tenant, body, request: Request, chat: bool) -> Response:
    """Starts one Generate per choice (their first events awaited: a refusal answers with its
    status, before any stream), then answers whole or streamed."""
    request_id = request.state.request_id  # given by _Authenticated
    max_n = coordinator.config.max_n
    if body.n > max_n:
        raise InvalidRequestError(f"n: at most {max_n} choices a request on this server")
    state = request.app.state
    calls = body.generate_calls(state.tool_parser)
    ids = [request_id] if len(calls) == 1 else [f"{request_id}-{i}" for i in range(len(calls))]
    streams = [coordinator.generate(call, tenant, id_) for call, id_ in zip(calls, ids)]
    if body.timeout_s is not None:
        streams = [_within(events, body.timeout_s) for events in streams]
    texts = state.token_texts if body.num_logprobs is not None else None
    reply = Reply(request_id, tenant, state.model_name, chat, body.return_token_ids, texts)
    if chat and body.parses_tool_calls:
        reply.read_tool_calls(state.tool_parser, body.parallel_tool_calls)
    firsts = await _first_events(streams)
    if body.stream:
        stream = reply.stream(firsts, streams, body.include_usage)
        return StreamingResponse(stream, media_type="text/event-stream")
    outputs = await asyncio.gather(*(collect(f, s) for f, s in zip(firsts, streams)))
    return JSONResponse(reply.whole(list(outputs)))


async def _first_events(streams: list[AsyncIterator]) -> list:
    """Each stream's first event; if any refuses, every stream is closed and its error raised."""
    try:
        firsts = await asyncio.gather(*(anext(s) for s in streams), return_exceptions=True)
        failed = [event for event in firsts if isinstance(event, BaseException)]
        if failed:
            raise failed[0]
    except BaseException:
        await asyncio.gather(*(s.aclose() for s in streams), return_exceptions=True)
        raise
    return firsts


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
