"""Greedy vericache output equals full-KV output token for token, whatever the compressor, draft
length, batch or stop condition."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

from tests.compressor_table import pick, row_id
from vericache.compress import KIVI, CompressionKind, CompressionMode, Compressor, StreamingLLM
from vericache.engine.engine import DraftKVSource, EngineConfig
from vericache.engine.request import DecodeMode, Request, SamplingParams
from vericache.errors import InvalidRequestError
from vericache.kv.cache import DenseLayerKV, KVCache
from vericache.kv.compressed import CompressedKV

MAX_NEW = 40
# (prefix tokens, suffix tokens): a long shared prefix, one whose verifications cross the
# 1024-slot key block of the invariant kernels, and a prompt without any prefix.
PROMPT_SHAPES = [(96, 8), (1000, 12), (0, 20)]
COMPRESSORS = pick("streamingllm", "kivi")  # the table's token-dropping and quantizing anchors


def make_prompts(vocab: int = 512, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    prompts = []
    for prefix, suffix in PROMPT_SHAPES:
        ids = torch.randint(3, vocab, (prefix + suffix,), generator=generator).tolist()
        prompts.append((tuple(ids), prefix))
    return prompts


def requests(mode, compressor=None, draft_len=30, params=SamplingParams(max_new_tokens=MAX_NEW)):
    return [
        Request(ids, prefix, params, mode, compressor, draft_len, request_id=str(i))
        for i, (ids, prefix) in enumerate(make_prompts())
    ]


@pytest.fixture(scope="module")
def full_outputs(tiny_engine):
    return [out.token_ids for out in tiny_engine().generate(requests(DecodeMode.FULL))]


@dataclass(frozen=True)
class ScrambledKV(Compressor):
    """Keeps every token but shifts its values to other slots: drafts are nearly always wrong."""

    name: ClassVar[str] = "scrambled"
    kind: ClassVar[CompressionKind] = CompressionKind.TOKEN_DROPPING
    mode: ClassVar[CompressionMode] = CompressionMode.OFFLINE

    @property
    def label(self) -> str:
        return self.name

    def compress(self, full: KVCache, context=None) -> CompressedKV:
        layers = []
        for layer in full.layers:
            keys, values = layer.keys_values()
            layers.append(
                DenseLayerKV.from_tensors(keys, values.roll(7, dims=0), layer.positions())
            )
        return CompressedKV(layers, full.num_tokens, self)


@pytest.mark.parametrize("source", list(DraftKVSource), ids=lambda s: s.value)
@pytest.mark.parametrize("draft_len", [1, 4, 30])
@pytest.mark.parametrize("compressor", COMPRESSORS, ids=row_id)
def test_vericache_equals_full(tiny_engine, full_outputs, compressor, draft_len, source):
    engine = tiny_engine(EngineConfig(draft_kv_source=source))
    check_vericache_equals_full(engine, full_outputs, compressor, draft_len)


@pytest.mark.parametrize("compressor", COMPRESSORS, ids=row_id)
def test_vericache_over_static_forwards_equals_full(tiny_engine, full_outputs, compressor):
    """Over static forwards (model/static_forward.py; CUDA graphs on CUDA; the whole suite runs
    so with VERICACHE_STATIC_SHAPES=1), against full decoding's dynamic forwards."""
    engine = tiny_engine(EngineConfig(static_shapes=True))
    check_vericache_equals_full(engine, full_outputs, compressor, 30)
    assert engine.runner.static.num_forwards > 0


def check_vericache_equals_full(engine, full_outputs, compressor, draft_len: int) -> None:
    outputs = engine.generate(requests(DecodeMode.VERICACHE, compressor, draft_len))
    for out, expected in zip(outputs, full_outputs):
        assert out.token_ids == expected
        stats = out.stats
        assert all(
            0 <= a <= d <= draft_len
            for a, d in zip(stats.accepted_per_round, stats.drafted_per_round)
        )
        # Every output token but the prefill's first comes from a round: accepted + the
        # verifier's own, unless an end token among the accepted drafts stopped the round.
        emitted = 1 + stats.accepted_tokens + stats.rounds
        assert len(out.token_ids) in (emitted, emitted - 1)


