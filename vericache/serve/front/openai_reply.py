"""The bodies of an OpenAI-API response: whole, or as server-sent events, for one choice or `n`.

Each choice is a Generate stream of its own (openai_api.py starts them); streamed, their chunks
interleave as they come, each with its choice's `index`. A choice's finishing chunk carries its
`vericache` block; with `stream_options.include_usage`, one last chunk without choices carries
the usage of all of them: the prompt's tokens once, every choice's output tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from vericache.engine.request import TokenLogprob
from vericache.serve.api_types import GenerateSummary, OutputChunk
from vericache.serve.front.auth import Tenant
from vericache.serve.front.openai_errors import error_of
from vericache.serve.front.openai_logprobs import TokenTexts, chat_logprobs, completion_logprobs
from vericache.serve.front.tools import ParsedOutput, Piece, ToolParser, parse_output


@dataclass
class ChoiceOutput:
    """A whole choice: its text, its token ids (and their log-probabilities, where asked) and its
    summary."""

    text: str
    token_ids: list[int]
    summary: GenerateSummary
    logprobs: list[TokenLogprob] = field(default_factory=list)


async def collect(first, events: AsyncIterator) -> ChoiceOutput:
    """A choice's whole output, from its first event on."""
    texts, token_ids, logprobs, summary = [], [], [], first
    async with contextlib.aclosing(events):
        async for event in chain(first, events):
            if isinstance(event, OutputChunk):
                texts.append(event.text)
                token_ids += event.token_ids
                logprobs += event.logprobs
            else:
                summary = event
    return ChoiceOutput("".join(texts), token_ids, summary, logprobs)


async def chain(first, events: AsyncIterator) -> AsyncIterator:
    yield first
    async for event in events:
        yield event


class Reply:
    """The response bodies of one request, OpenAI's shapes for completions or chat."""

    def __init__(
        self,
        request_id: str,
        tenant: Tenant,
        model: str,
        chat: bool,
        with_token_ids: bool = False,
        logprobs: TokenTexts | None = None,
    ):
        self.request_id = request_id
        self.tenant = tenant  # for the log line of an error in the stream
        self.with_token_ids = with_token_ids
        self.token_texts = logprobs  # where the request asks for log-probabilities
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

    def whole(self, outputs: list[ChoiceOutput]) -> dict:
        choices = [self._whole_choice(index, output) for index, output in enumerate(outputs)]
        if len(outputs) > 1:  # each choice's own block beside the first's at the top
            for choice, output in zip(choices, outputs):
                choice["vericache"] = _vericache(output.summary)
        kind = "chat.completion" if self.chat else "text_completion"
        summaries = [output.summary for output in outputs]
        return self._base(kind) | {
            "choices": choices, "usage": _usage(summaries),
            "vericache": _vericache(summaries[0]),
        }  # fmt: skip

    def _whole_choice(self, index: int, output: ChoiceOutput) -> dict:
        finish_reason = output.summary.finish_reason
        if self.chat:
            message = {"role": "assistant", "content": output.text}
            if self.tool_parser is not None:
                parsed = parse_output(self.tool_parser, output.text)
                calls = parsed.calls[: self.max_calls]
                if calls:
                    message = _with_calls(parsed, calls)
                    finish_reason = "tool_calls"
            choice = {"index": index, "message": message}
        else:
            choice = {"index": index, "text": output.text}
        choice["logprobs"] = self._logprobs(output.logprobs)
        choice["finish_reason"] = finish_reason
        if self.with_token_ids:
            choice["token_ids"] = output.token_ids
        return choice

    def _logprobs(self, logprobs, text_offset: int = 0) -> dict | None:
        """A choice's or chunk's `logprobs`; None where the request did not ask, or for no
        tokens."""
        if self.token_texts is None or not logprobs:
            return None
        if self.chat:
            return chat_logprobs(self.token_texts, logprobs)
        return completion_logprobs(self.token_texts, logprobs, text_offset)

    def _chunk(
        self,
        index: int,
        delta: dict | None,
        finish_reason: str | None,
        first: bool,
        token_ids=(),
        logprobs: dict | None = None,
    ) -> dict:
        """A chunk with a chat `delta` (content or tool calls), or a completion's text."""
        if self.chat:
            delta = ({"role": "assistant"} if first else {}) | (delta or {})
            choice = {"index": index, "delta": delta}
        else:
            choice = {"index": index, "text": (delta or {}).get("content", "")}
        choice["logprobs"] = logprobs
        choice["finish_reason"] = finish_reason
        if self.with_token_ids:
            choice["token_ids"] = list(token_ids)
        return self._base(self.chunk_kind) | {"choices": [choice]}

    async def stream(
        self, firsts: list, streams: list[AsyncIterator], include_usage: bool
    ) -> AsyncIterator[str]:
        """Server-sent events of every choice; closed early (the client went away), it closes
        the streams, which stops the requests. An error after the stream began comes as an
        `error` event, and stops the other choices."""
        choices = [_StreamedChoice(self.tool_parser, self.max_calls) for _ in streams]
        try:
            async for index, event in _merged(firsts, streams):
                for chunk in self._chunks(index, choices[index], event):
                    yield _sse(chunk)
            if include_usage:
                summaries = [choice.summary for choice in choices]
                usage = {"usage": _usage(summaries), "vericache": _vericache(summaries[0])}
                yield _sse(self._base(self.chunk_kind) | {"choices": []} | usage)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the status line is sent: tell it in the stream
            _, body = error_of(exc, self.request_id, self.tenant)
            yield _sse(body)
        yield "data: [DONE]\n\n"

    def _chunks(self, index: int, choice: _StreamedChoice, event) -> list[dict]:
        """The chunks one event of a choice makes."""
        chunks = []
        if isinstance(event, OutputChunk):
            deltas = choice.deltas.feed(event.text)
            logprobs = self._logprobs(event.logprobs, choice.text_offset)
            if logprobs is not None and not self.chat:
                choice.text_offset += sum(len(text) for text in logprobs["tokens"])
            # Text held back still carries its tokens and their log-probabilities, where asked.
            carries = (self.with_token_ids and event.token_ids) or logprobs is not None
            if not deltas and (choice.is_first or carries):
                deltas = [{"content": event.text}]
            token_ids = event.token_ids
            for delta in deltas:
                chunks.append(self._chunk(index, delta, None, choice.is_first, token_ids, logprobs))
                choice.is_first, token_ids, logprobs = False, (), None
            return chunks
        for delta in choice.deltas.finish():
            chunks.append(self._chunk(index, delta, None, choice.is_first))
            choice.is_first = False
        choice.summary = event
        # The last chunk of a choice carries the vericache block, usage or not.
        finish_reason = "tool_calls" if choice.deltas.num_calls else event.finish_reason
        last = self._chunk(index, None, finish_reason, choice.is_first)
        return [*chunks, last | {"vericache": _vericache(event)}]


