"""Function tools on the chat API (serve/front/tools.py): the catalogue rendered into the system
turn (the prefix), the parsers of both call formats whole and however the stream splits the
output, the request checks, and the responses the openai client reads, whole and streamed, over
a coordinator that answers with a scripted output."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest

from vericache.engine.constraint import grammar_of
from vericache.engine.prompt import build_conversation
from vericache.errors import InvalidRequestError
from vericache.serve.api_types import ChatTurn, FunctionTool, GenerateSummary, OutputChunk, ToolCall
from vericache.serve.config import CoordinatorConfig
from vericache.serve.front.openai_schema import ChatCompletionRequest
from vericache.serve.front.tools import (
    HermesToolParser,
    Llama3JsonToolParser,
    conversation_turns,
    parse_output,
    render_catalogue,
    tool_parser_for,
)

WEATHER = FunctionTool(
    "get_weather",
    "The weather in a city.",
    {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
)
HERMES_OUTPUT = (
    'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
    '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n'
    "</tool_call>"
)


def _calls(parsed) -> list[tuple[str, dict]]:
    return [(call.name, json.loads(call.arguments)) for call in parsed.calls]


def _streamed(parser, parts: list[str]):
    stream = parser.stream()
    pieces = [piece for part in parts for piece in stream.feed(part)] + stream.finish()
    text = "".join(p for p in pieces if isinstance(p, str))
    calls = [(p.name, json.loads(p.arguments)) for p in pieces if isinstance(p, ToolCall)]
    return text.strip(), calls


def test_tagged_calls_are_read_with_the_text_around_them():
    parsed = parse_output(HermesToolParser(), HERMES_OUTPUT)
    assert parsed.content == "Let me look."
    assert _calls(parsed) == [("get_weather", {"city": "Oslo"}), ("get_weather", {"city": "Rome"})]
    assert all(call.id.startswith("call_") for call in parsed.calls)
    assert len({call.id for call in parsed.calls}) == 2


@pytest.mark.parametrize(
    "parser, output",
    [
        (HermesToolParser(), HERMES_OUTPUT),
        (
            Llama3JsonToolParser(),
            '{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}',
        ),
        (Llama3JsonToolParser(), '<|python_tag|>{"name": "f", "parameters": {"a": [1, 2]}}'),
        (Llama3JsonToolParser(), "Plain words, {not a call}."),
        (HermesToolParser(), "no call here, only < and <tool and text"),
    ],
)
def test_a_stream_split_anywhere_reads_as_the_whole_output(parser, output):
    whole = parse_output(parser, output)
    expected = (whole.content, _calls(whole))
    assert _streamed(parser, list(output)) == expected  # one character at a time
    for cut in range(len(output) + 1):
        assert _streamed(parser, [output[:cut], output[cut:]]) == expected


def test_llama3_json_calls_and_text():
    calls = parse_output(
        Llama3JsonToolParser(),
        '{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}',
    )
    assert _calls(calls) == [("f", {"a": 1}), ("g", {})] and calls.content == ""
    text = parse_output(Llama3JsonToolParser(), "Plain words, {not a call}.")
    assert text.calls == () and text.content == "Plain words, {not a call}."


@pytest.mark.parametrize(
    "output",
    [
        "<tool_call>\n{not json}\n</tool_call>",  # a block that is not a call stays text
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',  # arguments not an object
        '<tool_call>\n{"name": "f", "arguments": {}}',  # never closed
    ],
)
def test_what_is_not_a_whole_call_stays_text(output):
    parsed = parse_output(HermesToolParser(), output)
    assert parsed.calls == () and parsed.content == output.strip()


def test_arguments_given_as_a_json_string_are_read():
    parsed = parse_output(
        HermesToolParser(), '<tool_call>{"name": "f", "arguments": "{\\"x\\": 2}"}</tool_call>'
    )
    assert _calls(parsed) == [("f", {"x": 2})]


class _NoTemplate:
    """A tokenizer without a chat template: one id per character."""

    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]


@dataclass
class _Template:
    chat_template: str


def test_the_default_format_puts_the_catalogue_in_the_system_turn_which_is_the_prefix():
    history = (
        ChatTurn("system", "You help."),
        ChatTurn("user", "Weather in Oslo and Rome?"),
        ChatTurn("assistant", "", (ToolCall("c1", "get_weather", '{"city": "Oslo"}'),)),
        ChatTurn("tool", "sunny", tool_call_id="c1"),
        ChatTurn("tool", "rainy", tool_call_id="c2"),
    )
    turns, schemas = conversation_turns(_NoTemplate(), history, (WEATHER,))
    assert schemas is None
    assert turns[0] == {"role": "system", "content": f"You help.\n\n{render_catalogue([WEATHER])}"}
    assert '"name": "get_weather"' in turns[0]["content"] and "<tools>" in turns[0]["content"]
    call = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
    assert turns[2] == {"role": "assistant", "content": f"<tool_call>\n{call}\n</tool_call>"}
    # Consecutive results are one user turn.
    sunny, rainy = (f"<tool_response>\n{r}\n</tool_response>" for r in ("sunny", "rainy"))
    assert turns[3] == {"role": "user", "content": f"{sunny}\n{rainy}"}
    prompt = build_conversation(_NoTemplate(), turns)
    assert prompt.num_prefix_tokens == len(turns[0]["content"]) + 2  # the catalogue in the prefix
    # Without a system turn, the catalogue is one.
    bare, _ = conversation_turns(_NoTemplate(), (ChatTurn("user", "Hi"),), (WEATHER,))
    assert bare[0] == {"role": "system", "content": render_catalogue([WEATHER])}


def test_a_template_that_renders_tools_gets_them_as_openai_writes_them():
    template = _Template("{% for tool in tools %}{{ tool }}{% endfor %}<tool_call>")
    call = ToolCall("c1", "get_weather", '{"city": "Oslo"}')
    history = (ChatTurn("assistant", "", (call,)), ChatTurn("tool", "sunny", tool_call_id="c1"))
    turns, schemas = conversation_turns(template, history, (WEATHER,))
    assert schemas == [WEATHER.as_openai()]
    assert turns[0]["tool_calls"][0]["function"] == {
        "name": "get_weather",
        "arguments": {"city": "Oslo"},
    }
    assert turns[1] == {"role": "tool", "content": "sunny", "tool_call_id": "c1"}


def test_the_parser_is_the_one_the_template_asks_for():
    assert isinstance(tool_parser_for(_NoTemplate()), HermesToolParser)
    assert isinstance(tool_parser_for(_Template("{{ tools }} <tool_call>")), HermesToolParser)
    assert isinstance(
        tool_parser_for(_Template("{{ tools }} <|python_tag|>")), Llama3JsonToolParser
    )


def _body(**fields) -> dict:
    tool = {
        "type": "function",
        "function": {"name": "get_weather", "parameters": WEATHER.parameters},
    }
    return {
        "model": "m",
        "messages": [{"role": "user", "content": "Weather?"}],
        "tools": [tool],
    } | fields


def test_a_request_with_tools_becomes_a_call_with_its_tools_and_tool_turns():
    messages = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
    ]
    call = ChatCompletionRequest.model_validate(
        _body(messages=messages, tool_choice="auto")
    ).generate_call()
    assert call.tools == (FunctionTool("get_weather", None, WEATHER.parameters),)
    assert call.messages[1] == ChatTurn(
        "assistant", "", (ToolCall("c1", "get_weather", '{"city": "Oslo"}'),)
    )
    assert call.messages[2] == ChatTurn("tool", "sunny", tool_call_id="c1")


@pytest.mark.parametrize(
    "fields, words",
    [
        ({"tools": [{"type": "function", "function": {"name": "f"}}] * 2}, "'f' repeats"),
        (
            {"tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "'nope' is not among",
        ),
        ({"tools": None, "tool_choice": "auto"}, "tool_choice: it needs tools"),
        (
            {"tool_choice": "required", "response_format": {"type": "json_object"}},
            "give one of them",
        ),
        ({"messages": [{"role": "tool", "content": "x"}]}, "tool_call_id"),
        ({"messages": [{"role": "user", "content": None}]}, "needs content"),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [
                            {
                                "id": "c",
                                "type": "function",
                                "function": {"name": "f", "arguments": "[1]"},
                            }
                        ],
                    },
                    {"role": "user", "content": "x"},
                ]
            },
            "not a JSON object",
        ),
    ],
)
def test_bad_tool_requests_are_refused_naming_the_field(fields, words):
    with pytest.raises(InvalidRequestError, match=words):
        ChatCompletionRequest.model_validate(_body(**fields)).generate_call()


# --- Over HTTP, with the openai client ---------------------------------------------------------


@dataclass
class _ScriptedCoordinator:
    """Answers every Generate with `output`, a few characters a chunk."""

    output: str
    tokenizer: object = field(default_factory=_NoTemplate)
    config: CoordinatorConfig = field(default_factory=CoordinatorConfig)

    async def generate(self, call, tenant, request_id):
        for start in range(0, len(self.output), 7):
            text = self.output[start : start + 7]
            yield OutputChunk(text, tuple(ord(c) for c in text))
        yield GenerateSummary(
            finish_reason="stop", num_tokens=len(self.output), rounds=1, accepted_per_round=(),
            link_bytes=0, store_bytes=0, link_wait_s=0.0, store_wait_s=0.0, ttft_s=0.0,
            tokens_per_s=0.0, total_s=0.0, seed=None, prompt_tokens=3,
        )  # fmt: skip


@pytest.fixture
def oai_over():
    openai = pytest.importorskip("openai")
    from fastapi.testclient import TestClient

    from vericache.serve.front.auth import Access
    from vericache.serve.front.openai_api import openai_app

    def client(output: str):
        app = openai_app(_ScriptedCoordinator(output), Access(), "m")
        http = TestClient(app)
        return openai.OpenAI(base_url="http://testserver/v1", api_key="k", http_client=http)

    return client


WEATHER_TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": WEATHER.parameters},
}


def _ask(client, stream: bool = False, **fields):
    return client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Weather?"}], tools=[WEATHER_TOOL],
        stream=stream, **fields,
    )  # fmt: skip


def test_a_whole_reply_gives_the_calls_as_openai_does(oai_over):
    reply = _ask(oai_over(HERMES_OUTPUT))
    (choice,) = reply.choices
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me look."
    called = [
        (c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls
    ]
    assert called == [("get_weather", {"city": "Oslo"}), ("get_weather", {"city": "Rome"})]
    assert all(c.type == "function" and c.id for c in choice.message.tool_calls)
    one = _ask(oai_over(HERMES_OUTPUT), parallel_tool_calls=False).choices[0].message.tool_calls
    assert [json.loads(c.function.arguments) for c in one] == [{"city": "Oslo"}]


def test_a_streamed_reply_gives_the_same_calls(oai_over):
    whole = _ask(oai_over(HERMES_OUTPUT)).choices[0].message
    content, calls, finish = "", {}, None
    for chunk in _ask(oai_over(HERMES_OUTPUT), stream=True):
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for call in delta.tool_calls or ():
                calls.setdefault(call.index, [call.function.name, ""])
                calls[call.index][1] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    assert finish == "tool_calls" and content.strip() == whole.content
    assert [tuple(calls[i]) for i in sorted(calls)] == [
        (c.function.name, c.function.arguments) for c in whole.tool_calls
    ]


def test_tool_choice_none_and_text_replies_stay_text(oai_over):
    kept = _ask(oai_over(HERMES_OUTPUT), tool_choice="none").choices[0]
    assert kept.message.content == HERMES_OUTPUT and not kept.message.tool_calls
    assert kept.finish_reason == "stop"
    text = _ask(oai_over("It is sunny.")).choices[0]
    assert text.message.content == "It is sunny." and text.finish_reason == "stop"


def test_n_choices_come_whole_and_interleaved_in_the_stream_each_with_its_index(oai_over):
    client = oai_over("It is sunny.")
    whole = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Weather?"}], n=3
    )
    assert [(c.index, c.message.content) for c in whole.choices] == [
        (i, "It is sunny.") for i in range(3)
    ]
    assert whole.usage.completion_tokens == 3 * len("It is sunny.")
    assert whole.usage.prompt_tokens == 3  # the prompt once
    chunks = list(
        client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "Weather?"}],
            n=3,
            stream=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
    )
    texts = {i: "" for i in range(3)}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == {i: "It is sunny." for i in range(3)}
    assert chunks[-1].usage == whole.usage


def test_a_required_or_named_choice_is_a_grammar_of_calls():
    two = [
        {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER.parameters}},
        {"type": "function", "function": {"name": "get_time"}},
    ]
    required = ChatCompletionRequest.model_validate(_body(tools=two, tool_choice="required"))
    constraint = required.generate_call().constraint
    assert constraint.kind == "lark" and "<tool_call>" in constraint.spec
    assert '"get_weather"' in constraint.spec and '"get_time"' in constraint.spec
    assert "block (" in constraint.spec  # parallel calls: one or more blocks
    grammar_of(constraint)  # it compiles
    named = ChatCompletionRequest.model_validate(
        _body(
            tools=two,
            tool_choice={"type": "function", "function": {"name": "get_time"}},
            parallel_tool_calls=False,
        )
    )
    spec = named.generate_call(Llama3JsonToolParser()).constraint.spec
    assert '"get_time"' in spec and '"get_weather"' not in spec and '"parameters"' in spec
    assert "start: block\n" in spec  # one call
    assert (
        ChatCompletionRequest.model_validate(_body(tool_choice="auto")).generate_call().constraint
        is None
    )
