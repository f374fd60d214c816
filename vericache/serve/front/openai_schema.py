"""OpenAI's completion and chat-completion request bodies, checked, and what they become: the
coordinator's `GenerateCall` (the same record a gRPC Generate becomes, so both APIs decode alike).

Bodies are pydantic models that forbid unknown fields, as OpenAI's API does: a misspelt option is
a 400 naming it, never silently ignored. Sampling fields follow vLLM's OpenAI server: OpenAI's
`temperature`, `top_p`, `seed`, `presence_penalty`, and vLLM's extras `top_k`, `min_p`,
`repetition_penalty`, with VeriCache's `coupling`. VeriCache's own options ride in a `vericache`
object (`{"mode", "draft_len", "prefix_id", "compressor", "ratio" | "bits", "steer_every",
"timeout_s"}`), which the openai client sends with `extra_body`. Chat takes OpenAI's function
tools (`tools`, `tool_choice` "none", "auto", "required" or a named function,
`parallel_tool_calls`), `tool` turns and assistant turns with `tool_calls` (tools.py renders them,
and forces calls as a grammar). `response_format` (json_object, json_schema) constrains the output
(engine/constraint.py).
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from vericache.engine.request import MAX_LOGPROBS, OutputConstraint
from vericache.errors import InvalidRequestError
from vericache.serve.api_types import (
    ChatTurn,
    CompressorChoice,
    FunctionTool,
    GenerateCall,
    SamplingChoice,
    ServeMode,
    ToolCall,
)
from vericache.serve.front.tools import (
    HermesToolParser,
    ToolParser,
    check_tools,
    json_value,
    tool_call_constraint,
)

# OpenAI's default, as vLLM's server keeps it: a request that names no temperature samples.
DEFAULT_TEMPERATURE = 1.0


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class VeriCacheOptions(_Body):
    mode: Literal["vericache", "full_local", "full_remote", "lossy"] | None = None
    draft_len: int | None = Field(None, ge=1)
    prefix_id: str | None = None
    # The prefix's compressor (`vericache compressors`): see GenerateCall.compressor.
    compressor: str | None = Field(None, min_length=1)
    ratio: float | None = Field(None, gt=0)  # token dropping
    bits: int | None = Field(None, ge=1)  # quantization
    # Rounds between the verifier's refreshes of the drafter's kept set: GenerateCall.steer_every.
    steer_every: int | None = Field(None, ge=0)
    # Seconds the request may take; past them it stops and answers 504 (or, once streaming, an
    # error event), as a gRPC deadline does.
    timeout_s: float | None = Field(None, gt=0)

    def compressor_choice(self) -> CompressorChoice | None:
        if self.compressor is None:
            if self.ratio is not None or self.bits is not None:
                raise InvalidRequestError("vericache.ratio and vericache.bits need a compressor")
            return None
        return CompressorChoice(self.compressor, ratio=self.ratio, bits=self.bits)


class StreamOptions(_Body):
    include_usage: bool = False


class JsonSchemaFormat(_Body):
    name: str = Field(pattern=r"^[A-Za-z0-9_\-]{1,64}$")
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None  # accepted: the output follows the schema either way


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def constraint(self) -> OutputConstraint | None:
        """The grammar the output is decoded under (None: free text)."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return OutputConstraint("json_object")
        if self.json_schema is None or self.json_schema.schema_ is None:
            raise InvalidRequestError("response_format: a json_schema format needs its schema")
        return OutputConstraint("json_schema", json.dumps(self.json_schema.schema_))


class _GenerateBody(_Body):
    model: str
    max_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    # Choices, each a request of its own over the same prompt (at most the server's --max-n):
    # with a seed, choice i samples with seed + i; without, each draws its own and reports it.
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = Field(None, ge=0, lt=2**64)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    coupling: Literal["seeded", "rejection"] | None = None
    user: str | None = None  # accepted, as OpenAI's API does; not used
    # vLLM's: each choice also gives its output token ids (`token_ids`), whole or per chunk.
    return_token_ids: bool = False
    # The output as JSON (json_object), or JSON of a schema (json_schema): every mode decodes
    # under the grammar's mask, and VeriCache's output is constrained full decoding's.
    response_format: ResponseFormat | None = None
    vericache: VeriCacheOptions | None = None

    @property
    def timeout_s(self) -> float | None:
        return self.vericache.timeout_s if self.vericache else None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def generate_calls(self, tool_parser: ToolParser | None = None) -> list[GenerateCall]:
        """One call per choice (`tool_parser`: the format of the server's tool calls)."""
        call = self.generate_call(tool_parser)
        seed = call.sampling.seed
        if seed is None:
            return [call] * self.n
        return [
            replace(call, sampling=replace(call.sampling, seed=(seed + i) % 2**64))
            for i in range(self.n)
        ]

    def _call(self, max_tokens: int | None, logprobs: int | None, **prompt) -> GenerateCall:
        """logprobs: the alternatives each output token reports with its log-probability (None:
        none), as each endpoint asks for them (`num_logprobs`)."""
        options = self.vericache or VeriCacheOptions()
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        temperature = DEFAULT_TEMPERATURE if self.temperature is None else self.temperature
        sampling = SamplingChoice(
            temperature=temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            seed=self.seed, repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty, coupling=self.coupling,
            logprobs=logprobs,
        )  # fmt: skip
        return GenerateCall(
            prefix_id=options.prefix_id,
            max_tokens=max_tokens,
            stop=stop,
            mode=ServeMode(options.mode) if options.mode else None,
            draft_len=options.draft_len,
            sampling=sampling,
            compressor=options.compressor_choice(),
            constraint=self.response_format.constraint() if self.response_format else None,
            steer_every=options.steer_every,
            **prompt,
        )


