"""The same properties on CUDA, where a GPU is present (skipped otherwise)."""

from __future__ import annotations

import pytest
import torch

from tests.test_model_parity import ATOL
from vericache.compress import KIVI, StreamingLLM
from vericache.engine.engine import Engine
from vericache.engine.request import DecodeMode, Request, SamplingParams
from vericache.model.loader import load_model
from vericache.model.runner import ModelRunner, SequenceInput

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _runner(path, dtype="float32"):
    loaded = load_model(str(path), dtype=dtype, device="cuda")
    return ModelRunner(loaded.config, loaded.weights, "cuda")


def test_cuda_logits_match_cpu(tiny_checkpoint):
    path = tiny_checkpoint("qwen3")
    cpu = ModelRunner(*_loaded(path))
    ids = torch.randint(3, 512, (40,), generator=torch.Generator().manual_seed(0))
    (expected,) = cpu.forward([SequenceInput(ids, cpu.new_cache(), 40)])
    gpu = _runner(path)
    (actual,) = gpu.forward([SequenceInput(ids, gpu.new_cache(), 40)])
    torch.testing.assert_close(actual.cpu(), expected, atol=ATOL, rtol=0)


def _loaded(path):
    loaded = load_model(str(path))
    return loaded.config, loaded.weights


def test_cuda_verification_equals_one_token_steps_bitwise(tiny_checkpoint):
    runner = _runner(tiny_checkpoint("llama"))
    prompt, continuation = torch.randint(3, 512, (300,)), torch.randint(3, 512, (31,))
    stepwise, verify = runner.new_cache(), runner.new_cache()
    runner.prefill(prompt, stepwise, num_logits=0)
    runner.prefill(prompt, verify, num_logits=0)
    steps = torch.cat(
        [
            runner.forward([SequenceInput(t.view(1), stepwise)], invariant=True)[0]
            for t in continuation
        ]
    )
    (verified,) = runner.forward([SequenceInput(continuation, verify, 31)], invariant=True)
    assert torch.equal(steps, verified)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_vericache_equals_full(tiny_checkpoint, dtype):
    engine = Engine.from_pretrained(str(tiny_checkpoint("llama")), dtype=dtype, device="cuda")
    ids = tuple(torch.randint(3, 512, (200,), generator=torch.Generator().manual_seed(1)).tolist())
    params = SamplingParams(max_new_tokens=40)
    (full,) = engine.generate([Request(ids, 180, params, DecodeMode.FULL)])
    for compressor in (StreamingLLM(ratio=4), KIVI(bits=4, group_size=8, residual_length=16)):
        (out,) = engine.generate([Request(ids, 180, params, DecodeMode.VERICACHE, compressor, 8)])
        assert out.token_ids == full.token_ids
