"""Function tools for the chat API: a conversation with tools as the turns a chat template
renders, and the model's output as tool calls again.

Rendering. A chat template that renders tools itself (one whose source uses `tools`, as Llama 3.1's,
Qwen 2.5's and Hermes' do) gets them as OpenAI writes them, with the conversation's tool calls and
tool results. A template that does not, as the embedded SmolLM2's, gets VeriCache's default
format, the one Hermes-style templates use: the catalogue at the end of the system turn (one is
made for it where the conversation has none), each function a JSON line inside <tools></tools>,
with the instruction to call one as JSON inside <tool_call></tool_call>; an assistant turn's calls
written that way; tool results as a user turn inside <tool_response></tool_response>. The
catalogue is then part of the system turn's text, which is the prefix: automatic prefix caching
registers and finds it as it does any system turn.

Parsing. A `ToolParser` splits the output into content and calls, whole or as it streams:
`HermesToolParser` reads <tool_call> blocks (the default format's, Hermes' and Qwen's),
`Llama3JsonToolParser` Llama 3's JSON calls ({"name", "parameters"}, several joined by ";",
after an optional <|python_tag|>). `tool_parser_for` picks the one the chat template asks for.
A block that does not parse as a call stays text: the output is never changed, only read.

Forcing calls. `tool_choice` "required" (a call of any of the tools) or a named function (a call
of it) is a grammar (`tool_call_constraint`): the reply is calls alone, in the parser's format,
each call's arguments following its function's JSON schema; the engine decodes under it
(engine/constraint.py), so VeriCache's calls are constrained full decoding's.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from vericache.engine.constraint import JSON_OPTIONS
from vericache.engine.request import OutputConstraint
from vericache.errors import InvalidRequestError
from vericache.serve.api_types import ChatTurn, FunctionTool, ToolCall

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
_CATALOGUE = """# Tools

You may call one or more of the functions below. Their signatures, one JSON object per line:
<tools>
{signatures}
</tools>

To call a function, answer with a JSON object that names it and gives its arguments, inside
<tool_call></tool_call> tags, one call per block:
<tool_call>
{{"name": <the function's name>, "arguments": <its arguments as a JSON object>}}
</tool_call>"""

# A streamed piece of output: text, or a call whose block has ended.
Piece = str | ToolCall


def renders_tools(tokenizer) -> bool:
    """Whether the model's chat template renders tools itself."""
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and "tools" in template


def conversation_turns(
    tokenizer, turns: tuple[ChatTurn, ...], tools: tuple[FunctionTool, ...]
) -> tuple[list[dict], list[dict] | None]:
    """The turns (and tools) `build_conversation` renders for this tokenizer's template."""
    if renders_tools(tokenizer):
        schemas = [tool.as_openai() for tool in tools] or None
        return [_template_turn(turn) for turn in turns], schemas
    return default_format_turns(turns, tools), None


def default_format_turns(turns: tuple[ChatTurn, ...], tools: tuple[FunctionTool, ...]) -> list:
    """The conversation in the default format, as plain {"role", "content"} turns."""
    out: list[dict] = []
    for turn in turns:
        if turn.role == "tool":
            response = f"<tool_response>\n{turn.content}\n</tool_response>"
            if out and out[-1].get("tool_results"):  # consecutive results: one user turn
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response, "tool_results": True})
        elif turn.role == "assistant" and turn.tool_calls:
            blocks = [_call_block(call) for call in turn.tool_calls]
            out.append({"role": "assistant", "content": "\n".join([turn.content, *blocks]).strip()})
        else:
            out.append({"role": turn.role, "content": turn.content})
    if tools:
        catalogue = render_catalogue(tools)
        if out and out[0]["role"] == "system":
            system = out[0]["content"]
            out[0]["content"] = f"{system}\n\n{catalogue}" if system else catalogue
        else:
            out.insert(0, {"role": "system", "content": catalogue})
    return [{"role": t["role"], "content": t["content"]} for t in out]


def render_catalogue(tools: Iterable[FunctionTool]) -> str:
    signatures = "\n".join(json.dumps(tool.as_openai(), sort_keys=True) for tool in tools)
    return _CATALOGUE.format(signatures=signatures)


def _call_block(call: ToolCall) -> str:
    body = {"name": call.name, "arguments": json.loads(call.arguments)}
    return f"{CALL_OPEN}\n{json.dumps(body)}\n{CALL_CLOSE}"


def _template_turn(turn: ChatTurn) -> dict:
    message: dict = {"role": turn.role, "content": turn.content}
    if turn.tool_calls:
        message["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": json.loads(call.arguments)},
            }
            for call in turn.tool_calls
        ]
    if turn.tool_call_id is not None:
        message["tool_call_id"] = turn.tool_call_id
    return message


def check_tools(tools: tuple[FunctionTool, ...], named: str | None) -> None:
    """Each tool's name once; a named `tool_choice` among them."""
    names = [tool.name for tool in tools]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise InvalidRequestError(f"tools: the function name {repeated[0]!r} repeats")
    if named is not None and named not in names:
        raise InvalidRequestError(f"tool_choice: {named!r} is not among the tools")


@dataclass(frozen=True)
class ParsedOutput:
    content: str  # the text outside the calls, stripped
    calls: tuple[ToolCall, ...]


