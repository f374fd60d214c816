"""The OpenAI-compatible HTTP API against a running server: the official openai client (sync, async,
streaming), raw HTTP for the SSE framing and the error shapes, outputs equal to gRPC Generate's
token for token, API keys and tenants, health and metrics, and a client that goes away."""

from __future__ import annotations

import asyncio
import json
import logging
import re

import httpx
import pytest

from tests.serve_fixtures import (
    CONTEXT,
    a_tenth_of_its_time,
    http_url,
    open_sessions,
    openai_server_fixture,
    start_openai_server,
    wait_for,
)
from tests.serve_fixtures import SERVED_MODEL as MODEL
from tests.test_serve_auth import KEY_A, KEY_B, keys_file
from vericache.client import Client
from vericache.serve.front.auth import Access

openai = pytest.importorskip("openai")

PROMPT = "Which function multiplies by three?"


server = openai_server_fixture("openai")


@pytest.fixture(scope="module")
def base_url(server) -> str:
    return http_url(server)


@pytest.fixture(scope="module")
def prefix_id(server) -> str:
    with Client(server.target, timeout=120) as client:
        return client.put_prefix(CONTEXT, compressor="streamingllm", ratio=4)


@pytest.fixture(scope="module")
def grpc_client(server):
    with Client(server.target, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def oai(base_url):
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0) as client:
        yield client


def _messages(prompt: str = PROMPT) -> list[dict]:
    return [{"role": "system", "content": CONTEXT}, {"role": "user", "content": prompt}]


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.7, "seed": 3}])
@pytest.mark.parametrize("mode", ["vericache", "full_local"])
def test_chat_completions_equal_grpc_generate(oai, grpc_client, prefix_id, mode, sampling):
    reply = oai.chat.completions.create(
        model=MODEL, messages=_messages(), max_tokens=24, **sampling,
        extra_body={
            "vericache": {"mode": mode, "prefix_id": prefix_id, "draft_len": 4},
            "return_token_ids": True,
        },
    )  # fmt: skip
    reference = grpc_client.generate(
        PROMPT, prefix_id=prefix_id, mode="full_local", max_tokens=24, **sampling
    )
    (choice,) = reply.choices
    assert choice.model_extra["token_ids"] == list(reference.token_ids)  # token for token
    assert choice.message.content == reference.text
    assert choice.message.role == "assistant"
    assert choice.finish_reason == reference.finish_reason
    assert reply.usage.completion_tokens == len(reference.token_ids)
    assert reply.usage.prompt_tokens == reference.stats["prompt_tokens"] > 0
    vericache = reply.model_extra["vericache"]
    assert vericache["seed"] == sampling.get("seed")
    if mode == "vericache":
        assert vericache["rounds"] < 24 and vericache["link_bytes"] > 0
        accepted = vericache["accepted_per_round"]
        assert len(accepted) == vericache["rounds"] and sum(accepted) > 0
        assert max(accepted) <= 4  # the draft_len asked for bounds every round
        # Each round commits its accepted drafts and one token of the verifier's own.
        assert sum(accepted) + len(accepted) <= reply.usage.completion_tokens


def test_stop_strings_and_max_completion_tokens_reach_the_decode(oai, prefix_id):
    options = {"vericache": {"prefix_id": prefix_id, "draft_len": 3}}
    whole = oai.chat.completions.create(
        model=MODEL, messages=_messages(), max_completion_tokens=16, temperature=0,
        extra_body=options,
    )  # fmt: skip
    assert whole.usage.completion_tokens == 16 and whole.choices[0].finish_reason == "length"
    text = whole.choices[0].message.content
    stop = text[len(text) // 2 :][:3]
    stopped = oai.chat.completions.create(
        model=MODEL, messages=_messages(), max_completion_tokens=16, temperature=0, stop=[stop],
        extra_body=options,
    )  # fmt: skip
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].message.content == text[: text.index(stop)]  # the stop left out