class CompletionRequest(_GenerateBody):
    """POST /v1/completions: text continued as it is (after the prefix's tokens, if any)."""

    prompt: str
    # Each token's log-probability, with this many of the most likely tokens at its position.
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    def generate_call(self, tool_parser: ToolParser | None = None) -> GenerateCall:
        return self._call(
            self.max_tokens, self.num_logprobs, prompt=self.prompt, continues_text=True
        )


class TextPart(_Body):
    type: Literal["text"]
    text: str


class FunctionSpec(_Body):
    # OpenAI's rule for a name, with dots, which BFCL's functions use (`math.factorial`).
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None  # a JSON schema
    strict: bool | None = None  # accepted; the arguments are not constrained yet


class ToolSpec(_Body):
    type: Literal["function"]
    function: FunctionSpec

    def tool(self) -> FunctionTool:
        function = self.function
        return FunctionTool(function.name, function.description, function.parameters)


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class CalledFunction(_Body):
    name: str
    arguments: str  # a JSON object


class ToolCallSpec(_Body):
    id: str
    type: Literal["function"]
    function: CalledFunction

    def call(self) -> ToolCall:
        if not isinstance(json_value(self.function.arguments), dict):
            raise InvalidRequestError(
                f"messages: the arguments of tool call {self.id!r} are not a JSON object"
            )
        return ToolCall(self.id, self.function.name, self.function.arguments)


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None  # None: an assistant turn that only calls tools
    name: str | None = None  # accepted, as OpenAI's API does; not used
    tool_calls: list[ToolCallSpec] | None = None  # an assistant turn's
    tool_call_id: str | None = None  # a tool turn's: the call it answers

    def turn(self) -> ChatTurn:
        content = self.content
        if content is None:
            if self.role != "assistant" or not self.tool_calls:
                raise InvalidRequestError(f"messages: a {self.role} turn needs content")
            content = ""
        elif not isinstance(content, str):
            content = "".join(part.text for part in content)
        if self.tool_calls and self.role != "assistant":
            raise InvalidRequestError("messages: only an assistant turn carries tool_calls")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise InvalidRequestError("messages: a tool turn, and only one, has a tool_call_id")
        calls = tuple(call.call() for call in self.tool_calls or ())
        role = "system" if self.role == "developer" else self.role
        return ChatTurn(role, content, calls, self.tool_call_id)


class ChatCompletionRequest(_GenerateBody):
    """POST /v1/chat/completions: a conversation, its leading system turn the prefix's text."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[ToolSpec] | None = None
    # "required" and a named function: the reply is calls, decoded under their schemas' grammar.
    tool_choice: Literal["none", "auto"] | NamedToolChoice | Literal["required"] | None = None
    parallel_tool_calls: bool = True
    logprobs: bool = False  # each output token's log-probability
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # ...and the most likely tokens'

    @property
    def num_logprobs(self) -> int | None:
        if not self.logprobs:
            if self.top_logprobs is not None:
                raise InvalidRequestError("top_logprobs: it needs logprobs set to true")
            return None
        return self.top_logprobs or 0

    @property
    def parses_tool_calls(self) -> bool:
        """Whether the output is read for tool calls."""
        return bool(self.tools) and self.tool_choice != "none"

    def generate_call(self, tool_parser: ToolParser | None = None) -> GenerateCall:
        max_tokens = self.max_completion_tokens or self.max_tokens
        messages = tuple(message.turn() for message in self.messages)
        tools = tuple(spec.tool() for spec in self.tools or ())
        call = self._call(max_tokens, self.num_logprobs, prompt="", messages=messages, tools=tools)
        forced = self._forced_tools(tools)
        if forced:
            if call.constraint is not None:
                raise InvalidRequestError(
                    "tool_choice: 'required' or a named function constrains the reply, and so "
                    "does response_format: give one of them"
                )
            parser = tool_parser or HermesToolParser()
            constraint = tool_call_constraint(forced, parser, self.parallel_tool_calls)
            call = replace(call, constraint=constraint)
        return call

    def _forced_tools(self, tools: tuple[FunctionTool, ...]) -> tuple[FunctionTool, ...]:
        """The tools a reply must call one of ("required", or the named one); () if none."""
        choice = self.tool_choice
        if choice is not None and not tools:
            raise InvalidRequestError("tool_choice: it needs tools")
        named = choice.function.name if isinstance(choice, NamedToolChoice) else None
        check_tools(tools, named)
        if named is not None:
            return tuple(tool for tool in tools if tool.name == named)
        return tools if choice == "required" else ()
