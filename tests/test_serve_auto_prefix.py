"""Automatic prefix caching in the served system: requests that name no prefix use their tenant's
matching one (chat system turns over HTTP, leading tokens over gRPC), counted with vLLM's metric
names; system turns sent twice register themselves, least recently used evicted; and another
tenant's prefixes are never matched."""

from __future__ import annotations

import httpx
import pytest

from tests.serve_fixtures import CONTEXT, http_url, start_openai_server, wait_for
from tests.serve_fixtures import SERVED_MODEL as MODEL
from tests.test_serve_auth import KEY_A, KEY_B, keys_file
from vericache.client import Client, InvalidRequestError
from vericache.engine.prompt import build_chat_prompt
from vericache.serve.config import CoordinatorConfig
from vericache.serve.front.auth import Access

PROMPT = "Which function multiplies by three?"
MIN_TOKENS = 40


@pytest.fixture(scope="module")
def server(tiny_chat_checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("auto-prefix")
    config = CoordinatorConfig(auto_prefix_min_tokens=MIN_TOKENS, auto_prefix_max_per_tenant=1)
    access = Access(api_keys=keys_file(root / "keys.json"))
    with start_openai_server(tiny_chat_checkpoint, root, config=config, access=access) as running:
        yield running


def _counts(server) -> tuple[float, float]:
    metrics = server.coordinator.metrics
    labels = {"model_name": metrics.model_name}
    get = metrics.registry.get_sample_value
    return (
        get("vericache:prefix_cache_queries_total", labels),
        get("vericache:prefix_cache_hits_total", labels),
    )


def _chat(server, key: str, system: str, **vericache) -> dict:
    body = {
        "model": MODEL, "max_tokens": 12, "temperature": 0,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": PROMPT}],
    }  # fmt: skip
    if vericache:
        body["vericache"] = vericache
    url = f"{http_url(server)}/v1/chat/completions"
    reply = httpx.post(url, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_a_chat_whose_system_turn_is_registered_uses_it_unnamed(server):
    with Client(server.target, api_key=KEY_A, timeout=120) as client:
        prefix_id = client.put_prefix(CONTEXT, compressor="streamingllm", ratio=4)
        num_prefix_tokens = client.get_prefix(prefix_id).num_tokens
    named = _chat(server, KEY_A, CONTEXT, prefix_id=prefix_id, mode="vericache")
    queries, hits = _counts(server)
    unnamed = _chat(server, KEY_A, CONTEXT, mode="vericache")
    assert unnamed["choices"] == named["choices"]
    assert unnamed["vericache"]["rounds"] < 12  # VERICACHE rounds over the prefix it found
    after_queries, after_hits = _counts(server)
    assert after_hits - hits == num_prefix_tokens
    assert after_queries - queries == unnamed["usage"]["prompt_tokens"]


def test_grpc_generate_without_a_prefix_id_matches_leading_tokens(server):
    tokenizer = server.coordinator.tokenizer
    leading = build_chat_prompt(tokenizer, None, PROMPT).token_ids[:-3]
    with Client(server.target, api_key=KEY_A, timeout=120) as client:
        client.put_prefix(token_ids=leading, compressor="streamingllm", ratio=2)
        _, hits = _counts(server)
        found = client.generate(PROMPT, max_tokens=12, mode="vericache")
        reference = client.generate(PROMPT, max_tokens=12, mode="full_local")
    assert found.token_ids == reference.token_ids
    assert found.stats["rounds"] < 12 and found.stats["link_bytes"] > 0  # drafted remotely
    assert _counts(server)[1] - hits == 2 * len(leading)  # both requests found it


def test_another_tenants_prefix_is_never_matched(server):
    with Client(server.target, api_key=KEY_A, timeout=120) as client:
        client.put_prefix(CONTEXT, compressor="streamingllm", ratio=4)
    _, hits = _counts(server)
    as_b = _chat(server, KEY_B, CONTEXT)
    assert _counts(server)[1] == hits
    assert as_b["vericache"]["rounds"] == 12  # decoded alone over the full KV: full_local


def test_a_system_turn_sent_twice_registers_itself_and_the_oldest_goes(server):
    def system(topic: str) -> str:
        return f"You answer questions about {topic}. " + "Be brief and precise. " * 12

    with Client(server.target, api_key=KEY_B, timeout=120) as client:
        before = {p.prefix_id for p in client.list_prefixes()}
        _chat(server, KEY_B, system("lists"))
        _chat(server, KEY_B, system("lists"))  # the second sighting: registered in background
        assert wait_for(lambda: len(client.list_prefixes()) == len(before) + 1, timeout_s=60)
        (first,) = {p.prefix_id for p in client.list_prefixes()} - before
        _, hits = _counts(server)
        assert _chat(server, KEY_B, system("lists"), mode="vericache")["vericache"]["rounds"] < 12
        assert _counts(server)[1] > hits
        # One automatic prefix per tenant here: the next one takes its place.
        _chat(server, KEY_B, system("dicts"))
        _chat(server, KEY_B, system("dicts"))
        assert wait_for(
            lambda: (
                first not in {p.prefix_id for p in client.list_prefixes()}
                and len(client.list_prefixes()) == len(before) + 1
            ),
            timeout_s=60,
        )
        # A short system turn is never registered.
        for _ in range(3):
            _chat(server, KEY_B, "Be brief.")
        assert len(client.list_prefixes()) == len(before) + 1


def test_a_chat_asking_for_a_compressor_matches_and_registers_only_with_it(server):
    with Client(server.target, api_key=KEY_A, timeout=120) as client:
        client.put_prefix(CONTEXT, compressor="streamingllm", ratio=4)
        _, hits = _counts(server)
        found = _chat(server, KEY_A, CONTEXT, compressor="streamingllm", ratio=4, mode="vericache")
        assert found["vericache"]["rounds"] < 12 and _counts(server)[1] > hits
        # Asked for another compressor, the same system turn finds nothing...
        _, hits = _counts(server)
        missed = _chat(server, KEY_A, CONTEXT, compressor="snapkv", ratio=2)
        assert missed["vericache"]["rounds"] == 12 and _counts(server)[1] == hits
        assert missed["choices"] == found["choices"]
        # ...and, asked for twice, registers itself with it.
        _chat(server, KEY_A, CONTEXT, compressor="snapkv", ratio=2)

        def snapkv_prefixes() -> list:
            return [p for p in client.list_prefixes() if p.compressor.name == "snapkv"]

        assert wait_for(lambda: len(snapkv_prefixes()) == 1, timeout_s=60)
        (registered,) = snapkv_prefixes()
        assert registered.compressor.ratio == 2
        again = _chat(server, KEY_A, CONTEXT, compressor="snapkv", ratio=2, mode="vericache")
        assert again["vericache"]["rounds"] < 12 and again["choices"] == found["choices"]


def test_grpc_generate_asks_for_a_compressor_as_http_does(server):
    tokenizer = server.coordinator.tokenizer
    leading = build_chat_prompt(tokenizer, None, PROMPT).token_ids[:-2]
    with Client(server.target, api_key=KEY_B, timeout=120) as client:
        prefix_id = client.put_prefix(token_ids=leading, compressor="streamingllm", ratio=2)
        with pytest.raises(InvalidRequestError, match="registered with streamingllm"):
            client.generate(PROMPT, prefix_id=prefix_id, compressor="snapkv", max_tokens=4)
        _, hits = _counts(server)
        other = client.generate(PROMPT, max_tokens=8, compressor="kivi", bits=4, mode="full_local")
        assert _counts(server)[1] == hits  # no prefix of that compressor: nothing found
        found = client.generate(PROMPT, max_tokens=8, compressor="streamingllm", ratio=2)
        assert _counts(server)[1] > hits and found.token_ids == other.token_ids


def test_a_clients_prefix_of_the_same_text_is_its_own_and_never_evicted(server):
    def system(topic: str) -> str:
        return f"You answer questions about {topic}. " + "Be brief and precise. " * 12

    with Client(server.target, api_key=KEY_A, timeout=120) as client:

        def automatic() -> list:
            return [p for p in client.list_prefixes() if p.automatic]

        _chat(server, KEY_A, system("sets"))
        _chat(server, KEY_A, system("sets"))
        assert wait_for(lambda: len(automatic()) == 1 and automatic()[0].num_tokens, 60)
        (registered,) = automatic()
        own = client.put_prefix(system("sets"), compressor="snapkv", ratio=4)
        mine = client.get_prefix(own)
        assert own != registered.prefix_id and not mine.automatic
        assert mine.compressor == registered.compressor and mine.num_tokens == registered.num_tokens
        # The next system turn takes the automatic prefix's place (one per tenant here); the
        # client's, of the same text, stays.
        _chat(server, KEY_A, system("tuples"))
        _chat(server, KEY_A, system("tuples"))
        assert wait_for(lambda: registered.prefix_id not in {p.prefix_id for p in automatic()}, 60)
        assert own in {p.prefix_id for p in client.list_prefixes()}
