"""Sampled vericache output equals full-KV sampling with the same seed, token for token (seeded
coupling, engine/sampling.py): for every compressor, temperature, top-p / top-k, penalties, draft
length and batch; the same seed repeats its output, another seed gives another."""

from __future__ import annotations

import dataclasses

import pytest

from tests.compressor_table import TABLE, pick, row_id
from tests.test_engine_exactness import make_prompts
from vericache.engine.long_context import LongContextEngine
from vericache.engine.long_context_config import LongContextConfig
from vericache.engine.request import DecodeMode, Request, SamplingParams

MAX_NEW = 24
SAMPLING = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.7, top_p=0.9, top_k=50, seed=11)


def requests(mode, params=SAMPLING, compressor=None, draft_len=8):
    return [
        Request(ids, prefix, params, mode, compressor, draft_len, request_id=str(i))
        for i, (ids, prefix) in enumerate(make_prompts())
    ]


def tokens(engine, batch) -> list[list[int]]:
    return [out.token_ids for out in engine.generate(batch)]


def long_context_generate(engine, batch):
    """`batch` on a long-context engine over `engine`'s model (full KV in host memory, loaded per
    round)."""
    long_context = LongContextEngine(engine.runner, None, long_context=LongContextConfig())
    try:
        return long_context.generate(batch)
    finally:
        long_context.close()


@pytest.fixture(scope="module")
def full_samples(tiny_engine):
    """Full-KV samples per temperature, computed once for the module."""
    cache = {}

    def get(params: SamplingParams) -> list[list[int]]:
        if params not in cache:
            cache[params] = tokens(tiny_engine(), requests(DecodeMode.FULL, params))
        return cache[params]

    return get


@pytest.mark.parametrize("compressor", TABLE, ids=row_id)
def test_vericache_samples_what_full_kv_samples(tiny_engine, full_samples, compressor):
    """Every temperature in one batch (a sample does not depend on its batch: tested below)."""
    settings = [dataclasses.replace(SAMPLING, temperature=t) for t in (0.3, 0.7, 1.0)]
    batches = [requests(DecodeMode.VERICACHE, params, compressor) for params in settings]
    batch = [
        dataclasses.replace(request, request_id=f"{params.temperature}-{request.request_id}")
        for params, requests_at in zip(settings, batches)
        for request in requests_at
    ]
    vericache = tokens(tiny_engine(), batch)
    expected = [ids for params in settings for ids in full_samples(params)]
    assert vericache == expected


@pytest.mark.parametrize("draft_len", [1, 4, 30])
@pytest.mark.parametrize("compressor", pick("kivi"), ids=row_id)
def test_every_draft_length_and_penalty_keeps_the_sample(tiny_engine, compressor, draft_len):
    engine = tiny_engine()
    params = dataclasses.replace(SAMPLING, repetition_penalty=1.3, presence_penalty=0.5, min_p=0.02)
    full = tokens(engine, requests(DecodeMode.FULL, params))
    outputs = engine.generate(requests(DecodeMode.VERICACHE, params, compressor, draft_len))
    assert [out.token_ids for out in outputs] == full
    assert all(out.seed == 11 for out in outputs)


def test_a_drafter_close_to_the_model_has_its_samples_accepted(tiny_engine):
    """The drafter draws the verifier's noise at each position, so a near-exact drafter (KIVI
    8-bit) proposes the same samples and most drafts are kept."""
    engine = tiny_engine()
    (kivi8,) = [row for row in pick("kivi") if row.bits == 8]
    params = dataclasses.replace(SAMPLING, temperature=0.3)
    outputs = engine.generate(requests(DecodeMode.VERICACHE, params, kivi8))
    drafted = sum(sum(out.stats.drafted_per_round) for out in outputs)
    accepted = sum(sum(out.stats.accepted_per_round) for out in outputs)
    assert accepted > 0.5 * drafted


def test_a_sample_does_not_depend_on_its_batch(tiny_engine):
    engine = tiny_engine()
    (compressor, _) = pick("streamingllm")
    batch = requests(DecodeMode.VERICACHE, compressor=compressor)
    together = tokens(engine, batch)
    assert [tokens(engine, [request])[0] for request in batch] == together


def test_the_seed_decides_the_sample(tiny_engine):
    engine = tiny_engine()
    first = tokens(engine, requests(DecodeMode.FULL))
    assert tokens(engine, requests(DecodeMode.FULL)) == first
    other = tokens(engine, requests(DecodeMode.FULL, dataclasses.replace(SAMPLING, seed=12)))
    assert other != first
    greedy = tokens(engine, requests(DecodeMode.FULL, SamplingParams(max_new_tokens=MAX_NEW)))
    assert greedy != first


def test_a_request_without_a_seed_gets_one_and_reports_it(tiny_engine):
    engine = tiny_engine()
    unseeded = dataclasses.replace(SAMPLING, seed=None)
    outputs = engine.generate(requests(DecodeMode.FULL, unseeded))
    seeds = [out.seed for out in outputs]
    assert all(seed is not None for seed in seeds) and len(set(seeds)) == len(seeds)
    replayed = [
        engine.generate([dataclasses.replace(r, params=dataclasses.replace(SAMPLING, seed=s))])[0]
        for r, s in zip(requests(DecodeMode.FULL, unseeded), seeds)
    ]
    assert [out.token_ids for out in replayed] == [out.token_ids for out in outputs]
    greedy = engine.generate(requests(DecodeMode.FULL, SamplingParams(max_new_tokens=4)))
    assert all(out.seed is None for out in greedy)