def test_a_chat_without_a_prefix_runs_the_whole_conversation(oai):
    messages = [
        {"role": "system", "content": "You answer in one line."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": [{"type": "text", "text": "Another one?"}]},
    ]
    reply = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    again = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    assert reply.usage.completion_tokens == 8 or reply.choices[0].finish_reason == "stop"
    assert reply.choices[0].message.content == again.choices[0].message.content


def test_streamed_chat_gives_the_same_text_and_its_usage_last(oai, prefix_id):
    options = {
        "model": MODEL, "messages": _messages(), "max_tokens": 24, "temperature": 0.8, "seed": 9,
        "extra_body": {"vericache": {"prefix_id": prefix_id, "draft_len": 4}},
    }  # fmt: skip
    whole = oai.chat.completions.create(**options)
    chunks = list(
        oai.chat.completions.create(**options, stream=True, stream_options={"include_usage": True})
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finished = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finished[-1] == whole.choices[0].finish_reason and not any(finished[:-1])
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.model_dump(exclude={"prompt_tokens_details"}) == (
        whole.usage.model_dump(exclude={"prompt_tokens_details"})
    )
    # The stream repeats the whole reply's prompt: where it lands on the worker that kept that
    # turn (turn_cache.py), it reads more of its prompt from cache, never less.
    cached = usage.prompt_tokens_details.cached_tokens
    assert cached >= whole.usage.prompt_tokens_details.cached_tokens
    assert len({c.id for c in chunks}) == 1
    # The finishing chunk carries the vericache block, with or without the usage chunk.
    (finishing,) = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    streamed, reference = finishing.model_extra["vericache"], whole.model_extra["vericache"]
    for name in ("rounds", "accepted_per_round", "seed"):  # link bytes: the drafter had it
        assert streamed[name] == reference[name]


def test_the_async_client_and_completions(base_url, prefix_id):
    """/v1/completions continues text as it is: here after the prefix's system turn."""

    async def run():
        async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="x") as client:
            options = {"model": MODEL, "prompt": "def add(a, b):", "max_tokens": 16}

            def create(mode: str, **more):
                body = {"vericache": {"mode": mode, "prefix_id": prefix_id, "draft_len": 4}}
                return client.completions.create(**options, temperature=0, extra_body=body, **more)

            full, vericache = await asyncio.gather(create("full_local"), create("vericache"))
            stream = await create("vericache", stream=True)
            streamed = "".join([chunk.choices[0].text async for chunk in stream])
            return full, vericache, streamed

    full, vericache, streamed = asyncio.run(run())
    assert full.object == "text_completion" and full.choices[0].text
    assert vericache.choices[0].text == full.choices[0].text == streamed
    assert vericache.model_extra["vericache"]["rounds"] < 16


def test_models_health_and_metrics(oai, base_url):
    assert [model.id for model in oai.models.list()] == [MODEL]
    health = httpx.get(f"{base_url}/health")
    assert health.status_code == 200
    metrics = httpx.get(f"{base_url}/metrics")
    assert metrics.status_code == 200 and "vericache:generation_tokens_total" in metrics.text


def test_health_is_503_in_openai_shape_while_no_worker_of_a_needed_kind_is_up(
    server, base_url, monkeypatch
):
    backend = server.coordinator.backend
    monkeypatch.setattr(backend, "is_serving", lambda: False)
    health = httpx.get(f"{base_url}/health")
    assert health.status_code == 503
    assert health.json()["error"]["type"] == "service_unavailable"
    monkeypatch.undo()
    assert httpx.get(f"{base_url}/health").status_code == 200


def test_streamed_token_ids_are_the_whole_replys(base_url, prefix_id):
    body = {
        "model": MODEL, "messages": _messages(), "max_tokens": 12, "temperature": 0,
        "return_token_ids": True, "vericache": {"prefix_id": prefix_id},
    }  # fmt: skip
    url = f"{base_url}/v1/chat/completions"
    whole = httpx.post(url, json=body, timeout=120).json()["choices"][0]["token_ids"]
    with httpx.stream("POST", url, json=body | {"stream": True}, timeout=120) as reply:
        chunks = [
            json.loads(line.removeprefix("data: "))
            for line in reply.iter_lines()
            if line.startswith("data: {")
        ]
    streamed = [t for chunk in chunks for choice in chunk["choices"] for t in choice["token_ids"]]
    assert len(whole) == 12 and streamed == whole


def test_an_unexpected_failure_is_a_500_in_openai_shape_saying_no_more(
    server, base_url, monkeypatch
):
    def broken(*args, **kwargs):
        raise RuntimeError("an internal detail at /srv/vericache/state, pid 4242")

    monkeypatch.setattr(server.coordinator, "generate", broken)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    reply = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 500
    error = reply.json()["error"]
    assert error["type"] == "api_error" and "request id" in error["message"]
    assert "/srv" not in reply.text and "4242" not in reply.text


def test_server_sent_events_are_framed_as_openai_frames_them(base_url, prefix_id):
    body = {
        "model": MODEL, "messages": _messages(), "max_tokens": 8, "stream": True,
        "temperature": 0, "vericache": {"prefix_id": prefix_id},
    }  # fmt: skip
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body, timeout=120) as reply:
        assert reply.status_code == 200
        assert reply.headers["content-type"].startswith("text/event-stream")
        raw = reply.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    for event in events[:-2]:
        assert event.startswith("data: ") and "\n" not in event
        assert json.loads(event[len("data: ") :])["object"] == "chat.completion.chunk"


