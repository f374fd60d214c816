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
from vericache.serve.front.tools import (
    ParsedOutput,
    Piece,
    ToolParser,
    parse_output,
    tool_parser_for,
)


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
    return app


async def _respond(coordinator, tenant: Tenant, body, request: Request, chat: bool) -> Response:
    request_id = request.state.request_id  # given by _Authenticated
    events = coordinator.generate(body.generate_call(), tenant, request_id)
    if body.timeout_s is not None:
        events = _within(events, body.timeout_s)
    state = request.app.state
    reply = _Reply(request_id, tenant, state.model_name, chat, body.return_token_ids)
    if chat and body.parses_tool_calls:
        reply.read_tool_calls(state.tool_parser, body.parallel_tool_calls)
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
        self.tool_parser: ToolParser | None = None  # chat with tools: the output read for calls
        self.max_calls: int | None = None  # None: every call (parallel tool calls)

    def read_tool_calls(self, parser: ToolParser, parallel: bool) -> None:
        self.tool_parser = parser
        self.max_calls = None if parallel else 1

    def _base(self, kind: str) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def whole(self, text: str, token_ids: list[int], summary: GenerateSummary) -> dict:
        finish_reason = summary.finish_reason
        if self.chat:
            message = {"role": "assistant", "content": text}
            if self.tool_parser is not None:
                parsed = parse_output(self.tool_parser, text)
                calls = parsed.calls[: self.max_calls]
                if calls:
                    message = _with_calls(parsed, calls)
                    finish_reason = "tool_calls"
            choice = {"index": 0, "message": message}
        else:
            choice = {"index": 0, "text": text, "logprobs": None}
        choice["finish_reason"] = finish_reason
        if self.with_token_ids:
            choice["token_ids"] = token_ids
        kind = "chat.completion" if self.chat else "text_completion"
        return self._base(kind) | {
            "choices": [choice], "usage": _usage(summary), "vericache": _vericache(summary),
        }  # fmt: skip

    def _chunk(
        self, delta: dict | None, finish_reason: str | None, first: bool, token_ids=()
    ) -> dict:
        """A chunk with a chat `delta` (content or tool calls), or a completion's text."""
        if self.chat:
            choice = {"index": 0, "delta": ({"role": "assistant"} if first else {}) | (delta or {})}
        else:
            choice = {"index": 0, "text": (delta or {}).get("content", ""), "logprobs": None}
        choice["finish_reason"] = finish_reason
        if self.with_token_ids:
            choice["token_ids"] = list(token_ids)
        return self._base(self.chunk_kind) | {"choices": [choice]}

    async def stream(self, first, events: AsyncIterator, include_usage: bool) -> AsyncIterator[str]:
        """Server-sent events; closed early (the client went away), it closes `events`, which
        stops the request. An error after the stream began comes as an `error` event."""
        deltas = _Deltas(self.tool_parser, self.max_calls)
        is_first = True
        async with contextlib.aclosing(events):
            try:
                async for event in _chain(first, events):
                    if isinstance(event, OutputChunk):
                        pieces = deltas.feed(event.text)
                        # Text held back still carries its tokens, where they are asked for.
                        if not pieces and (is_first or (self.with_token_ids and event.token_ids)):
                            pieces = [{"content": event.text}]
                        token_ids = event.token_ids
                        for delta in pieces:
                            yield _sse(self._chunk(delta, None, is_first, token_ids))
                            is_first, token_ids = False, ()
                        continue
                    for delta in deltas.finish():
                        yield _sse(self._chunk(delta, None, is_first))
                        is_first = False
                    # The last chunk with a choice carries the vericache block, usage or not.
                    finish_reason = "tool_calls" if deltas.num_calls else event.finish_reason
                    last = self._chunk(None, finish_reason, is_first)
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


class _Deltas:
    """A stream's text as chat deltas: content, and with a tool parser each call as one
    `tool_calls` entry once its block has ended (past `max_calls`, calls are dropped)."""

    def __init__(self, parser: ToolParser | None, max_calls: int | None):
        self._calls = parser.stream() if parser is not None else None
        self.max_calls = max_calls
        self.num_calls = 0

    def feed(self, text: str) -> list[dict]:
        if self._calls is None:
            return [{"content": text}] if text else []
        return self._deltas(self._calls.feed(text))

    def finish(self) -> list[dict]:
        return self._deltas(self._calls.finish()) if self._calls is not None else []

    def _deltas(self, pieces: list[Piece]) -> list[dict]:
        deltas = []
        for piece in pieces:
            if isinstance(piece, str):
                deltas.append({"content": piece})
            elif self.max_calls is None or self.num_calls < self.max_calls:
                deltas.append({"tool_calls": [_call_json(piece) | {"index": self.num_calls}]})
                self.num_calls += 1
        return deltas


def _with_calls(parsed: ParsedOutput, calls) -> dict:
    content = parsed.content or None
    return {"role": "assistant", "content": content, "tool_calls": [_call_json(c) for c in calls]}


def _call_json(call) -> dict:
    function = {"name": call.name, "arguments": call.arguments}
    return {"id": call.id, "type": "function", "function": function}


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
