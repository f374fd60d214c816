"""The CPU attention kernel (kernels/cpu_attention.cpp) against library attention, its
batch invariance by construction, and the runner's use of it for draft steps and exact forwards."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from vericache.kernels import cpu_attention
from vericache.model.loader import load_model
from vericache.model.runner import ModelRunner, SequenceInput

CPU = torch.device("cpu")
TOLERANCE = dict(rtol=1e-4, atol=1e-5)

pytestmark = pytest.mark.skipif(
    shutil.which("c++") is None, reason="the kernel is compiled on first use: needs a C++ compiler"
)


def head_major_layer(num_slots: int, num_kv_heads: int, head_dim: int, capacity: int):
    """Keys or values as the dense cache hands them out: [T, Hkv, D] views of [Hkv, cap, D]."""
    buffer = torch.randn(num_kv_heads, capacity, head_dim)
    return buffer[:, :num_slots].transpose(0, 1)


def library_attention(queries, keys, values):
    """queries [n, Hq, D], the last n slots of keys, values [T, Hkv, D] -> [n, Hq, D], by SDPA
    with the causal mask aligned to the end."""
    num_new, num_slots = queries.shape[0], keys.shape[0]
    visible = torch.arange(num_slots) <= (num_slots - num_new + torch.arange(num_new)).view(-1, 1)
    out = F.scaled_dot_product_attention(
        queries.permute(1, 0, 2).unsqueeze(0),  # [1, Hq, n, D]
        keys.permute(1, 0, 2).unsqueeze(0),
        values.permute(1, 0, 2).unsqueeze(0),
        attn_mask=visible,
        enable_gqa=True,
    )
    return out[0].permute(1, 0, 2)


def test_builds_here():
    assert cpu_attention.accepts(CPU, torch.float32, 64)
    assert not cpu_attention.accepts(CPU, torch.bfloat16, 64)
    assert not cpu_attention.accepts(CPU, torch.float32, 80)


@pytest.mark.parametrize("head_dim", cpu_attention.SUPPORTED_HEAD_DIMS)
@pytest.mark.parametrize("num_heads,num_kv_heads", [(9, 3), (4, 4), (8, 1)])
def test_matches_library_attention_per_sequence(head_dim, num_heads, num_kv_heads):
    torch.manual_seed(head_dim + num_heads)
    # (slots, new tokens): one-token steps, a verification, and new tokens that are all the slots
    shapes = [(1, 1), (7, 1), (300, 31), (1030, 9), (12, 12)]
    keys = [head_major_layer(t, num_kv_heads, head_dim, t + 17) for t, _ in shapes]
    values = [head_major_layer(t, num_kv_heads, head_dim, t + 5) for t, _ in shapes]
    counts = [n for _, n in shapes]
    queries = torch.randn(sum(counts), num_heads, head_dim) * 3
    out = cpu_attention.attention(queries, keys, values, counts).split(counts)
    for b, rows in enumerate(queries.split(counts)):
        expected = library_attention(rows, keys[b], values[b])
        torch.testing.assert_close(out[b], expected, **TOLERANCE)


@pytest.mark.parametrize("num_cached", [0, 15, 16, 1000])
def test_a_token_gets_the_same_bits_decoded_alone_and_verified_among_others(num_cached):
    # VeriCache's exactness: token m of a verification equals its one-token decode step, bit for
    # bit, whatever shares the call.
    torch.manual_seed(num_cached)
    num_new = 31
    keys = head_major_layer(num_cached + num_new, 3, 64, num_cached + num_new + 3)
    values = head_major_layer(num_cached + num_new, 3, 64, num_cached + num_new)
    other_keys, other_values = head_major_layer(50, 3, 64, 50), head_major_layer(50, 3, 64, 50)
    queries = torch.randn(num_new, 9, 64)
    verified = cpu_attention.attention(
        torch.cat([torch.randn(2, 9, 64), queries]),
        [other_keys, keys],
        [other_values, values],
        [2, num_new],
    )[2:]
    for m in range(num_new):
        seen = num_cached + m + 1
        decoded = cpu_attention.attention(queries[m : m + 1], [keys[:seen]], [values[:seen]], [1])
        assert torch.equal(decoded[0], verified[m]), m


@pytest.mark.parametrize("head_dim", cpu_attention.SUPPORTED_HEAD_DIMS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reads_16_bit_slots_as_their_float32_widening(dtype, head_dim):
    # A draft cache stored in 16 bits shares a call with float32 caches (a draft step riding a
    # verification's forward): each sequence gets the bits of its slots widened to float32.
    torch.manual_seed(5)
    shapes = [(700, 1), (131, 31), (45, 1)]
    keys = [head_major_layer(t, 3, head_dim, t + 9) for t, _ in shapes]
    values = [head_major_layer(t, 3, head_dim, t + 2) for t, _ in shapes]
    for b in (0, 2):
        keys[b], values[b] = keys[b].to(dtype), values[b].to(dtype)
    counts = [n for _, n in shapes]
    queries = torch.randn(sum(counts), 9, head_dim)
    out = cpu_attention.attention(queries, keys, values, counts)
    widened = cpu_attention.attention(
        queries, [k.float() for k in keys], [v.float() for v in values], counts
    )
    assert torch.equal(out, widened)
    for b, rows in enumerate(out.split(counts)):
        expected = library_attention(queries.split(counts)[b], keys[b].float(), values[b].float())
        torch.testing.assert_close(rows, expected, **TOLERANCE)


@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("prefix_slots", [1, 37, 128, 200, 512, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_shared_prefix_changes_no_bit(prefix_slots, head_dim, dtype):
    # Sessions over one prefix read one shared copy of it (kv/prefixed.py): each row's attention
    # over [shared prefix | own slots] is bit for bit its attention over one buffer holding both,
    # whichever other sessions share the prefix or the call, and read alone; a prefix of any
    # length (the chunk that straddles it and the own slots is read from both).
    torch.manual_seed(prefix_slots + head_dim)
    prefix_keys = head_major_layer(prefix_slots, 3, head_dim, prefix_slots + 7).to(dtype)
    prefix_values = head_major_layer(prefix_slots, 3, head_dim, prefix_slots).to(dtype)
    other_keys = head_major_layer(300, 3, head_dim, 300).to(dtype)
    other_values = head_major_layer(300, 3, head_dim, 310).to(dtype)
    shapes = [(1, 1), (40, 31), (129, 1), (300, 9)]  # own slots, new tokens
    own_keys = [head_major_layer(t, 3, head_dim, t + 3).to(dtype) for t, _ in shapes]
    own_values = [head_major_layer(t, 3, head_dim, t + 1).to(dtype) for t, _ in shapes]
    counts = [n for _, n in shapes]
    queries = torch.randn(sum(counts) + 1, 9, head_dim) * 2
    shared = cpu_attention.attention(
        queries,
        [*own_keys, other_keys[:5]],
        [*own_values, other_values[:5]],
        [*counts, 1],
        prefixes=[(other_keys, other_values), (prefix_keys, prefix_values)],
        prefix_of=[1, 1, 1, 1, 0],
    ).split([*counts, 1])
    for b, rows in enumerate(queries.split([*counts, 1])[:-1]):
        whole_keys = torch.cat([prefix_keys, own_keys[b]])
        whole_values = torch.cat([prefix_values, own_values[b]])
        alone = cpu_attention.attention(rows, [whole_keys], [whole_values], [counts[b]])
        assert torch.equal(shared[b], alone), b
        expected = library_attention(rows, whole_keys.float(), whole_values.float())
        torch.testing.assert_close(alone, expected, **TOLERANCE)
    whole = [torch.cat([other_keys, other_keys[:5]]), torch.cat([other_values, other_values[:5]])]
    last = cpu_attention.attention(queries[-1:], [whole[0]], [whole[1]], [1])
    assert torch.equal(shared[-1], last)


def test_refuses_a_prefix_it_cannot_read_with_its_sequence():
    keys = torch.randn(5, 3, 64)
    half = keys.bfloat16()
    with pytest.raises(RuntimeError, match="one dtype"):
        cpu_attention.attention(torch.randn(1, 9, 64), [keys], [keys], [1], [(half, half)], [0])
    with pytest.raises(RuntimeError, match="same slots"):
        cpu_attention.attention(
            torch.randn(1, 9, 64), [keys], [keys], [1], [(keys[:3], keys[:2])], [0]
        )
    with pytest.raises(RuntimeError, match="no prefix"):
        cpu_attention.attention(torch.randn(1, 9, 64), [keys], [keys], [1], [], [0])


def test_rejects_inputs_it_cannot_serve():
    keys = [torch.randn(5, 3, 64)]
    with pytest.raises(RuntimeError, match="float32"):
        cpu_attention.attention(torch.randn(1, 9, 64), [keys[0].double()], [keys[0].double()], [1])
    with pytest.raises(RuntimeError, match="one dtype"):
        cpu_attention.attention(torch.randn(1, 9, 64), keys, [keys[0].bfloat16()], [1])
    with pytest.raises(RuntimeError, match="multiple"):
        cpu_attention.attention(torch.randn(1, 8, 64), keys, keys, [1])
    with pytest.raises(RuntimeError, match="one keys"):
        cpu_attention.attention(torch.randn(2, 9, 64), keys, keys, [1, 1])
    with pytest.raises(RuntimeError, match="same number"):
        cpu_attention.attention(torch.randn(1, 9, 64), keys, [torch.randn(4, 3, 64)], [1])
    with pytest.raises(RuntimeError, match=r"num_new\[0\]"):
        cpu_attention.attention(torch.randn(6, 9, 64), keys, keys, [6])
    with pytest.raises(RuntimeError, match="add up"):
        cpu_attention.attention(torch.randn(3, 9, 64), keys, keys, [2])


def test_runner_serves_drafts_and_exact_rows_through_the_kernel(tiny_checkpoint, monkeypatch):
    loaded = load_model(str(tiny_checkpoint("qwen3")))  # head_dim 32
    runner = ModelRunner(loaded.config, loaded.weights)
    assert runner._cpu_kernel
    caches = []
    for length in (5, 60, 300):
        cache = runner.new_cache()
        runner.prefill(torch.randint(3, 500, (length,)), cache)
        caches.append(cache)
    reference_caches = [cache.clone() for cache in caches]
    # A draft step of two sequences beside a 7-token exact row, as a shared engine iteration.
    batch = [torch.randint(3, 500, (n,)) for n in (1, 1, 7)]
    calls = []
    real = cpu_attention.attention
    monkeypatch.setattr(cpu_attention, "attention", lambda *a: calls.append(a[3]) or real(*a))

    def inputs(caches):
        return [
            SequenceInput(batch[0], caches[0], fast_attention=True),
            SequenceInput(batch[1], caches[1], fast_attention=True),
            SequenceInput(batch[2], caches[2], num_logits=7),
        ]

    logits = runner.forward(inputs(caches), invariant=True)
    assert calls == [[1, 1, 7]] * loaded.config.num_layers
    runner._cpu_kernel = False
    expected = runner.forward(inputs(reference_caches), invariant=True)
    for got, want in zip(logits, expected):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