@dataclass
class _StreamedChoice:
    parser: ToolParser | None
    max_calls: int | None
    is_first: bool = True
    summary: GenerateSummary | None = None
    text_offset: int = 0  # a completion's: characters of its tokens' texts sent so far
    deltas: _Deltas = field(init=False)

    def __post_init__(self):
        self.deltas = _Deltas(self.parser, self.max_calls)


async def _merged(firsts: list, streams: list[AsyncIterator]) -> AsyncIterator[tuple[int, object]]:
    """(choice index, event) of every stream as each comes; one stream alone is read in place.
    Closed, or failing in any stream, it stops and closes every stream."""
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]):
            async for event in chain(firsts[0], streams[0]):
                yield 0, event
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int) -> None:
        async with contextlib.aclosing(streams[index]):
            async for event in chain(firsts[index], streams[index]):
                await queue.put((index, event))

    tasks = [asyncio.create_task(pump(index)) for index in range(len(streams))]
    checked: set[asyncio.Task] = set()
    try:
        while True:
            for task in tasks:
                if task.done() and task not in checked:
                    checked.add(task)
                    task.result()  # raises a stream's error
            if not queue.empty():
                yield queue.get_nowait()
                continue
            if len(checked) == len(tasks):
                return
            getter = asyncio.ensure_future(queue.get())
            running = [task for task in tasks if not task.done()]
            await asyncio.wait([getter, *running], return_when=asyncio.FIRST_COMPLETED)
            if getter.done():
                yield getter.result()
            else:
                getter.cancel()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


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


def _usage(summaries: list[GenerateSummary]) -> dict:
    """The prompt's tokens once (every choice reads the same), every choice's output tokens."""
    first = summaries[0]
    completion = sum(summary.num_tokens for summary in summaries)
    return {
        "prompt_tokens": first.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": first.prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": first.cached_tokens},
    }


def _vericache(summary: GenerateSummary) -> dict:
    return {
        "rounds": summary.rounds,
        "mean_accepted_per_round": summary.mean_accepted_per_round,
        "accepted_per_round": list(summary.accepted_per_round),
        "link_bytes": summary.link_bytes,
        "seed": summary.seed,
    }