@pytest.mark.parametrize(
    ("body", "status", "words"),
    [
        (b"{not json", 400, "not valid JSON"),
        (b"\xff\xff\xff\xff", 400, "not UTF-8"),
        (b'{"model": "\xc3\x28", "messages": []}', 400, "not UTF-8"),
        (b"[1, 2]", 400, "a JSON object"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temprature": 1}, 400,
         "temprature"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": "ten"},
         400, "max_tokens"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 17}, 400, "n"),
        ({"model": MODEL, "messages": []}, 400, "messages"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_p": 0}, 400,
         "top_p"),
        ({"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}, 404, "gpt-4o"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
          "vericache": {"prefix_id": "pfx-" + "0" * 32}}, 404, "prefix"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
          "vericache": {"mode": "lossy"}}, 400, "prefix_id"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
          "vericache": {"ratio": 4}}, 400, "need a compressor"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
          "vericache": {"compressor": "snapkv", "ratio": -1}}, 400, "vericache.ratio"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
          "vericache": {"compressor": "zip", "ratio": 4}}, 400, "zip"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
          "vericache": {"timeout_s": 0}}, 400, "vericache.timeout_s"),
    ],
)  # fmt: skip
def test_errors_have_openai_shape_and_status(base_url, body, status, words):
    payload = {"json": body}
    if isinstance(body, bytes):
        payload = {"content": body, "headers": {"content-type": "application/json"}}
    reply = httpx.post(f"{base_url}/v1/chat/completions", timeout=60, **payload)
    assert reply.status_code == status
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert words in error["message"] and error["code"] == status
    assert re.search(r"\(request id [0-9a-f]{32}\)$", error["message"]), error["message"]
    assert "Traceback" not in error["message"] and "/" not in error["message"]


def test_a_conversation_must_match_its_prefix(oai, prefix_id):
    with pytest.raises(openai.BadRequestError, match="not the text of prefix"):
        oai.chat.completions.create(
            model=MODEL, messages=_messages() [1:], max_tokens=4,
            extra_body={"vericache": {"prefix_id": prefix_id}},
        )  # fmt: skip


def test_a_prefix_must_have_the_compressor_the_request_asks_for(oai, prefix_id):
    with pytest.raises(openai.BadRequestError, match="registered with streamingllm"):
        oai.chat.completions.create(
            model=MODEL, messages=_messages(), max_tokens=4,
            extra_body={"vericache": {"prefix_id": prefix_id, "compressor": "snapkv"}},
        )  # fmt: skip


def test_a_request_past_its_timeout_stops_with_504(server, base_url, prefix_id):
    body = {
        "model": MODEL, "messages": _messages("Go on and on."), "max_tokens": 400,
        "temperature": 0, "vericache": {"prefix_id": prefix_id, "draft_len": 2},
    }  # fmt: skip
    url = f"{base_url}/v1/chat/completions"

    def whole_request():
        assert httpx.post(url, json=body, timeout=120).status_code == 200

    timeout_s = max(round(a_tenth_of_its_time(whole_request), 3), 0.001)  # as the message says it
    body["vericache"]["timeout_s"] = timeout_s
    whole = httpx.post(url, json=body, timeout=120)
    assert whole.status_code == 504
    error = whole.json()["error"]
    assert error["type"] == "timeout" and f"timeout_s of {timeout_s:g} s" in error["message"]
    with httpx.stream("POST", url, json=body | {"stream": True}, timeout=120) as reply:
        if reply.status_code == 504:  # a loaded machine: the deadline came before any token
            reply.read()
            assert reply.json()["error"]["type"] == "timeout"
        else:  # the stream began before the deadline: the deadline ends it with an error event
            assert reply.status_code == 200
            events = [line for line in reply.iter_lines() if line]
            assert events[-1] == "data: [DONE]"
            assert json.loads(events[-2].removeprefix("data: "))["error"]["code"] == 504
    assert wait_for(lambda: open_sessions(server) == 0, timeout_s=30)
    # The tenant's slot frees once the workers' closing calls return (each keeps its turn).
    assert wait_for(lambda: not server.coordinator._num_active, timeout_s=30)


