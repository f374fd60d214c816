"""The reference vericache/kernels/ ops against straightforward implementations, on CPU.

Packed attention is checked against "dequantize the whole layer, then plain softmax attention in
float64" over bit widths, group sizes, GQA ratios, numbers of new tokens, block sizes and the
edge cases of an empty quantized part or a residual shorter than the new tokens.
"""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vericache.kernels import cpu_attention, triton_ops
from vericache.kernels.gather import gather_slots
from vericache.kernels.packed_attention import (
    PackedKV,
    packed_attention,
    packed_attention_reference,
)
from vericache.kernels.quant import SUPPORTED_BITS, dequantize, dequantize_packed, pack, unpack
from vericache.kv.quantized import QuantizedLayerKV
from vericache.model.kernels import attention

FP32_TOLERANCE = dict(rtol=1e-5, atol=1e-6)


def random_packed(num_quantized, num_kv_heads, head_dim, bits, group_size, generator) -> PackedKV:
    """Random codes with per-group key and per-slot value statistics that differ everywhere, so a
    wrong group or slot broadcast changes the result."""
    levels = (1 << bits) - 1
    shape, num_groups = (num_quantized, num_kv_heads, head_dim), num_quantized // group_size

    def codes():
        return pack(torch.randint(0, levels + 1, shape, generator=generator), bits)

    def stats(*stat_shape):
        scale = (torch.rand(*stat_shape, generator=generator) + 0.5) / levels
        return scale.half(), torch.randn(*stat_shape, generator=generator).half()

    key_scale, key_zero = stats(num_groups, num_kv_heads, head_dim)
    value_scale, value_zero = stats(num_quantized, num_kv_heads, 1)
    return PackedKV(
        codes(), key_scale, key_zero, codes(), value_scale, value_zero, bits, group_size
    )


def random_inputs(case: dict, dtype=torch.float32, seed: int = 0):
    """q [n, Hq, D], packed part, residual keys and values [R, H, D], optional window mask."""
    generator = torch.Generator().manual_seed(seed)
    num_kv_heads, head_dim = case["kv_heads"], case["head_dim"]
    packed = random_packed(
        case["quantized"], num_kv_heads, head_dim, case["bits"], case["group_size"], generator
    )
    residual = [
        torch.randn(case["residual"], num_kv_heads, head_dim, generator=generator).to(dtype)
        for _ in range(2)
    ]
    num_new, num_heads = case["new"], num_kv_heads * case["group"]
    q = torch.randn(num_new, num_heads, head_dim, generator=generator).to(dtype)
    window_mask = None
    if case.get("window"):
        num_slots = case["quantized"] + case["residual"]
        window_mask = torch.rand(num_kv_heads, num_new, num_slots, generator=generator) > 0.3
        # A token always sees itself, as a sliding window's does.
        window_mask[:, range(num_new), range(num_slots - num_new, num_slots)] = True
    return q, packed, *residual, window_mask


def expected_attention(q, packed: PackedKV, residual_keys, residual_values, window_mask=None):
    """Dequantize the whole layer, then softmax attention with an explicit mask, in float64."""
    dtype, group_size = residual_keys.dtype, packed.group_size
    key_scale = packed.key_scale.repeat_interleave(group_size, dim=0)  # [Tq, H, D]
    key_zero = packed.key_zero.repeat_interleave(group_size, dim=0)
    keys = dequantize_packed(packed.key_codes, packed.bits, key_scale, key_zero, dtype)
    values = dequantize_packed(
        packed.value_codes, packed.bits, packed.value_scale, packed.value_zero, dtype
    )
    keys = torch.cat([keys, residual_keys]).double()  # [T, H, D]
    values = torch.cat([values, residual_values]).double()
    num_new, num_heads, head_dim = q.shape
    num_slots, group = keys.shape[0], num_heads // keys.shape[1]
    keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    scores = torch.einsum("nhd,thd->hnt", q.double(), keys) / head_dim**0.5  # [Hq, n, T]
    last_visible = num_slots - num_new + torch.arange(num_new, device=q.device)
    slots = torch.arange(num_slots, device=q.device)
    visible = slots.unsqueeze(0) <= last_visible.unsqueeze(1)  # [n, T]
    if window_mask is not None:
        visible = visible & window_mask.repeat_interleave(group, 0)
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("hnt,thd->nhd", probs, values).reshape(num_new, num_heads * head_dim)


def case(bits=4, group_size=32, kv_heads=2, group=2, new=1, quantized=256, residual=20, **extra):
    return dict(
        bits=bits,
        group_size=group_size,
        kv_heads=kv_heads,
        group=group,
        new=new,
        quantized=quantized,
        residual=residual,
        head_dim=extra.pop("head_dim", 32),
        **extra,
    )


