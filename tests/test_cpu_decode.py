"""The batched CPU decode-attention kernel (kernels/cpu_decode_attention.cpp) against library
attention, and the runner's use of it for drafting."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from vericache.kernels import cpu_decode
from vericache.model.loader import load_model
from vericache.model.runner import ModelRunner, SequenceInput

CPU = torch.device("cpu")
TOLERANCE = dict(rtol=1e-5, atol=1e-6)

pytestmark = pytest.mark.skipif(
    shutil.which("c++") is None, reason="the kernel is compiled on first use: needs a C++ compiler"
)


def head_major_layer(num_slots: int, num_kv_heads: int, head_dim: int, capacity: int):
    """Keys or values as the dense cache hands them out: [T, Hkv, D] views of [Hkv, cap, D]."""
    buffer = torch.randn(num_kv_heads, capacity, head_dim)
    return buffer[:, :num_slots].transpose(0, 1)


def library_attention(query, keys, values):
    """query [Hq, D] over keys, values [T, Hkv, D] -> [Hq, D], by SDPA."""
    out = F.scaled_dot_product_attention(
        query.unsqueeze(1).unsqueeze(0),  # [1, Hq, 1, D]
        keys.permute(1, 0, 2).unsqueeze(0),
        values.permute(1, 0, 2).unsqueeze(0),
        enable_gqa=True,
    )
    return out[0, :, 0]


def test_builds_here():
    assert cpu_decode.accepts(CPU, torch.float32, 64)
    assert not cpu_decode.accepts(CPU, torch.bfloat16, 64)
    assert not cpu_decode.accepts(CPU, torch.float32, 80)


@pytest.mark.parametrize("head_dim", cpu_decode.SUPPORTED_HEAD_DIMS)
@pytest.mark.parametrize("num_heads,num_kv_heads", [(9, 3), (4, 4), (8, 1)])
def test_matches_library_attention_per_sequence(head_dim, num_heads, num_kv_heads):
    torch.manual_seed(head_dim + num_heads)
    lengths = [1, 7, 300, 1030]
    keys = [head_major_layer(n, num_kv_heads, head_dim, n + 17) for n in lengths]
    values = [head_major_layer(n, num_kv_heads, head_dim, n + 5) for n in lengths]
    queries = torch.randn(len(lengths), num_heads, head_dim) * 3
    out = cpu_decode.decode_attention(queries, keys, values)
    for b in range(len(lengths)):
        expected = library_attention(queries[b], keys[b], values[b])
        torch.testing.assert_close(out[b], expected, **TOLERANCE)


def test_a_sequence_gets_the_same_bits_alone_and_in_a_batch():
    # Batched drafting must give each request the tokens it would draft alone.
    torch.manual_seed(1)
    keys = [head_major_layer(n, 3, 64, n) for n in (40, 900, 2000)]
    values = [head_major_layer(n, 3, 64, n) for n in (40, 900, 2000)]
    queries = torch.randn(3, 9, 64)
    together = cpu_decode.decode_attention(queries, keys, values)
    for b in range(3):
        alone = cpu_decode.decode_attention(queries[b : b + 1], keys[b : b + 1], values[b : b + 1])
        assert torch.equal(alone[0], together[b])


def test_rejects_inputs_it_cannot_serve():
    keys = [torch.randn(5, 3, 64)]
    with pytest.raises(RuntimeError, match="float32"):
        cpu_decode.decode_attention(torch.randn(1, 9, 64), [keys[0].double()], [keys[0].double()])
    with pytest.raises(RuntimeError, match="multiple"):
        cpu_decode.decode_attention(torch.randn(1, 8, 64), keys, keys)
    with pytest.raises(RuntimeError, match="one keys"):
        cpu_decode.decode_attention(torch.randn(2, 9, 64), keys, keys)
    with pytest.raises(RuntimeError, match="same"):
        cpu_decode.decode_attention(torch.randn(1, 9, 64), keys, [torch.randn(4, 3, 64)])


def test_runner_drafts_through_the_kernel_with_library_results(tiny_checkpoint, monkeypatch):
    loaded = load_model(str(tiny_checkpoint("qwen3")))  # head_dim 32
    runner = ModelRunner(loaded.config, loaded.weights)
    assert runner._cpu_decode_kernel
    caches = []
    for length in (5, 60, 300):
        cache = runner.new_cache()
        runner.prefill(torch.randint(3, 500, (length,)), cache)
        caches.append(cache)
    reference_caches = [cache.clone() for cache in caches]
    steps = [torch.randint(3, 500, (1,)) for _ in caches]
    calls = []
    real = cpu_decode.decode_attention
    monkeypatch.setattr(cpu_decode, "decode_attention", lambda *a: calls.append(1) or real(*a))
    logits = runner.forward([SequenceInput(t, c) for t, c in zip(steps, caches)])
    assert len(calls) == loaded.config.num_layers
    runner._cpu_decode_kernel = False
    expected = runner.forward([SequenceInput(t, c) for t, c in zip(steps, reference_caches)])
    for got, want in zip(logits, expected):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
