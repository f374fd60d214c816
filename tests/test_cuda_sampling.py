"""Seeded sampling on CUDA (skipped without it): vericache output equals full-KV sampling with the
same seed, token for token, for every compressor, in float32 and bfloat16, batched or not, in the
engine and the long-context engine; both couplings follow the model's distribution there too.
The CPU's own checks are tests/test_engine_sampling.py, whose requests and measures these reuse."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.compressor_table import TABLE, pick, row_id
from tests.test_engine_exactness import make_prompts
from tests.test_engine_sampling import (
    REJECTION,
    SAMPLING,
    _distance,
    _joint,
    _sampled_pairs,
    requests,
    tokens,
)
from vericache.engine.device_memory import full_kv_bytes
from vericache.engine.engine import Engine
from vericache.engine.long_context import LongContextEngine
from vericache.engine.long_context_config import LongContextConfig
from vericache.engine.request import DecodeMode, Request, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

TEMPERATURES = (0.3, 0.7, 1.0)


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def engine(request, tiny_checkpoint):
    return Engine.from_pretrained(str(tiny_checkpoint("llama")), dtype=request.param, device="cuda")


def _every_temperature(mode, compressor=None) -> list[Request]:
    """The prompts at each temperature, in one batch."""
    return [
        dataclasses.replace(r, request_id=f"{t}-{r.request_id}")
        for t in TEMPERATURES
        for r in requests(mode, dataclasses.replace(SAMPLING, temperature=t), compressor)
    ]


@pytest.fixture(scope="module")
def full_samples(engine):
    return tokens(engine, _every_temperature(DecodeMode.FULL))


@pytest.mark.parametrize("compressor", TABLE, ids=row_id)
def test_cuda_vericache_samples_what_full_kv_samples(engine, full_samples, compressor):
    assert tokens(engine, _every_temperature(DecodeMode.VERICACHE, compressor)) == full_samples


@pytest.mark.parametrize("draft_len", [1, 4, 30])
def test_cuda_every_draft_length_and_penalty_keeps_the_sample(engine, draft_len):
    (kivi, _) = pick("kivi")
    params = dataclasses.replace(SAMPLING, repetition_penalty=1.3, presence_penalty=0.5, min_p=0.02)
    full = tokens(engine, requests(DecodeMode.FULL, params))
    assert tokens(engine, requests(DecodeMode.VERICACHE, params, kivi, draft_len)) == full


def test_cuda_sample_does_not_depend_on_its_batch(engine):
    (compressor, _) = pick("snapkv")
    batch = requests(DecodeMode.VERICACHE, compressor=compressor)
    together = tokens(engine, batch)
    assert [tokens(engine, [request])[0] for request in batch] == together
    assert together == tokens(engine, requests(DecodeMode.FULL))


def test_cuda_seed_decides_the_sample(engine):
    first = tokens(engine, requests(DecodeMode.FULL))
    assert tokens(engine, requests(DecodeMode.FULL)) == first
    other = tokens(engine, requests(DecodeMode.FULL, dataclasses.replace(SAMPLING, seed=12)))
    assert other != first


def test_cuda_long_context_engine_samples_what_full_kv_samples(engine):
    """Full KV in pinned host memory, loaded per round over a copy stream, and under a budget
    that holds a few full KVs at once."""
    (compressor, _) = pick("kivi")
    batch = requests(DecodeMode.VERICACHE, SAMPLING, compressor)
    expected = tokens(engine, requests(DecodeMode.FULL))
    runner = engine.runner
    full_bytes = max(full_kv_bytes(r, runner.config, runner.dtype.itemsize) for r in batch)
    budget = runner.weights.nbytes + 3 * full_bytes
    for link in (None, 50e6):  # the PCIe as it is, and a slow emulated link
        config = LongContextConfig(memory_budget_bytes=budget, link_bytes_per_s=link)
        with LongContextEngine(runner, None, long_context=config) as long_context:
            assert tokens(long_context, batch) == expected
            assert long_context.stats.peak_device_bytes <= budget


def test_cuda_rejection_coupling_repeats_for_a_seed(engine):
    (kivi8,) = [row for row in pick("kivi") if row.bits == 8]
    batch = requests(DecodeMode.VERICACHE, REJECTION, kivi8)
    assert tokens(engine, batch) == tokens(engine, batch)


@pytest.mark.parametrize("coupling", ["seeded", "rejection"])
def test_cuda_sampling_follows_the_models_distribution(engine, coupling):
    """The (first, second) token pairs over many seeds, the second from a round of one draft
    over a lossy cache, against the model's own joint distribution on this device (bounds as on
    the CPU: tests/test_engine_sampling.py)."""
    (ids, _), *_ = make_prompts()
    ids, prefix = ids[:40], 32
    params = SamplingParams(max_new_tokens=2, temperature=1.0, top_k=3, coupling=coupling)
    (lossy, _) = pick("streamingllm")
    batch = [
        Request(ids, prefix, dataclasses.replace(params, seed=s), DecodeMode.VERICACHE, lossy, 1)
        for s in range(600)
    ]
    exact = _joint(engine, ids, params)
    empirical = _sampled_pairs(engine, batch)
    assert set(empirical) <= set(exact)
    assert _distance(empirical, exact) < 0.08
