"""`logprobs` and `top_logprobs` (chat) and `logprobs: k` (completions) on the OpenAI API, against
a running server: every mode reports full_local's values, whole and streamed, greedy, seeded and
under a JSON schema; the shapes are OpenAI's (the openai client reads them); bad bounds are 400s
naming the field."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import httpx
import pytest

from tests.serve_fixtures import SERVED_MODEL as MODEL
from tests.serve_fixtures import http_url, start_openai_server
from tests.test_openai_agents import FORECAST
from tests.test_serve_openai import _messages
from vericache.client import Client

openai = pytest.importorskip("openai")
CONTEXT = "You answer in short sentences. Python is a programming language."


@dataclass(frozen=True)
class Api:
    url: str  # the OpenAI API's base URL
    client: object  # the openai client on it
    prefix_id: str  # a prefix of CONTEXT, the system turn of `_messages_here`


@pytest.fixture(scope="module")
def api(tiny_chat_checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("logprobs")
    with start_openai_server(tiny_chat_checkpoint, root) as server:
        url = f"{http_url(server)}/v1"
        with Client(server.target, timeout=120) as grpc_client:
            prefix_id = grpc_client.put_prefix(CONTEXT, compressor="streamingllm", ratio=4)
        with openai.OpenAI(base_url=url, api_key="unused", max_retries=0) as client:
            yield Api(url, client, prefix_id)


def _messages_here() -> list[dict]:
    return [{"role": "system", "content": CONTEXT}, {"role": "user", "content": "What is it?"}]


def _chat(api: Api, mode: str, stream: bool = False, **options):
    return api.client.chat.completions.create(
        model=MODEL, messages=_messages_here(), max_tokens=16, logprobs=True,
        stream=stream, **{"top_logprobs": 3} | options,
        extra_body={"vericache": {"mode": mode, "prefix_id": api.prefix_id, "draft_len": 4}},
    )  # fmt: skip


def _entries(content) -> list[dict]:
    return [entry.model_dump() for entry in content]


CASES = {
    "greedy": {"temperature": 0},
    "seeded": {"temperature": 0.9, "seed": 7, "presence_penalty": 0.5},
    "json_schema": {
        "temperature": 0,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "f", "schema": FORECAST},
        },
    },
}


@pytest.mark.parametrize("case", list(CASES))
def test_every_mode_reports_full_decodings_logprobs(api, case):
    options = CASES[case]
    reference = _chat(api, "full_local", **options).choices[0]
    content = reference.logprobs.content
    # Each token reported, the end token included (as vLLM reports it), text as it decodes.
    assert "".join(entry.token for entry in content).startswith(reference.message.content)
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.bytes == list(entry.token.encode())
        if options["temperature"] == 0:  # the chosen token is the most likely one
            assert entry.top_logprobs[0].token == entry.token
            assert entry.top_logprobs[0].logprob == entry.logprob
    for mode in ("vericache", "full_remote"):
        served = _chat(api, mode, **options).choices[0]
        assert served.message.content == reference.message.content, mode
        assert _entries(served.logprobs.content) == _entries(content), mode
    streamed = []
    for chunk in _chat(api, "vericache", stream=True, **options):
        for choice in chunk.choices:
            if choice.logprobs is not None:
                streamed += choice.logprobs.content
    assert _entries(streamed) == _entries(content)


def test_a_grammar_masks_what_it_forbids(api):
    """Under a JSON schema the first token must open the object: the few tokens that do share
    all the probability, every other one is masked (-inf, reported as vLLM's -9999.0)."""
    options = CASES["json_schema"] | {"top_logprobs": 20}
    reply = _chat(api, "vericache", **options).choices[0]
    alternatives = reply.logprobs.content[0].top_logprobs
    admitted = [top for top in alternatives if top.logprob > -9999.0]
    assert 0 < len(admitted) < len(alternatives) == 20
    assert all(top.token.startswith("{") for top in admitted)
    assert sum(math.exp(top.logprob) for top in admitted) == pytest.approx(1, abs=1e-4)


def test_completions_report_tokens_offsets_and_alternatives(api):
    body = {
        "model": MODEL, "prompt": "Python is", "max_tokens": 10, "temperature": 0,
        "logprobs": 2, "vericache": {"prefix_id": api.prefix_id, "mode": "vericache"},
    }  # fmt: skip
    whole = httpx.post(f"{api.url}/completions", json=body, timeout=120).json()["choices"][0]
    logprobs = whole["logprobs"]
    assert "".join(logprobs["tokens"]) == whole["text"]
    offsets = [sum(len(t) for t in logprobs["tokens"][:i]) for i in range(len(logprobs["tokens"]))]
    assert logprobs["text_offset"] == offsets
    for token, value, top in zip(
        logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"]
    ):
        assert top[token] == value == max(top.values()) and len(top) == 2
    reference = httpx.post(
        f"{api.url}/completions",
        json=body | {"vericache": {"prefix_id": api.prefix_id, "mode": "full_local"}},
        timeout=120,
    ).json()["choices"][0]
    assert reference["logprobs"] == logprobs
    with httpx.stream(
        "POST", f"{api.url}/completions", json=body | {"stream": True}, timeout=120
    ) as reply:
        chunks = [
            json.loads(line.removeprefix("data: "))
            for line in reply.iter_lines()
            if line.startswith("data: {")
        ]
    streamed = {key: [] for key in logprobs}
    for chunk in chunks:
        for choice in chunk["choices"]:
            for key, values in (choice["logprobs"] or {}).items():
                streamed[key] += values
    assert streamed == logprobs


def test_no_logprobs_unless_asked(api):
    reply = api.client.chat.completions.create(
        model=MODEL, messages=_messages_here(), max_tokens=4,
        extra_body={"vericache": {"prefix_id": api.prefix_id}},
    )  # fmt: skip
    assert reply.choices[0].logprobs is None


@pytest.mark.parametrize(
    ("path", "fields", "named"),
    [
        ("chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("chat/completions", {"top_logprobs": 2}, "top_logprobs"),
        ("completions", {"logprobs": 21}, "logprobs"),
    ],
)
def test_bad_bounds_are_400s_naming_the_field(api, path, fields, named):
    body = {"model": MODEL, "max_tokens": 2} | fields
    body |= {"messages": _messages()} if path.startswith("chat") else {"prompt": "Hi"}
    reply = httpx.post(f"{api.url}/{path}", json=body, timeout=60)
    assert reply.status_code == 400
    assert named in reply.json()["error"]["message"]
