"""The same properties on CUDA, where a GPU is present (skipped otherwise)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.compressor_table import TABLE
from tests.test_kernels import (
    CASES,
    FP32_TOLERANCE,
    case,
    expected_attention,
    random_inputs,
    random_packed,
)
from tests.test_model_parity import ATOL
from vericache.engine.engine import Engine
from vericache.engine.request import DecodeMode, Request, SamplingParams
from vericache.kernels import triton_attention, triton_ops
from vericache.kernels.gather import gather_slots
from vericache.kernels.packed_attention import (
    PackedKV,
    packed_attention,
    packed_attention_reference,
)
from vericache.kernels.quant import SUPPORTED_BITS, dequantize_packed
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


@pytest.mark.parametrize("capacities", [(0, 0), (2048, 400)], ids=["same", "other-capacities"])
@pytest.mark.parametrize(
    ("family", "dtype"), [("llama", "float32"), ("llama", "bfloat16"), ("mistral", "float32")]
)
def test_cuda_verification_equals_one_token_steps_bitwise(
    tiny_checkpoint, family, dtype, capacities
):
    """Also over caches of other capacities, which view their buffers with other strides."""
    runner = _runner(tiny_checkpoint(family), dtype)
    prompt, continuation = torch.randint(3, 512, (300,)), torch.randint(3, 512, (31,))
    stepwise, verify = (runner.new_cache(capacity) for capacity in capacities)
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
    for compressor in TABLE:
        (out,) = engine.generate([Request(ids, 180, params, DecodeMode.VERICACHE, compressor, 8)])
        assert out.token_ids == full.token_ids


# Triton ops against their torch references (vericache/kernels/triton_ops.py).

needs_triton = pytest.mark.skipif(not triton_ops.available(), reason="needs triton")


def inputs_to_cuda(q, packed, residual_keys, residual_values, window_mask):
    tensors = {f.name: getattr(packed, f.name) for f in dataclasses.fields(packed)}
    packed = PackedKV(**{k: v.cuda() if torch.is_tensor(v) else v for k, v in tensors.items()})
    rest = (residual_keys, residual_values, window_mask)
    return q.cuda(), packed, *(t.cuda() if t is not None else None for t in rest)


def _tolerance(dtype):
    if dtype == torch.float32:
        return FP32_TOLERANCE
    # The kernel rounds probabilities to the cache dtype before the value product.
    eps = torch.finfo(dtype).eps
    return dict(rtol=2 * eps, atol=2 * eps)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", list(CASES))
def test_triton_packed_attention_matches_reference(name, dtype):
    inputs = inputs_to_cuda(*random_inputs(CASES[name], dtype=dtype))
    actual = triton_attention.packed_attention(*inputs)
    reference = packed_attention_reference(*inputs)
    assert actual.shape == reference.shape and actual.dtype == dtype
    expected = expected_attention(*inputs)
    torch.testing.assert_close(actual.double(), expected, **_tolerance(dtype))
    torch.testing.assert_close(reference.double(), expected, **_tolerance(dtype))


@needs_triton
@pytest.mark.parametrize("bits", SUPPORTED_BITS)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_triton_packed_attention_long_decode(bits, head_dim):
    """8192 quantized slots: many splits per KV head; n = 1 and a 16-token verify-sized step."""
    for num_new in (1, 16):
        shape = case(bits=bits, kv_heads=3, group=3, new=num_new, quantized=8192, residual=100)
        inputs = inputs_to_cuda(
            *random_inputs({**shape, "head_dim": head_dim}, dtype=torch.bfloat16)
        )
        expected = expected_attention(*inputs)
        actual = packed_attention(*inputs)  # the dispatcher picks the Triton kernel on CUDA
        assert torch.equal(actual, triton_attention.packed_attention(*inputs))
        torch.testing.assert_close(actual.double(), expected, **_tolerance(torch.bfloat16))


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", SUPPORTED_BITS)
def test_triton_dequantize_packed_matches_reference(bits, dtype):
    packed = random_packed(256, 4, 64, bits, 32, torch.Generator().manual_seed(bits))
    grouped = packed.key_codes.cuda().unflatten(0, (-1, 32))  # [G, S, H, D*bits/8]
    layouts = [
        (grouped, packed.key_scale.cuda().unsqueeze(1), packed.key_zero.cuda().unsqueeze(1)),
        (packed.value_codes.cuda(), packed.value_scale.cuda(), packed.value_zero.cuda()),
    ]
    for codes, scale, zero in layouts:
        actual = triton_ops.dequantize_packed(codes, bits, scale, zero, dtype)
        # The reference on CPU: on CUDA the public entry dispatches to the kernel under test.
        expected = dequantize_packed(codes.cpu(), bits, scale.cpu(), zero.cpu(), dtype).cuda()
        assert actual.shape == expected.shape and actual.dtype == dtype
        # Equal up to a fused multiply-add's rounding.
        torch.testing.assert_close(actual, expected, rtol=torch.finfo(dtype).eps, atol=1e-6)


@needs_triton
@pytest.mark.parametrize("positions_dtype", [torch.int32, torch.int64])
def test_triton_gather_slots_matches_reference(positions_dtype):
    generator = torch.Generator().manual_seed(0)
    keys, values = torch.randn(2, 600, 4, 96, generator=generator).bfloat16().cuda()
    positions = torch.randint(0, 10**6, (600, 4), generator=generator).to(positions_dtype).cuda()
    slot_index = torch.randint(0, 600, (150, 4), generator=generator).cuda()
    cpu = [t.cpu() for t in (keys, values, positions, slot_index)]
    expected = [t.cuda() for t in gather_slots(*cpu)]  # the reference, run on CPU
    actual = triton_ops.gather_slots(keys, values, positions, slot_index)
    for got, want in zip(actual, expected):
        assert got.dtype == want.dtype and torch.equal(got, want)