def test_a_client_that_goes_away_stops_its_request(server, base_url, prefix_id):
    body = {
        "model": MODEL, "messages": _messages("Go on and on."), "max_tokens": 400, "stream": True,
        "temperature": 0, "vericache": {"prefix_id": prefix_id, "draft_len": 2},
    }  # fmt: skip
    metrics = server.coordinator.metrics
    labels = {"model_name": metrics.model_name, "finished_reason": "abort"}

    def aborted() -> float:
        return metrics.registry.get_sample_value("vericache:request_success_total", labels) or 0

    before = aborted()
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body, timeout=120) as reply:
        next(reply.iter_lines())  # the stream began
    # Stopped where it was, long before its 400 tokens: its sessions and its tenant slot freed.
    assert wait_for(lambda: aborted() == before + 1, timeout_s=30)
    assert wait_for(lambda: open_sessions(server) == 0, timeout_s=30)
    # The tenant's slot frees once the workers' closing calls return (each keeps its turn).
    assert wait_for(lambda: not server.coordinator._num_active, timeout_s=30)


@pytest.fixture(scope="module")
def keyed(tiny_chat_checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("openai-keys")
    access = Access(api_keys=keys_file(root / "keys.json"))
    with start_openai_server(tiny_chat_checkpoint, root, access=access) as s:
        yield s


def test_api_keys_and_tenants(keyed):
    url = f"{http_url(keyed)}/v1"
    for key in (None, "not-a-key-of-anyone"):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        reply = httpx.get(f"{url}/models", headers=headers)
        assert reply.status_code == 401 and reply.json()["error"]["type"] == "authentication_error"
        # The key is checked first: a caller without one learns nothing of the body or model.
        for body in (b"{not json", b'{"model": "gpt-4o", "messages": []}'):
            reply = httpx.post(f"{url}/chat/completions", content=body, headers=headers)
            assert reply.status_code == 401, reply.text
            assert "gpt-4o" not in reply.text
    with Client(keyed.target, api_key=KEY_A, timeout=120) as client:
        a_prefix = client.put_prefix(CONTEXT, compressor="streamingllm", ratio=4)
    as_b = openai.OpenAI(base_url=url, api_key=KEY_B, max_retries=0)
    with pytest.raises(openai.NotFoundError):  # tenant a's prefix does not exist for b
        as_b.chat.completions.create(
            model=MODEL, messages=_messages(), max_tokens=4,
            extra_body={"vericache": {"prefix_id": a_prefix}},
        )  # fmt: skip
    as_a = openai.OpenAI(base_url=url, api_key=KEY_A, max_retries=0)
    reply = as_a.chat.completions.create(
        model=MODEL, messages=_messages(), max_tokens=4, temperature=0,
        extra_body={"vericache": {"prefix_id": a_prefix}},
    )  # fmt: skip
    assert reply.usage.completion_tokens == 4
    with pytest.raises(openai.RateLimitError):  # a's limit: 16 output tokens
        as_a.chat.completions.create(model=MODEL, messages=_messages(), max_tokens=64)
    assert wait_for(lambda: open_sessions(keyed) == 0)


def test_refusals_are_logged_with_the_tenant_and_request_id(keyed, caplog):
    url = f"{http_url(keyed)}/v1/chat/completions"
    headers = {"Authorization": f"Bearer {KEY_A}", "content-type": "application/json"}
    with caplog.at_level(logging.INFO, logger="vericache.serve"):
        bad = httpx.post(url, content=b"\xff\xff", headers=headers, timeout=60)
        anonymous = httpx.post(url, content=b"{}", timeout=60)
    assert bad.status_code == 400 and anonymous.status_code == 401
    for reply, tenant in ((bad, "a"), (anonymous, None)):
        request_id = reply.json()["error"]["message"][-33:-1]
        (line,) = [r for r in caplog.records if getattr(r, "request_id", None) == request_id]
        assert line.tenant == tenant and f"refused for tenant {tenant!r}" in line.getMessage()
