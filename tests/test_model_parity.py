"""Our forward against transformers' implementation of the same checkpoint, fp32, atol 1e-4."""

from __future__ import annotations

import pytest
import torch
import transformers

from tests.conftest import TINY_FAMILIES
from vericache.model.loader import load_model
from vericache.model.runner import ModelRunner, SequenceInput

ATOL = 1e-4


def _hf(path):
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    return model.eval()


def _check_parity(path, prompt_len: int, num_decode: int, vocab: int, invariant: bool):
    """Prefill with the prefill kernels (the fast set, as the engine runs it), one-token steps
    with the given set, and a verification-shaped step with the batch-invariant set."""
    loaded = load_model(str(path))
    runner = ModelRunner(loaded.config, loaded.weights)
    hf = _hf(path)
    torch.manual_seed(1)
    ids = torch.randint(3, vocab, (prompt_len + num_decode,))
    prompt, continuation = ids[:prompt_len], ids[prompt_len:]

    with torch.no_grad():
        hf_out = hf(prompt.unsqueeze(0), use_cache=True)
        cache = runner.new_cache()
        (ours,) = runner.forward([SequenceInput(prompt, cache, prompt_len)])
        torch.testing.assert_close(ours, hf_out.logits[0], atol=ATOL, rtol=0)

        past = hf_out.past_key_values
        for token in continuation:
            hf_out = hf(token.view(1, 1), past_key_values=past, use_cache=True)
            past = hf_out.past_key_values
            (ours,) = runner.forward([SequenceInput(token.view(1), cache, 1)], invariant=invariant)
            torch.testing.assert_close(ours, hf_out.logits[0], atol=ATOL, rtol=0)

        # A multi-token step over a warm cache (the verification shape) against a full forward.
        cache = runner.new_cache()
        runner.forward([SequenceInput(prompt, cache, 1)])
        (ours,) = runner.forward([SequenceInput(continuation, cache, num_decode)], invariant=True)
        reference = hf(ids.unsqueeze(0)).logits[0, prompt_len:]
        torch.testing.assert_close(ours, reference, atol=ATOL, rtol=0)


@pytest.mark.parametrize("invariant", [False, True], ids=["fast", "invariant"])
@pytest.mark.parametrize("family", sorted(TINY_FAMILIES))
def test_tiny_family_matches_transformers(tiny_checkpoint, family, invariant):
    # 40 prompt + 6 decode tokens: past the tiny Mistral's 24-token sliding window, and past the
    # tiny Llama 3's 64-position original context only through the scaled frequencies.
    _check_parity(tiny_checkpoint(family), 40, 6, 512, invariant)


def test_long_sequence_crosses_llama3_original_context(tiny_checkpoint):
    _check_parity(tiny_checkpoint("llama3"), 150, 4, 512, invariant=True)


def test_prefill_in_chunks_matches_one_forward(tiny_checkpoint):
    loaded = load_model(str(tiny_checkpoint("llama")))
    runner = ModelRunner(loaded.config, loaded.weights)
    ids = torch.randint(3, 512, (100,), generator=torch.Generator().manual_seed(0))
    whole = runner.prefill(ids, runner.new_cache(), num_logits=5, chunk_size=1000)
    chunked = runner.prefill(ids, runner.new_cache(), num_logits=5, chunk_size=16)
    torch.testing.assert_close(chunked, whole, atol=ATOL, rtol=0)


@pytest.mark.slow
def test_embedded_model_matches_transformers(embedded_dir):
    _check_parity(embedded_dir, 200, 4, 49152, invariant=True)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs_close_to_float32(tiny_checkpoint, dtype):
    path = tiny_checkpoint("qwen3")
    ids = torch.randint(3, 512, (40,), generator=torch.Generator().manual_seed(0))
    logits = {}
    for name in ("float32", dtype):
        loaded = load_model(str(path), dtype=name)
        runner = ModelRunner(loaded.config, loaded.weights)
        for invariant in (False, True):
            (out,) = runner.forward([SequenceInput(ids, runner.new_cache(), 40)], invariant)
            assert out.dtype == torch.float32  # logits in float32 whatever the model dtype
            logits[name, invariant] = out
    reference = logits["float32", False]
    for invariant in (False, True):
        # Half precision keeps the greedy choice almost everywhere on decisive logits.
        agree = (logits[dtype, invariant].argmax(-1) == reference.argmax(-1)).float().mean()
        assert agree >= 0.9
