"""What agents use of the OpenAI API, against a running server: tools in the conversation and the
reply, structured outputs, forced calls and `n` choices, every mode giving full_local's tokens;
and agents' clients, the openai client and langchain-openai's `ChatOpenAI` (`bind_tools`,
`with_structured_output`), on a BFCL case and on a JSON-schema case. A call parses and validates
against its function's schema, VeriCache's call is full_local's token for token, and a streamed
call is the whole one."""

from __future__ import annotations

import json

import pytest

from tests.serve_fixtures import CONTEXT, http_url, openai_server_fixture
from tests.serve_fixtures import SERVED_MODEL as MODEL
from tests.test_serve_openai import _messages
from vericache.bench.workloads import bfcl_tool_cases
from vericache.client import Client
from vericache.serve.api_types import FunctionTool
from vericache.serve.front.tools import render_catalogue

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
SYSTEM = "You call functions."
FORECAST = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def case():
    return bfcl_tool_cases("simple_python", 1)[0]


server = openai_server_fixture("agents")


@pytest.fixture(scope="module")
def grpc_client(server):
    with Client(server.target, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def served(server, grpc_client, case):
    """The API's address, the prefix of the case's system turn (its catalogue in it, as tools
    render it), and that of the system turn alone."""
    tools = [FunctionTool(**t["function"]) for t in case.tools]
    with_tools = grpc_client.put_prefix(
        f"{SYSTEM}\n\n{render_catalogue(tools)}", compressor="streamingllm", ratio=4
    )
    plain = grpc_client.put_prefix(SYSTEM, compressor="streamingllm", ratio=4)
    return f"{http_url(server)}/v1", with_tools, plain


@pytest.fixture(scope="module")
def prefix_id(grpc_client) -> str:
    """A prefix of CONTEXT, the system turn of `_messages`."""
    return grpc_client.put_prefix(CONTEXT, compressor="streamingllm", ratio=4)


@pytest.fixture(scope="module")
def oai(served):
    with openai.OpenAI(base_url=served[0], api_key="unused", max_retries=0) as client:
        yield client


def _case_messages(case) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": case.question}]


def _options(prefix_id: str, mode: str) -> dict:
    return {"vericache": {"mode": mode, "prefix_id": prefix_id, "draft_len": 4}}


def _valid(call_name: str, arguments: dict, case) -> None:
    (tool,) = [t["function"] for t in case.tools if t["function"]["name"] == call_name]
    jsonschema.validate(arguments, tool["parameters"])


def test_the_openai_client_gets_a_valid_call_equal_in_every_mode(oai, served, case):
    def ask(mode: str, stream: bool = False):
        return oai.chat.completions.create(
            model=MODEL, messages=_case_messages(case), tools=list(case.tools),
            tool_choice="required", temperature=0, max_tokens=96, stream=stream,
            extra_body=_options(served[1], mode) | {"return_token_ids": True},
        )  # fmt: skip

    reference = ask("full_local").choices[0]
    vericache = ask("vericache").choices[0]
    assert vericache.model_extra["token_ids"] == reference.model_extra["token_ids"]
    assert reference.finish_reason == "tool_calls"
    (call,) = reference.message.tool_calls[:1]
    _valid(call.function.name, json.loads(call.function.arguments), case)
    streamed = {}
    for chunk in ask("vericache", stream=True):
        for delta_call in chunk.choices[0].delta.tool_calls or () if chunk.choices else ():
            entry = streamed.setdefault(delta_call.index, ["", ""])
            entry[0] += delta_call.function.name or ""
            entry[1] += delta_call.function.arguments or ""
    whole = [(c.function.name, c.function.arguments) for c in vericache.message.tool_calls]
    assert [tuple(streamed[i]) for i in sorted(streamed)] == whole


def test_langchain_bind_tools_gets_the_same_valid_call(oai, served, case):
    chat_openai = pytest.importorskip("langchain_openai").ChatOpenAI

    def model(mode: str):
        return chat_openai(
            model=MODEL, base_url=served[0], api_key="unused", temperature=0, max_tokens=96,
            max_retries=0, extra_body=_options(served[1], mode),
        ).bind_tools(list(case.tools), tool_choice="required")  # fmt: skip

    messages = [("system", SYSTEM), ("human", case.question)]
    reference = model("full_local").invoke(messages)
    vericache = model("vericache").invoke(messages)
    assert reference.tool_calls and vericache.tool_calls
    names_args = [(c["name"], c["args"]) for c in vericache.tool_calls]
    assert names_args == [(c["name"], c["args"]) for c in reference.tool_calls]
    _valid(*names_args[0], case)
    chunks = list(model("vericache").stream(messages))
    merged = chunks[0]
    for chunk in chunks[1:]:
        merged = merged + chunk
    assert [(c["name"], c["args"]) for c in merged.tool_calls] == names_args
    # The openai client's call is the same call.
    direct = oai.chat.completions.create(
        model=MODEL, messages=_case_messages(case), tools=list(case.tools), tool_choice="required",
        temperature=0, max_tokens=96, extra_body=_options(served[1], "vericache"),
    ).choices[0].message.tool_calls[0]  # fmt: skip
    assert (direct.function.name, json.loads(direct.function.arguments)) == names_args[0]


def test_langchain_structured_output_follows_the_schema_in_every_mode(served):
    chat_openai = pytest.importorskip("langchain_openai").ChatOpenAI
    messages = [("system", SYSTEM), ("human", "The forecast for Oslo, as JSON.")]

    def structured(mode: str):
        model = chat_openai(
            model=MODEL, base_url=served[0], api_key="unused", temperature=0, max_tokens=64,
            max_retries=0, extra_body=_options(served[2], mode),
        )  # fmt: skip
        schema = {"title": "forecast", "description": "A forecast request."} | FORECAST
        return model.with_structured_output(schema, method="json_schema").invoke(messages)

    reference = structured("full_local")
    jsonschema.validate(reference, FORECAST)
    assert structured("vericache") == reference


# --- Tools, structured outputs and choices, served ---------------------------------------------


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


@pytest.mark.parametrize("mode", ["vericache", "full_remote"])
def test_a_conversation_with_tools_decodes_as_full_local_does(oai, grpc_client, mode):
    # The catalogue goes into the system turn (the default format: the embedded template renders
    # no tools), so the prefix registered for that turn's text holds it; tool calls and results
    # go into the history. Every mode reads the same prompt.
    system = "You answer with tools."
    function = WEATHER_TOOL["function"]
    tool = FunctionTool(function["name"], function["description"], function["parameters"])
    prefix_id = grpc_client.put_prefix(
        f"{system}\n\n{render_catalogue([tool])}", compressor="streamingllm", ratio=4
    )
    messages = [
        {"role": "system", "content": system},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
        }]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]  # fmt: skip

    def reply(mode: str, **fields):
        options = {"mode": mode, "draft_len": 4, "prefix_id": prefix_id}
        return oai.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=16, temperature=0, **fields,
            extra_body={"vericache": options, "return_token_ids": True},
        )  # fmt: skip

    reference = reply("full_local", tools=[WEATHER_TOOL])
    served = reply(mode, tools=[WEATHER_TOOL])
    assert (
        served.choices[0].model_extra["token_ids"] == reference.choices[0].model_extra["token_ids"]
    )
    got, expected = served.choices[0].message, reference.choices[0].message
    assert got.content == expected.content  # and any calls, but for their fresh ids
    assert [c.function for c in got.tool_calls or ()] == [
        c.function for c in expected.tool_calls or ()
    ]
    assert served.usage.prompt_tokens_details.cached_tokens > 0  # the catalogue's prefix
    with pytest.raises(openai.BadRequestError, match="system turn is not the text of prefix"):
        reply("full_local")  # without the tools the system turn is another text