class ToolCallStream(Protocol):
    def feed(self, text: str) -> list[Piece]:
        """The pieces `text` completes; text that may still open a call is held back."""
        ...

    def finish(self) -> list[Piece]:
        """What is left once the output ended (an unclosed call as text)."""
        ...


class ToolParser(Protocol):
    def stream(self) -> ToolCallStream: ...


def parse_output(parser: ToolParser, text: str) -> ParsedOutput:
    """A whole output, parsed as its stream would be."""
    stream = parser.stream()
    pieces = stream.feed(text) + stream.finish()
    content = "".join(piece for piece in pieces if isinstance(piece, str))
    calls = tuple(piece for piece in pieces if isinstance(piece, ToolCall))
    return ParsedOutput(content.strip(), calls)


class HermesToolParser:
    def stream(self) -> ToolCallStream:
        return _TaggedCalls()


class Llama3JsonToolParser:
    def stream(self) -> ToolCallStream:
        return _JsonCalls()


def tool_parser_for(tokenizer) -> ToolParser:
    """The parser of the calls the chat template asks for: Llama 3's JSON where its template
    writes calls so, else <tool_call> blocks (the default format's too)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if renders_tools(tokenizer) and CALL_OPEN not in template:
        if PYTHON_TAG in template or '"parameters"' in template:
            return Llama3JsonToolParser()
    return HermesToolParser()


class _TaggedCalls:
    """<tool_call> blocks among text."""

    def __init__(self):
        self._buffer = ""
        self._in_call = False

    def feed(self, text: str) -> list[Piece]:
        self._buffer += text
        pieces: list[Piece] = []
        while True:
            if self._in_call:
                end = self._buffer.find(CALL_CLOSE)
                if end < 0:
                    return pieces
                body, self._buffer = self._buffer[:end], self._buffer[end + len(CALL_CLOSE) :]
                self._in_call = False
                call = _call_of(json_value(body))
                pieces.append(call if call else f"{CALL_OPEN}{body}{CALL_CLOSE}")
                continue
            start = self._buffer.find(CALL_OPEN)
            if start < 0:  # hold back what may be the start of a tag
                keep = _partial_suffix(self._buffer, CALL_OPEN)
                cut = len(self._buffer) - keep
                if cut:
                    pieces.append(self._buffer[:cut])
                self._buffer = self._buffer[cut:]
                return pieces
            if start:
                pieces.append(self._buffer[:start])
            self._buffer = self._buffer[start + len(CALL_OPEN) :]
            self._in_call = True

    def finish(self) -> list[Piece]:
        rest = (CALL_OPEN if self._in_call else "") + self._buffer
        self._buffer, self._in_call = "", False
        return [rest] if rest else []


class _JsonCalls:
    """Llama 3's calls: the whole output is JSON calls, or it is text."""

    def __init__(self):
        self._buffer = ""
        self._is_text: bool | None = None  # undecided until the output's first characters

    def feed(self, text: str) -> list[Piece]:
        if self._is_text:
            return [text] if text else []
        self._buffer += text
        lead = self._buffer.lstrip()
        if not lead or PYTHON_TAG.startswith(lead):
            return []
        self._is_text = not (lead.startswith("{") or lead.startswith(PYTHON_TAG))
        if self._is_text:
            text, self._buffer = self._buffer, ""
            return [text]
        return []

    def finish(self) -> list[Piece]:
        text, self._buffer = self._buffer, ""
        if not self._is_text:
            calls = _json_calls(text.strip().removeprefix(PYTHON_TAG))
            if calls:
                return list(calls)
        return [text] if text else []


def _json_calls(text: str) -> tuple[ToolCall, ...] | None:
    """Calls joined by ";" (or whitespace), every one a call, or None."""
    decoder, calls, at = json.JSONDecoder(), [], 0
    while True:
        while at < len(text) and text[at] in " \t\r\n;":
            at += 1
        if at == len(text):
            return tuple(calls) or None
        try:
            value, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            return None
        call = _call_of(value)
        if call is None:
            return None
        calls.append(call)


def json_value(text: str):
    """The JSON value `text` holds, or None where it holds none."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def _call_of(value) -> ToolCall | None:
    """A call from {"name", "arguments" | "parameters"}, its arguments a JSON object."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        arguments = json_value(arguments)
    if not isinstance(arguments, dict):
        return None
    return ToolCall(new_call_id(), value["name"], json.dumps(arguments, ensure_ascii=False))


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag`."""
    for size in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


def tool_call_constraint(
    tools: tuple[FunctionTool, ...], parser: ToolParser, parallel: bool
) -> OutputConstraint:
    """The grammar of a reply made of calls of `tools` alone (one, or one or more where calls
    may be parallel), in `parser`'s format, the arguments of each following its schema."""
    is_json = isinstance(parser, Llama3JsonToolParser)
    key = "parameters" if is_json else "arguments"
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"const": tool.name},
                key: tool.parameters or {"type": "object"},
            },
            "required": ["name", key],
            "additionalProperties": False,
        }
        for tool in tools
    ]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    schema = schema | {"x-guidance": JSON_OPTIONS}
    if is_json:
        block, separator = "call", '"; "'
    else:
        block, separator = f'"{CALL_OPEN}\\n" call "\\n{CALL_CLOSE}"', '"\\n"'
    start = f"block ({separator} block)*" if parallel else "block"
    lark = f"start: {start}\nblock: {block}\ncall: %json {json.dumps(schema)}\n"
    return OutputConstraint("lark", lark)