def test_the_long_context_engine_samples_what_full_kv_samples(tiny_engine):
    """The long-context engine (full KV in host memory, loaded per round) drives the same round,
    so its sampled output is the full-KV sample too."""
    engine = tiny_engine()
    (compressor, _) = pick("snapkv")
    outputs = long_context_generate(engine, requests(DecodeMode.VERICACHE, SAMPLING, compressor))
    assert [out.token_ids for out in outputs] == tokens(engine, requests(DecodeMode.FULL))


REJECTION = dataclasses.replace(SAMPLING, coupling="rejection")


def test_rejection_coupling_repeats_for_a_seed_and_keeps_an_exact_drafters_drafts(tiny_engine):
    engine = tiny_engine()
    (kivi8,) = [row for row in pick("kivi") if row.bits == 8]
    params = dataclasses.replace(REJECTION, temperature=0.3)
    first = engine.generate(requests(DecodeMode.VERICACHE, params, kivi8))
    again = engine.generate(requests(DecodeMode.VERICACHE, params, kivi8))
    assert [o.token_ids for o in first] == [o.token_ids for o in again]
    drafted = sum(sum(out.stats.drafted_per_round) for out in first)
    accepted = sum(sum(out.stats.accepted_per_round) for out in first)
    assert accepted > 0.8 * drafted  # p and q nearly equal: min(1, p / q) is nearly 1


def test_rejection_coupling_samples_the_models_distribution(tiny_engine):
    """The second token of a request comes out of a round of one draft over a lossy cache,
    checked by rejection coupling: over many seeds, the (first, second) pairs follow the model's
    own joint distribution, and far more closely than the drafter's."""
    engine = tiny_engine()
    (ids, _), *_ = make_prompts()
    ids, prefix = ids[:40], 32
    params = SamplingParams(max_new_tokens=2, temperature=1.0, top_k=3, coupling="rejection")
    (lossy, _) = pick("streamingllm")
    num_samples = 600  # 0.057 here (0.05 at 1200); the drafter's own is 1.0
    batch = [
        Request(ids, prefix, dataclasses.replace(params, seed=s), DecodeMode.VERICACHE, lossy, 1)
        for s in range(num_samples)
    ]
    exact = _joint(engine, ids, params)
    empirical = _sampled_pairs(engine, batch)
    assert set(empirical) <= set(exact)  # only tokens top-k allows
    distance = _distance(empirical, exact)
    assert distance < 0.08
    # The drafter alone (lossy decoding with the same seeds) samples another distribution.
    lossy_batch = [dataclasses.replace(r, mode=DecodeMode.LOSSY) for r in batch]
    lossy_distance = _distance(_sampled_pairs(engine, lossy_batch), exact)
    assert lossy_distance > 3 * distance


def _joint(engine, ids, params) -> dict[tuple[int, int], float]:
    """The model's exact probability of each (first, second) pair under `params`."""
    import torch

    from vericache.engine.sampling import processed_logits

    def distribution(tokens):
        cache = engine.runner.new_cache(len(tokens) + 1)
        logits = engine.runner.prefill(torch.tensor(tokens), cache, num_logits=1)
        return processed_logits(logits, params)[0].softmax(-1)

    first = distribution(list(ids))
    joint = {}
    for a in first.nonzero().flatten().tolist():
        second = distribution([*ids, a])
        for b in second.nonzero().flatten().tolist():
            joint[a, b] = float(first[a] * second[b])
    return joint


@pytest.mark.slow
@pytest.mark.parametrize("coupling", ["seeded", "rejection"])
def test_the_embedded_model_samples_its_own_distribution(embedded_engine, coupling):
    """SmolLM2-135M: a request's first token comes from the prefill, its second from a round of
    one draft over a 4x StreamingLLM cache; over many seeds the (first, second) pairs follow the
    model's joint distribution under the sampling parameters, under either coupling."""
    engine = embedded_engine
    ids = tuple(engine.tokenizer.encode("import math\n\ndef circle_area(radius):\n    return"))
    params = SamplingParams(max_new_tokens=2, temperature=1.0, top_k=3, coupling=coupling)
    (streaming, _) = pick("streamingllm")
    num_samples = 150  # nine pairs at most: 0.061 / 0.064 here (seeded / rejection)
    batch = [
        Request(ids, len(ids) - 4, dataclasses.replace(params, seed=s), DecodeMode.VERICACHE,
                streaming, 1)
        for s in range(num_samples)
    ]  # fmt: skip
    exact = _joint(engine, ids, params)
    empirical = _sampled_pairs(engine, batch)
    assert set(empirical) <= set(exact)  # only tokens top-k allows
    distance = _distance(empirical, exact)
    assert distance < 0.12
    # ...and far closer to it than a uniform choice among the same pairs is.
    uniform = {pair: 1 / len(exact) for pair in exact}
    assert distance < 0.5 * _distance(uniform, exact)


def _sampled_pairs(engine, batch) -> dict[tuple[int, int], float]:
    """The empirical distribution of the (first, second) output tokens over `batch`."""
    pairs = [tuple(out.token_ids) for out in engine.generate(batch)]
    return {pair: pairs.count(pair) / len(pairs) for pair in set(pairs)}


def _distance(a: dict, b: dict) -> float:
    """Total variation between two distributions over pairs."""
    return 0.5 * sum(abs(a.get(pair, 0) - b.get(pair, 0)) for pair in {**a, **b})