def test_n_choices_are_the_requests_seeded_one_after_another(oai, prefix_id):
    options = {
        "model": MODEL, "messages": _messages(), "max_tokens": 12, "temperature": 0.8,
        "extra_body": {"vericache": {"prefix_id": prefix_id, "draft_len": 4},
                       "return_token_ids": True},
    }  # fmt: skip
    reply = oai.chat.completions.create(**options, n=3, seed=9)
    alone = [oai.chat.completions.create(**options, seed=9 + i).choices[0] for i in range(3)]
    assert [c.index for c in reply.choices] == [0, 1, 2]
    for i, (choice, single) in enumerate(zip(reply.choices, alone)):
        assert choice.model_extra["token_ids"] == single.model_extra["token_ids"]
        assert choice.model_extra["vericache"]["seed"] == 9 + i
    assert reply.usage.completion_tokens == sum(len(c.model_extra["token_ids"]) for c in alone)
    chunks = list(
        oai.chat.completions.create(
            **options, n=3, seed=9, stream=True, stream_options={"include_usage": True}
        )
    )
    streamed = {i: "" for i in range(3)}
    finished = []
    for chunk in chunks:
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished.append(choice.index)
    assert sorted(finished) == [0, 1, 2]
    assert [streamed[i] for i in range(3)] == [c.message.content for c in reply.choices]
    tokens = {"prompt_tokens_details"}  # cached: more where a kept turn served it (turn_cache.py)
    assert chunks[-1].usage.model_dump(exclude=tokens) == reply.usage.model_dump(exclude=tokens)


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.9, "seed": 4}])
def test_a_json_schema_reply_is_constrained_full_decodings_in_every_mode(oai, prefix_id, sampling):
    response_format = {
        "type": "json_schema", "json_schema": {"name": "forecast", "schema": FORECAST},
    }  # fmt: skip

    def reply(mode: str | None, stream: bool = False):
        options = {"prefix_id": prefix_id, "draft_len": 4} | ({"mode": mode} if mode else {})
        return oai.chat.completions.create(
            model=MODEL, messages=_messages("The forecast as JSON."), max_tokens=40,
            response_format=response_format, stream=stream, **sampling,
            extra_body={"vericache": options, "return_token_ids": True},
        )  # fmt: skip

    reference = reply("full_local").choices[0]
    for mode in ("vericache", "full_remote", None):  # None: the server's auto
        served = reply(mode).choices[0]
        assert served.model_extra["token_ids"] == reference.model_extra["token_ids"], mode
    streamed = "".join(
        c.choices[0].delta.content or "" for c in reply("vericache", True) if c.choices
    )
    assert streamed == reference.message.content
    if reference.finish_reason == "stop":  # the document ended before the budget
        value = json.loads(reference.message.content)
        assert set(value) == {"city", "days"} and 1 <= value["days"] <= 9
    else:
        assert reference.message.content.startswith("{")
    lossy = reply("lossy").choices[0]  # lossy too is held to the grammar
    assert lossy.message.content.startswith("{")