CASES = {
    "decode-4bit": case(),
    "decode-2bit-gqa4": case(bits=2, group_size=16, group=4, quantized=160),
    "decode-8bit-mha": case(bits=8, group_size=8, group=1, quantized=64),
    "verify-8-tokens": case(new=8, group=3, kv_heads=3),
    "verify-32-tokens": case(new=32, residual=40, head_dim=64),
    "empty-quantized": case(quantized=0, new=5),
    "empty-residual": case(residual=0, new=1),
    "new-tokens-in-quantized-part": case(residual=2, new=6, quantized=64, group_size=16),
    "only-new-tokens-in-residual": case(residual=4, new=4),
    "one-slot": case(quantized=0, residual=1, new=1),
    "no-new-tokens": case(new=0),
    "window": case(new=4, window=True),
    "window-gqa-2bit": case(bits=2, group=4, new=3, residual=9, window=True),
}


# The dispatcher (the C++ kernel on CPU where it applies) and the pure-torch reference.
IMPLEMENTATIONS = {"dispatcher": packed_attention, "reference": packed_attention_reference}


@pytest.mark.parametrize("block_size", [512, 64, 40, 1])
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("implementation", list(IMPLEMENTATIONS))
def test_packed_attention_matches_full_dequantize(implementation, name, block_size):
    inputs = random_inputs(CASES[name])
    actual = IMPLEMENTATIONS[implementation](*inputs, block_size=block_size)
    assert actual.shape == (CASES[name]["new"], inputs[0].shape[1] * inputs[0].shape[2])
    assert actual.dtype == torch.float32
    torch.testing.assert_close(actual.double(), expected_attention(*inputs), **FP32_TOLERANCE)


@settings(max_examples=40, deadline=None)
@given(
    bits=st.sampled_from(SUPPORTED_BITS),
    group_size=st.sampled_from([1, 8, 32]),
    num_groups=st.integers(0, 6),
    kv_heads=st.integers(1, 3),
    group=st.integers(1, 4),
    new=st.integers(1, 9),
    residual=st.integers(0, 40),
    block_size=st.integers(1, 96),
    window=st.booleans(),
    seed=st.integers(0, 2**16),
    implementation=st.sampled_from(list(IMPLEMENTATIONS)),
)
def test_packed_attention_fuzz(
    num_groups, new, residual, block_size, seed, implementation, **params
):
    quantized = num_groups * params["group_size"]
    new = min(new, quantized + residual)
    if new == 0:
        return
    inputs = random_inputs(
        case(new=new, quantized=quantized, residual=residual, **params), seed=seed
    )
    actual = IMPLEMENTATIONS[implementation](*inputs, block_size=block_size)
    torch.testing.assert_close(actual.double(), expected_attention(*inputs), **FP32_TOLERANCE)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_packed_attention_half_caches(dtype):
    inputs = random_inputs(case(new=4, quantized=512), dtype=dtype)
    actual = packed_attention_reference(*inputs, block_size=128)
    assert actual.dtype == dtype
    # Equal up to rounding the output to the cache dtype.
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(actual.double(), expected_attention(*inputs), rtol=eps, atol=eps)


@pytest.mark.skipif(
    not cpu_attention.accepts(torch.device("cpu"), torch.float32, 32),
    reason="the C++ kernel could not be built here",
)
@pytest.mark.parametrize(
    ("name", "dtype", "by_kernel"),
    [
        ("decode-4bit", torch.float32, True),
        ("verify-8-tokens", torch.float32, True),
        ("decode-2bit-gqa4", torch.float32, True),
        ("window", torch.float32, False),  # the kernel takes no mask
        ("new-tokens-in-quantized-part", torch.float32, False),  # some packed slots are new
        ("empty-quantized", torch.float32, False),
        ("decode-4bit", torch.bfloat16, False),  # float32 caches only
    ],
)
def test_dispatcher_attends_over_packed_codes_on_cpu(monkeypatch, name, dtype, by_kernel):
    """On CPU the packed part goes to the C++ kernel where every packed slot is visible to every
    new token of a float32 layer, and to the reference's blocks otherwise."""
    calls = []
    kernel = cpu_attention.packed_attention
    monkeypatch.setattr(cpu_attention, "packed_attention", lambda *a: calls.append(1) or kernel(*a))
    inputs = random_inputs(CASES[name], dtype=dtype)
    actual = packed_attention(*inputs)
    assert bool(calls) == by_kernel
    expected = packed_attention_reference(*inputs)
    if by_kernel:  # other arithmetic: equal up to float32 rounding
        torch.testing.assert_close(actual, expected, **FP32_TOLERANCE)
    else:
        assert torch.equal(actual, expected)


