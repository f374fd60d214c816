"""Agents' clients against the OpenAI API: the openai client and langchain-openai's `ChatOpenAI`
(`bind_tools`, `with_structured_output`) on a BFCL case and on a JSON-schema case. The call
parses and validates against its function's schema, VeriCache's call is full_local's token for
token, and a streamed call is the whole one."""

from __future__ import annotations

import json

import pytest

from tests.serve_fixtures import SERVED_MODEL as MODEL
from tests.serve_fixtures import start_server
from vericache.bench.workloads import bfcl_tool_cases
from vericache.client import Client
from vericache.serve.api_types import FunctionTool
from vericache.serve.front.tools import render_catalogue
from vericache.serve.launch.server import HttpSettings

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


@pytest.fixture(scope="module")
def served(tiny_chat_checkpoint, tmp_path_factory, case):
    """A server, the prefix of the case's system turn (its catalogue in it, as tools render
    it), and that of the system turn alone."""
    root = tmp_path_factory.mktemp("agents")
    with start_server(tiny_chat_checkpoint, root, http=HttpSettings(0, MODEL)) as server:
        tools = [FunctionTool(**t["function"]) for t in case.tools]
        with Client(server.target, timeout=120) as client:
            with_tools = client.put_prefix(
                f"{SYSTEM}\n\n{render_catalogue(tools)}", compressor="streamingllm", ratio=4
            )
            plain = client.put_prefix(SYSTEM, compressor="streamingllm", ratio=4)
        yield f"http://{server.host}:{server.http_port}/v1", with_tools, plain


@pytest.fixture(scope="module")
def oai(served):
    with openai.OpenAI(base_url=served[0], api_key="unused", max_retries=0) as client:
        yield client


def _messages(case) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": case.question}]


def _options(prefix_id: str, mode: str) -> dict:
    return {"vericache": {"mode": mode, "prefix_id": prefix_id, "draft_len": 4}}


def _valid(call_name: str, arguments: dict, case) -> None:
    (tool,) = [t["function"] for t in case.tools if t["function"]["name"] == call_name]
    jsonschema.validate(arguments, tool["parameters"])


def test_the_openai_client_gets_a_valid_call_equal_in_every_mode(oai, served, case):
    def ask(mode: str, stream: bool = False):
        return oai.chat.completions.create(
            model=MODEL, messages=_messages(case), tools=list(case.tools), tool_choice="required",
            temperature=0, max_tokens=96, stream=stream,
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
        model=MODEL, messages=_messages(case), tools=list(case.tools), tool_choice="required",
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