def test_a_schema_that_does_not_compile_is_a_400(oai, prefix_id):
    bad = {"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "objectx"}}}
    with pytest.raises(openai.BadRequestError, match="objectx"):
        oai.chat.completions.create(
            model=MODEL, messages=_messages(), max_tokens=4, response_format=bad,
            extra_body={"vericache": {"prefix_id": prefix_id}},
        )  # fmt: skip


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_a_forced_tool_call_is_a_valid_call_and_full_decodings(oai, grpc_client, choice):
    weather = WEATHER_TOOL | {"function": WEATHER_TOOL["function"] | {"parameters": FORECAST}}
    function = weather["function"]
    tool = FunctionTool(function["name"], function["description"], function["parameters"])
    system = "You answer with tools."
    prefix_id = grpc_client.put_prefix(
        f"{system}\n\n{render_catalogue([tool])}", compressor="streamingllm", ratio=4
    )
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Oslo?"}]

    def reply(mode: str):
        options = {"mode": mode, "prefix_id": prefix_id, "draft_len": 4}
        return oai.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=64, temperature=0, tools=[weather],
            tool_choice=choice, parallel_tool_calls=False,
            extra_body={"vericache": options, "return_token_ids": True},
        ).choices[0]  # fmt: skip

    reference = reply("full_local")
    print(
        "FORCED",
        reference.finish_reason,
        repr(reference.message.content),
        reference.message.tool_calls,
    )
    assert reply("vericache").model_extra["token_ids"] == reference.model_extra["token_ids"]
    if reference.finish_reason == "length":  # the budget cut the call: what came is its start
        assert reference.message.content.startswith("<tool_call>")
        return
    assert reference.finish_reason == "tool_calls"
    (call,) = reference.message.tool_calls
    arguments = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and set(arguments) == {"city", "days"}
    assert 1 <= arguments["days"] <= 9