def test_cpu_kernel_rejects_malformed_packed_layers():
    if not cpu_attention.accepts(torch.device("cpu"), torch.float32, 32):
        pytest.skip("the C++ kernel could not be built here")
    q, packed, keys, values, _ = random_inputs(case(new=1, quantized=64, kv_heads=2, group=2))
    rows = q.float().view(1, 2, 2, 32).permute(1, 2, 0, 3).reshape(2, 2, 32)
    with pytest.raises(RuntimeError, match="key_scale"):
        half_scale = dataclasses.replace(packed, key_scale=packed.key_scale.float())
        cpu_attention.packed_attention(rows, half_scale, keys, values, 1)
    with pytest.raises(RuntimeError, match="D dimensions"):
        cpu_attention.packed_attention(rows[..., :16], packed, keys[..., :16], values[..., :16], 1)
    with pytest.raises(RuntimeError, match="older than the new tokens"):
        cpu_attention.packed_attention(rows, packed, keys[:0], values[:0], 2)


def test_earlier_new_tokens_do_not_see_later_ones():
    q, packed, keys, values, _ = random_inputs(case(new=4, residual=10))
    before = packed_attention_reference(q, packed, keys, values)
    keys[-1], values[-1] = keys[-1] + 5, values[-1] * 3  # the last new token only
    after = packed_attention_reference(q, packed, keys, values)
    assert torch.equal(before[:3], after[:3])
    assert not torch.allclose(before[3], after[3])


@pytest.mark.parametrize("bits", SUPPORTED_BITS)
def test_matches_the_layer_path(bits):
    """QuantizedLayerKV's tensors, as stored, give the model's attention over keys_values()."""
    generator = torch.Generator().manual_seed(bits)
    layer = QuantizedLayerKV(2, 32, torch.float32, "cpu", bits=bits, group_size=8)
    keys, values = torch.randn(2, 150, 2, 32, generator=generator)
    layer.append(keys[:100], values[:100], torch.arange(100))
    layer.flush(16)  # quantizes 96 slots, keeps 4 in the residual
    layer.append(keys[100:], values[100:], torch.arange(100, 150))  # 50 new tokens
    q = torch.randn(50, 6, 32, generator=generator)
    cached_keys, cached_values = layer.keys_values()
    expected = attention(q, cached_keys, cached_values, layer.num_slots, invariant=False)
    state = layer.to_state().tensors
    packed = PackedKV.from_tensors(state, bits, group_size=8)
    actual = packed_attention(q, packed, state["residual_keys"], state["residual_values"])
    assert packed.num_slots == 96
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


def test_rejects_inconsistent_inputs():
    q, packed, keys, values, _ = random_inputs(case(new=2, quantized=64, residual=0))
    with pytest.raises(ValueError, match="new tokens"):
        packed_attention(torch.zeros(65, *q.shape[1:]), packed, keys, values)
    with pytest.raises(ValueError, match="cache"):
        packed_attention(q.double(), packed, keys, values)
    with pytest.raises(ValueError, match="whole groups"):
        dataclasses.replace(packed, key_codes=packed.key_codes[:60])
    with pytest.raises(ValueError, match="key_scale"):
        dataclasses.replace(packed, key_scale=packed.key_scale[:1])


@pytest.mark.parametrize("bits", SUPPORTED_BITS)
def test_unpack_inverts_pack(bits):
    codes = torch.randint(0, 1 << bits, (5, 3, 16), dtype=torch.uint8)
    assert torch.equal(unpack(pack(codes, bits), bits), codes)


@pytest.mark.parametrize("bits", SUPPORTED_BITS)
def test_dequantize_packed_matches_unpack_then_dequantize(bits):
    packed = random_packed(64, 3, 16, bits, 16, torch.Generator().manual_seed(0))
    grouped = packed.key_codes.unflatten(0, (4, 16))  # [G, S, H, D*bits/8]
    scale, zero = packed.key_scale.unsqueeze(1), packed.key_zero.unsqueeze(1)  # [G, 1, H, D]
    expected = dequantize(unpack(grouped, bits), scale, zero, torch.float32)
    actual = dequantize_packed(grouped, bits, scale, zero, torch.float32)
    torch.testing.assert_close(actual, expected, rtol=1e-7, atol=0)


def test_gather_slots_matches_a_loop():
    generator = torch.Generator().manual_seed(0)
    keys, values = torch.randn(2, 30, 3, 8, generator=generator)
    positions = torch.randint(0, 1000, (30, 3), generator=generator, dtype=torch.int32)
    slot_index = torch.randint(0, 30, (12, 3), generator=generator)
    kept_keys, kept_values, kept_positions = gather_slots(keys, values, positions, slot_index)
    for i, h in [(i, h) for i in range(12) for h in range(3)]:
        slot = slot_index[i, h]
        assert torch.equal(kept_keys[i, h], keys[slot, h])
        assert torch.equal(kept_values[i, h], values[slot, h])
        assert kept_positions[i, h] == positions[slot, h]


def test_triton_ops_import_without_triton_or_cuda():
    has_triton = importlib.util.find_spec("triton") is not None
    assert triton_ops.available() == (has_triton and torch.cuda.is_available())
