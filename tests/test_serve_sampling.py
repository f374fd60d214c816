"""Sampling through the served system: with seeded coupling every mode that decodes over full KV or
verifies against it gives the tokens full-KV sampling gives with the same seed, batched or not,
per-request or scheduled; rejection coupling runs and repeats itself for a seed; bad parameters
are refused before any work."""

from __future__ import annotations

import concurrent.futures
import re

import grpc
import pytest

from tests.serve_fixtures import CONTEXT, open_sessions, raw_stub, start_server, wait_for
from vericache.client import Client
from vericache.client.errors import InvalidRequestError
from vericache.serve.config import CoordinatorConfig
from vericache.v1 import vericache_pb2

PROMPTS = ["Which function multiplies by three?", "Write a function that adds two lists."]
SETTINGS = [
    {"temperature": 0.3, "top_p": 0.9},
    {"temperature": 0.7, "top_k": 50},
    {"temperature": 1.0, "top_p": 0.9, "top_k": 50, "repetition_penalty": 1.1},
]
MAX_TOKENS = 32


@pytest.fixture(scope="module", params=["per-request", "staggered"])
def served(request, tiny_chat_checkpoint, tmp_path_factory):
    config = CoordinatorConfig(scheduling=request.param)
    root = tmp_path_factory.mktemp(f"sampling-{request.param}")
    with start_server(tiny_chat_checkpoint, root, config=config) as server:
        with Client(server.target, timeout=120) as client:
            prefix_id = client.put_prefix(CONTEXT, compressor="streamingllm", ratio=4)
            yield server, client, prefix_id


def _all_at_once(client, prefix_id: str, mode: str, draft_len: int, **sampling) -> list:
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        futures = [
            pool.submit(
                client.generate,
                prompt,
                prefix_id=prefix_id,
                mode=mode,
                max_tokens=MAX_TOKENS,
                draft_len=draft_len,
                seed=seed,
                **sampling,
            )
            for seed, prompt in enumerate(PROMPTS, start=11)
        ]
        return [future.result() for future in futures]


@pytest.mark.parametrize("sampling", SETTINGS, ids=lambda s: f"T{s['temperature']}")
def test_seeded_coupling_gives_full_kv_sampling_in_every_mode(served, sampling):
    server, client, prefix_id = served
    # Each setting is served once: staggered rounds take the middle one, per-request the others.
    if (server.coordinator.config.scheduling == "staggered") != (sampling is SETTINGS[1]):
        pytest.skip("served by the other scheduling")
    references = _all_at_once(client, prefix_id, "full_local", 6, **sampling)
    for reference, seed in zip(references, (11, 12)):
        assert len(reference.token_ids) == MAX_TOKENS or reference.finish_reason == "stop"
        assert reference.stats["seed"] == seed
    for mode, draft_len in [("vericache", 3), ("vericache", 8), ("full_remote", 6)]:
        results = _all_at_once(client, prefix_id, mode, draft_len, **sampling)
        assert [r.token_ids for r in results] == [r.token_ids for r in references], mode
        assert [r.text for r in results] == [r.text for r in references]
    assert wait_for(lambda: open_sessions(server) == 0)


@pytest.mark.parametrize("coupling", ["seeded", "rejection"])
def test_drafts_over_lossless_kv_are_all_kept_under_sampling(served, coupling):
    """Over an uncompressed draft KV the drafter's logits are the verifier's: a drafter that draws
    the same noise (seeded) or hands over its own distribution (rejection, then p = q) has every
    draft kept. A drafter that drafted greedily would see its drafts rejected at T=1."""
    _, client, _ = served
    prefix_id = client.put_prefix(CONTEXT, compressor="streamingllm", ratio=1)
    results = _all_at_once(client, prefix_id, "vericache", 8, temperature=1.0, coupling=coupling)
    for result in results:
        stats = result.stats
        # Each round keeps all its drafts: 8 per round but the last, which the budget cuts.
        assert stats["rounds"] == -(-len(result.token_ids) // 9) or result.finish_reason == "stop"
        assert stats["accepted_per_round"][:-1] == [8] * (stats["rounds"] - 1)


def test_sampling_depends_on_the_seed_and_only_on_it(served):
    server, client, prefix_id = served
    if server.coordinator.config.scheduling != "per-request":
        pytest.skip("the seed is the coordinator's, whatever drives the rounds: once suffices")
    prompt = PROMPTS[0]

    def sample(**options):
        return client.generate(
            prompt, prefix_id=prefix_id, mode="vericache", max_tokens=12, **options
        )

    first, again = sample(temperature=1.0, seed=5), sample(temperature=1.0, seed=5)
    assert first.token_ids == again.token_ids
    others = [sample(temperature=1.0, seed=seed).token_ids for seed in (6, 7)]
    assert any(tokens != first.token_ids for tokens in others)
    greedy = sample()
    assert greedy.stats["seed"] is None
    # Without a seed the server draws one and reports it: passing it back repeats the output.
    drawn = sample(temperature=1.0)
    assert drawn.stats["seed"] is not None
    assert sample(temperature=1.0, seed=drawn.stats["seed"]).token_ids == drawn.token_ids


def test_rejection_coupling_is_served_and_repeats_itself_for_a_seed(served):
    server, client, prefix_id = served
    options = {"temperature": 0.7, "coupling": "rejection", "max_tokens": MAX_TOKENS}
    results = [
        client.generate(
            PROMPTS[1], prefix_id=prefix_id, mode="vericache", seed=3, draft_len=6, **options
        )
        for _ in range(2)
    ]
    assert results[0].token_ids == results[1].token_ids
    stats = results[0].stats
    assert len(results[0].token_ids) == MAX_TOKENS or results[0].finish_reason == "stop"
    assert stats["rounds"] < len(results[0].token_ids)  # rounds kept drafts
    assert wait_for(lambda: open_sessions(server) == 0)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"temperature": -0.5}, "temperature must be >= 0"),
        ({"top_p": 0.0}, "top_p must lie in (0, 1]"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0"),
        ({"presence_penalty": 3.0}, "presence_penalty must lie in [-2, 2]"),
    ],
)
def test_bad_sampling_is_refused_by_the_server(served, options, message):
    server, _, prefix_id = served
    with raw_stub(server) as stub:
        request = vericache_pb2.GenerateRequest(
            prefix_id=prefix_id, prompt="hi", max_tokens=4, **options
        )
        with pytest.raises(grpc.RpcError) as caught:
            list(stub.Generate(request, timeout=30))
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert message in caught.value.details()


@pytest.mark.parametrize(
    "options, message",
    [
        ({"temperature": "hot"}, "temperature must be >= 0"),
        ({"top_k": 2.5}, "top_k must be >= 0"),
        ({"coupling": "nearest"}, "coupling must be 'seeded' or 'rejection'"),
        ({"seed": -1}, "seed must be in [0, 2**64)"),
        ({"temprature": 0.7}, "unknown sampling keyword 'temprature'"),
    ],
)
def test_bad_sampling_is_refused_by_the_client_before_any_call(served, options, message):
    _, client, prefix_id = served
    with pytest.raises(InvalidRequestError, match=re.escape(message)):
        client.generate("hi", prefix_id=prefix_id, mode="vericache", max_tokens=4, **options)