def test_first_draft_token_rejected(tiny_engine, full_outputs):
    outputs = tiny_engine().generate(requests(DecodeMode.VERICACHE, ScrambledKV(), 4))
    assert [out.token_ids for out in outputs] == full_outputs
    assert any(0 in out.stats.accepted_per_round for out in outputs)


def test_all_drafts_accepted_with_bonus_tokens(tiny_engine, full_outputs):
    outputs = tiny_engine().generate(requests(DecodeMode.VERICACHE, StreamingLLM(ratio=1), 8))
    assert [out.token_ids for out in outputs] == full_outputs
    for out in outputs:
        # Each round accepts all its drafts and adds the bonus token; the last round drafts only
        # what the token budget leaves.
        assert out.stats.accepted_per_round[:-1] == [8] * (out.stats.rounds - 1)
        assert out.stats.accepted_tokens == out.stats.draft_tokens
        emitted = 1 + out.stats.accepted_tokens + out.stats.rounds
        # An accepted end token ends the sequence before the round's own token.
        assert len(out.token_ids) == emitted - (out.token_ids[-1] == 2)


def test_eos_inside_a_draft(tiny_engine, full_outputs):
    (ids, prefix), reference = make_prompts()[0], full_outputs[0]
    position = next(i for i in range(10, MAX_NEW) if reference[i] not in reference[:i])
    end_token = reference[position]
    params = SamplingParams(max_new_tokens=MAX_NEW, stop_token_ids=(end_token,))
    results = {}
    for mode, compressor in [
        (DecodeMode.FULL, None),
        (DecodeMode.VERICACHE, StreamingLLM(ratio=1)),
    ]:
        (out,) = tiny_engine().generate([Request(ids, prefix, params, mode, compressor, 30)])
        results[mode] = out
    assert results[DecodeMode.VERICACHE].token_ids == reference[: position + 1]
    assert results[DecodeMode.FULL].token_ids == reference[: position + 1]
    assert results[DecodeMode.VERICACHE].finish_reason == "stop"
    # The end token was drafted and accepted inside the first round, not reached token by token.
    assert results[DecodeMode.VERICACHE].stats.rounds == 1


@pytest.mark.parametrize("ratio", [1, 2])
@pytest.mark.parametrize("max_new", [1, 2, 7])
def test_max_new_tokens_inside_a_draft(tiny_engine, full_outputs, max_new, ratio):
    params = SamplingParams(max_new_tokens=max_new)
    outputs = tiny_engine().generate(
        requests(DecodeMode.VERICACHE, StreamingLLM(ratio=ratio), 30, params)
    )
    for out, reference in zip(outputs, full_outputs):
        assert out.token_ids == reference[:max_new]
        assert out.finish_reason == "length"
        if ratio == 1:
            # One round drafts exactly what the budget leaves after the prefill's token and the
            # verifier's own.
            assert out.stats.draft_tokens == max(0, max_new - 2)
            assert out.stats.rounds == (max_new > 1)


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("mode", [DecodeMode.FULL, DecodeMode.VERICACHE])
def test_batched_equals_one_by_one(tiny_engine, mode, static):
    compressor = None if mode is DecodeMode.FULL else KIVI(bits=4, group_size=8, residual_length=8)
    batch = requests(mode, compressor, 4)
    engine = tiny_engine(EngineConfig(static_shapes=static))
    together = [out.token_ids for out in engine.generate(batch)]
    alone = [engine.generate([request])[0].token_ids for request in batch]
    assert together == alone


@pytest.mark.parametrize("family", ["llama3", "mistral", "qwen2", "qwen3"])
def test_vericache_equals_full_on_each_family(tiny_engine, family):
    engine = tiny_engine(EngineConfig(), family)
    reference = [out.token_ids for out in engine.generate(requests(DecodeMode.FULL))]
    for compressor in (StreamingLLM(ratio=4), KIVI(bits=2, group_size=8, residual_length=8)):
        outputs = engine.generate(requests(DecodeMode.VERICACHE, compressor, 6))
        assert [out.token_ids for out in outputs] == reference


def test_lossy_mode_runs_on_the_compressed_cache_alone(tiny_engine, full_outputs):
    outputs = tiny_engine().generate(requests(DecodeMode.LOSSY, StreamingLLM(ratio=8)))
    assert all(len(out.token_ids) == MAX_NEW or out.finish_reason == "stop" for out in outputs)
    assert all(out.stats.draft_tokens == 0 for out in outputs)
    # Dropping 7/8 of a random prefix changes what the model says.
    assert [out.token_ids for out in outputs] != full_outputs


