"""The batch-invariant kernels give a token the same bits however many tokens share its forward.

These properties carry VeriCache's exactness: a one-token decode step and a multi-token
verification must agree bit for bit, not within a tolerance. They are checked on the machine that
runs the tests, since they depend on its BLAS library.
"""

from __future__ import annotations

import pytest
import torch

from vericache.kv.slots import KEY_ALIGN
from vericache.model import linear
from vericache.model.kernels import attention
from vericache.model.linear import Linear
from vericache.model.loader import load_model
from vericache.model.runner import ModelRunner, SequenceInput

ROW_COUNTS = [1, 2, 3, 5, 9, 16, 17, 31, 64, 100]


@pytest.fixture(params=[False, True], ids=["library", "row-blocks"])
def row_blocks(request, monkeypatch) -> bool:
    """Also runs a test on the CUDA algorithm (fixed row blocks, online-softmax attention), which
    must be batch-invariant on any device."""
    if request.param:
        monkeypatch.setattr(linear, "uses_row_blocks", lambda x: True)
    return request.param


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    """Runs a test on one torch thread (as each worker of `make test`) and on two: a library may
    split a product among threads otherwise for another row count."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("onednn", [True, False], ids=["onednn", "mkl"])
@pytest.mark.parametrize("shape", [(960, 576), (576, 1536), (512, 64), (200, 48)])
def test_linear_rows_do_not_depend_on_the_row_count(
    shape, onednn, monkeypatch, row_blocks, threads
):
    monkeypatch.setenv("VERICACHE_DISABLE_ONEDNN", "0" if onednn else "1")
    torch.manual_seed(0)
    layer = Linear(torch.randn(shape), torch.randn(shape[0]))
    x = torch.randn(max(ROW_COUNTS), shape[1])
    reference = layer(x, invariant=True)
    for rows in ROW_COUNTS:
        for start in (0, 3):
            out = layer(x[start : start + rows], invariant=True)
            assert torch.equal(out, reference[start : start + rows]), (rows, start)


def test_packed_onednn_weights_give_the_plain_product_bits():
    # Packing only spares each call the reorder: the same products, the same bits.
    torch.manual_seed(0)
    layer = Linear(torch.randn(960, 576), torch.randn(960))
    if not layer.uses_onednn:
        pytest.skip("oneDNN does not run here")
    assert layer._onednn_weight.is_mkldnn
    for rows in (2, 10, 31, 100):
        x = torch.randn(rows, 576)
        plain = torch.ops.mkldnn._linear_pointwise(x, layer.weight, layer.bias, "none", [], "")
        assert torch.equal(layer(x, invariant=True), plain), rows


@pytest.mark.parametrize("heads, kv_heads", [(6, 2), (4, 4), (8, 2)], ids=["gqa3", "mha", "gqa4"])
@pytest.mark.parametrize("num_cached", [10, KEY_ALIGN - 20, 3 * KEY_ALIGN - 1])
def test_attention_decode_equals_verification_rows(num_cached, heads, kv_heads, row_blocks):
    torch.manual_seed(0)
    num_new, dim = 31, 32
    total = num_cached + num_new
    keys = torch.zeros(4 * KEY_ALIGN, kv_heads, dim)
    values = torch.zeros_like(keys)
    keys[:total], values[:total] = (
        torch.randn(total, kv_heads, dim),
        torch.randn(total, kv_heads, dim),
    )
    q = torch.randn(num_new, heads, dim)
    verified = attention(q, keys, values, total, invariant=True)
    for m in range(num_new):
        decoded = attention(q[m : m + 1], keys, values, num_cached + m + 1, invariant=True)
        assert torch.equal(decoded[0], verified[m]), m


@pytest.mark.parametrize("cpu_kernel", [True, False], ids=["cpu-kernel", "no-cpu-kernel"])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_runner_step_by_step_equals_one_forward_bitwise(
    tiny_checkpoint, family, row_blocks, cpu_kernel
):
    loaded = load_model(str(tiny_checkpoint(family)))
    runner = ModelRunner(loaded.config, loaded.weights)
    # Without the CPU attention kernel (no compiler, or CUDA), exact rows take kernels.py's set.
    runner._cpu_kernel = runner._cpu_kernel and cpu_kernel
    torch.manual_seed(0)
    # The verification crosses a KEY_ALIGN boundary that the first decode steps stay below.
    prompt = torch.randint(3, 512, (KEY_ALIGN - 10,))
    continuation = torch.randint(3, 512, (31,))

    stepwise_cache, verify_cache = runner.new_cache(), runner.new_cache()
    runner.prefill(prompt, stepwise_cache, num_logits=0)
    runner.prefill(prompt, verify_cache, num_logits=0)
    other_cache, draft_cache = runner.new_cache(), runner.new_cache()
    runner.prefill(torch.randint(3, 512, (70,)), other_cache, num_logits=0)
    runner.prefill(torch.randint(3, 512, (40,)), draft_cache, num_logits=0)

    stepwise = torch.cat(
        [
            runner.forward([SequenceInput(t.view(1), stepwise_cache)], invariant=True)[0]
            for t in continuation
        ]
    )
    # The verification shares its forward with another sequence and a draft step (fast
    # attention), as in a batched engine iteration.
    verified, _, _ = runner.forward(
        [
            SequenceInput(continuation, verify_cache, 31),
            SequenceInput(continuation[:5], other_cache),
            SequenceInput(continuation[:1], draft_cache, fast_attention=True),
        ],
        invariant=True,
    )
    assert torch.equal(stepwise, verified)
    for step_layer, verify_layer in zip(stepwise_cache.layers, verify_cache.layers):
        assert torch.equal(step_layer.keys_values()[0], verify_layer.keys_values()[0])


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_full_prefill_gives_the_bits_of_decode_steps_whatever_its_chunks(
    tiny_checkpoint, family, row_blocks
):
    """A token's full KV does not depend on how it was computed: a session reopened over its
    history (a migration, a warm node, a later turn) prefills what full-KV decoding stepped."""
    loaded = load_model(str(tiny_checkpoint(family)))
    runner = ModelRunner(loaded.config, loaded.weights)
    torch.manual_seed(0)
    tokens = torch.randint(3, 512, (KEY_ALIGN + 40,))
    stepped = runner.new_cache()
    runner.prefill(tokens[:50], stepped, num_logits=0)
    step_logits = [
        runner.forward([SequenceInput(t.view(1), stepped)], invariant=True)[0] for t in tokens[50:]
    ]
    for chunk_size in (7, 64, 512):
        prefilled = runner.new_cache()
        logits = runner.prefill(tokens, prefilled, num_logits=1, chunk_size=chunk_size)
        assert torch.equal(logits, step_logits[-1]), chunk_size
        for step_layer, prefill_layer in zip(stepped.layers, prefilled.layers):
            for stepped_kv, prefilled_kv in zip(
                step_layer.keys_values(), prefill_layer.keys_values()
            ):
                assert torch.equal(stepped_kv, prefilled_kv), chunk_size
    # Into compressed KV, which drafts alone read, the fast kernels prefill.
    fast = runner.new_cache()
    runner.prefill(tokens, fast, num_logits=0, chunk_size=64, invariant=False)
    assert fast.num_tokens == stepped.num_tokens


def test_row_blocked_attention_matches_the_library_attention(row_blocks):
    torch.manual_seed(1)
    num_cached, num_new = KEY_ALIGN + 300, 31
    total = num_cached + num_new
    keys, values = torch.randn(2 * KEY_ALIGN, 2, 32), torch.randn(2 * KEY_ALIGN, 2, 32)
    q = torch.randn(num_new, 6, 32)
    fast = attention(q, keys, values, total, invariant=False)
    invariant = attention(q, keys, values, total, invariant=True)
    torch.testing.assert_close(invariant, fast, atol=2e-5, rtol=1e-4)