def test_prompt_longer_than_the_context_is_refused(tiny_engine):
    too_long = Request(tuple([5] * 2048), 0, mode=DecodeMode.FULL)
    with pytest.raises(InvalidRequestError, match="context"):
        tiny_engine().generate([too_long])


def test_vericache_runs_into_the_context_limit_like_full(tiny_checkpoint):
    from vericache.engine.engine import Engine

    engine = Engine.from_pretrained(str(tiny_checkpoint("llama", max_position_embeddings=128)))
    ids = tuple(range(3, 103))
    params = SamplingParams(max_new_tokens=100)
    (full,) = engine.generate([Request(ids, 90, params, DecodeMode.FULL)])
    (veri,) = engine.generate(
        [Request(ids, 90, params, DecodeMode.VERICACHE, StreamingLLM(ratio=1), 30)]
    )
    assert veri.token_ids == full.token_ids
    assert len(full.token_ids) == 128 - 100 and full.finish_reason == veri.finish_reason == "length"


def test_token_ids_outside_the_vocabulary_are_refused(tiny_engine):
    with pytest.raises(InvalidRequestError, match="token ids"):
        tiny_engine().generate([Request((5, 512), 0, mode=DecodeMode.FULL)])


def test_stop_string_ends_both_modes_at_the_same_token(tiny_chat_checkpoint):
    from vericache.engine.engine import Engine
    from vericache.engine.prompt import build_chat_prompt

    engine = Engine.from_pretrained(str(tiny_chat_checkpoint))
    prompt = build_chat_prompt(engine.tokenizer, "Some context " * 30, "Say something.")
    free = engine.generate(
        [
            Request(
                prompt.token_ids,
                prompt.num_prefix_tokens,
                SamplingParams(max_new_tokens=30),
                DecodeMode.FULL,
            )
        ]
    )[0]
    stop = free.text[len(free.text) // 2 : len(free.text) // 2 + 3]
    assert stop.strip(), "the tiny model's text is too short for this test"
    params = SamplingParams(max_new_tokens=30, stop=(stop,))
    results = [
        engine.generate(
            [Request(prompt.token_ids, prompt.num_prefix_tokens, params, mode, comp, 8)]
        )[0]
        for mode, comp in [(DecodeMode.FULL, None), (DecodeMode.VERICACHE, StreamingLLM(ratio=4))]
    ]
    assert results[0].token_ids == results[1].token_ids
    assert results[0].text == results[1].text == free.text[: free.text.find(stop)]
    assert results[0].finish_reason == results[1].finish_reason == "stop"


@pytest.mark.parametrize("compressor", pick("h2o", "kivi", "tova"), ids=row_id)
def test_a_known_output_stops_drafts_at_their_first_rejection(
    tiny_engine, full_outputs, compressor
):
    """With the full-KV output known, a round drafts only up to its first rejected draft: the
    same tokens, the same first mismatches, at a fraction of the draft steps. Online compressors
    (h2o, tova) see the same committed queries, so they keep the same tokens."""
    draft_len = 30
    engine = tiny_engine()
    drafting_on = engine.generate(requests(DecodeMode.VERICACHE, compressor, draft_len))
    known = [
        dataclasses.replace(request, expected_ids=tuple(reference))
        for request, reference in zip(
            requests(DecodeMode.VERICACHE, compressor, draft_len), full_outputs
        )
    ]
    stopping = engine.generate(known)
    for on, stop, expected in zip(drafting_on, stopping, full_outputs):
        assert stop.token_ids == on.token_ids == expected
        rejected = [
            a for a, d in zip(on.stats.accepted_per_round, on.stats.drafted_per_round) if a < d
        ]
        assert stop.stats.accepted_per_round == on.stats.accepted_per_round
        # A rejected round drafted one past its accepted drafts, and no more.
        for a, d in zip(stop.stats.accepted_per_round, stop.stats.drafted_per_round):
            assert d == draft_len or d == a + 1 or a == d
        if rejected:
            assert stop.stats.draft_tokens < on.stats.draft_tokens
