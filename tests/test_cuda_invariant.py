"""The batch-invariant Triton attention and the strided Triton callers on CUDA (skipped without
it): results against float64 references, and a token's bits the same decoded alone as verified
among others (over a whole model and caches of other capacities: tests/test_cuda.py)."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch
import torch.nn.functional as F

from tests.compressor_table import pick
from tests.test_cuda import inputs_to_cuda
from tests.test_kernels import CASES, random_inputs
from tests.test_prefixed import _decode
from vericache.engine.engine import Engine
from vericache.engine.request import DecodeMode, Request, SamplingParams
from vericache.kernels import triton_attention, triton_invariant_attention, triton_ops
from vericache.kernels.gather import gather_slots
from vericache.kernels.packed_attention import packed_attention_reference
from vericache.kv.prefixed import shared_clone
from vericache.model.kernels import attention, visibility_mask
from vericache.model.loader import load_model
from vericache.model.runner import ModelRunner

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not triton_ops.available(), reason="needs CUDA and Triton"),
]

DTYPES = {  # (model dtype, cache dtype) -> tolerance against float64
    (torch.float32, torch.float32): 1e-5,
    (torch.float32, torch.bfloat16): 1e-5,  # keys widened in registers: float32 products
    (torch.bfloat16, torch.bfloat16): 2e-2,
    (torch.float16, torch.float16): 4e-3,
}


def _head_major(
    num_slots: int, num_kv_heads: int, head_dim: int, capacity: int, dtype, device="cuda"
):
    """Keys and values [num_slots, H, D] viewed from [H, capacity, D] buffers, as caches hold
    them (strides depend on the capacity)."""
    buffers = torch.randn(2, num_kv_heads, capacity, head_dim, device=device).to(dtype)
    return buffers[0].transpose(0, 1)[:num_slots], buffers[1].transpose(0, 1)[:num_slots]


def _reference(q, keys, values, num_slots, window_mask):
    num_new, num_heads, head_dim = q.shape
    group = num_heads // keys.shape[1]
    keys, values = (t[:num_slots].double().transpose(0, 1) for t in (keys, values))
    mask = visibility_mask(num_new, num_slots, window_mask, q.device)
    if window_mask is not None:
        mask = mask.repeat_interleave(group, dim=0)
    out = F.scaled_dot_product_attention(
        q.double().transpose(0, 1),
        keys.repeat_interleave(group, dim=0),
        values.repeat_interleave(group, dim=0),
        attn_mask=mask,
    )
    return out.transpose(0, 1).reshape(num_new, num_heads * head_dim)


@pytest.mark.parametrize("window", [None, 300])
@pytest.mark.parametrize("dtypes", list(DTYPES), ids=lambda d: f"{d[0]}-{d[1]}")
def test_invariant_attention_matches_reference_and_single_steps(dtypes, window):
    model_dtype, cache_dtype = dtypes
    torch.manual_seed(0)
    num_kv_heads, group, head_dim, prefix, num_new = 3, 3, 64, 1000, 31
    num_slots = prefix + num_new
    keys, values = _head_major(num_slots, num_kv_heads, head_dim, 2048, cache_dtype)
    q = torch.randn(num_new, num_kv_heads * group, head_dim, device="cuda").to(model_dtype)
    window_mask = None
    if window is not None:
        slots = torch.arange(num_slots, device="cuda")
        queries = slots[prefix:].view(1, -1, 1)
        window_mask = (slots.view(1, 1, -1) > queries - window).expand(num_kv_heads, -1, -1)
    verified = triton_invariant_attention.invariant_attention(
        q, keys, values, num_slots, window_mask
    )
    assert verified.dtype == model_dtype
    expected = _reference(q, keys, values, num_slots, window_mask)
    tolerance = DTYPES[dtypes]
    torch.testing.assert_close(verified.double(), expected, atol=tolerance, rtol=tolerance)
    for m in range(num_new):
        alone_mask = None if window_mask is None else window_mask[:, m : m + 1, : prefix + m + 1]
        alone = triton_invariant_attention.invariant_attention(
            q[m : m + 1], keys, values, prefix + m + 1, alone_mask
        )
        assert torch.equal(alone, verified[m : m + 1]), f"token {m}"


# Shared prefixes' lengths other than whole blocks (any length will do): the block holding slot P
# reads the prefix's last slots and the cache's first. Under PREFIX_BLOCK, a cascade has no prefix
# pass; 2,999 is a session's whole prefix.
UNALIGNED_PREFIXES = [1, 37, 100, 129, 2999]
# (new tokens, own slots) after a shared prefix: one-token steps and 31-token verifications.
PREFIX_SEQUENCES = [(1, 1), (1, 300), (5, 5), (5, 77), (31, 31), (31, 300)]


def check_prefix_is_the_concatenation(
    device, dtypes, shape, num_prefix: int, sequences=PREFIX_SEQUENCES
) -> None:
    """A shared prefix read as a segment of its own (kv/prefixed.py) gives the attention over
    one buffer [prefix | cache] bit for bit, and a token's bits the same alone as verified."""
    model_dtype, cache_dtype = dtypes
    num_kv_heads, group, head_dim = shape
    torch.manual_seed(0)
    kernel = triton_invariant_attention.invariant_attention
    prefix = _head_major(num_prefix, num_kv_heads, head_dim, num_prefix + 64, cache_dtype, device)
    most = max(slots for _, slots in sequences)
    keys, values = _head_major(most, num_kv_heads, head_dim, most + 9, cache_dtype, device)
    for num_new, num_slots in sequences:
        q = torch.randn(num_new, num_kv_heads * group, head_dim, device=device).to(model_dtype)
        split = kernel(q, keys, values, num_slots, prefix_keys=prefix[0], prefix_values=prefix[1])
        whole_keys, whole_values = (
            torch.cat([p, t[:num_slots]]) for p, t in zip(prefix, (keys, values))
        )
        whole = kernel(q, whole_keys, whole_values, num_prefix + num_slots)
        assert torch.equal(split, whole), f"{num_new} new of {num_slots} own slots"
    tolerance = DTYPES[dtypes]
    expected = _reference(q, whole_keys, whole_values, num_prefix + num_slots, None)
    torch.testing.assert_close(split.double(), expected, atol=tolerance, rtol=tolerance)
    for m in range(num_new):
        alone = kernel(q[m : m + 1], keys, values, num_slots - num_new + m + 1, None, *prefix)
        assert torch.equal(alone, split[m : m + 1]), f"token {m}"


@pytest.mark.parametrize("num_prefix", [256, 512, *UNALIGNED_PREFIXES])
@pytest.mark.parametrize("shape", [(3, 3, 64), (2, 4, 128)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtypes", list(DTYPES), ids=lambda d: f"{d[0]}-{d[1]}")
def test_invariant_attention_over_a_shared_prefix_is_the_concatenation(dtypes, shape, num_prefix):
    check_prefix_is_the_concatenation("cuda", dtypes, shape, num_prefix)


# (new tokens, own slots) of sequences over one prefix: one-token steps and 31-token verifications.
CASCADE_SEQUENCES = [(1, 1), (31, 31), (1, 300), (31, 40), (5, 77), (1, 130)]


def check_cascade_attention(device, dtypes, shape, num_prefix: int) -> None:
    """Sequences over one prefix in one cascade call: each gets the bits of its own call over
    [prefix | cache] in one buffer, and of its call reading the prefix apart."""
    model_dtype, cache_dtype = dtypes
    num_kv_heads, group, head_dim = shape
    torch.manual_seed(0)
    kernel = triton_invariant_attention
    prefix = _head_major(num_prefix, num_kv_heads, head_dim, num_prefix + 64, cache_dtype, device)
    own = [
        (*_head_major(slots, num_kv_heads, head_dim, slots + 9, cache_dtype, device), slots)
        for _, slots in CASCADE_SEQUENCES
    ]
    spans, start = [], 2  # other rows between the sequences' rows: spans need not be adjacent
    for num_new, _ in CASCADE_SEQUENCES:
        spans.append((start, start + num_new))
        start += num_new + 3
    q = torch.randn(start, num_kv_heads * group, head_dim, device=device).to(model_dtype)
    together = kernel.cascade_attention(q, spans, own, *prefix)
    for (start, end), (keys, values, slots), got in zip(spans, own, together):
        whole_kv = [torch.cat([p, t[:slots]]) for p, t in zip(prefix, (keys, values))]
        whole = kernel.invariant_attention(q[start:end], *whole_kv, num_prefix + slots)
        split = kernel.invariant_attention(q[start:end], keys, values, slots, None, *prefix)
        assert torch.equal(got, whole), f"{end - start} new of {slots} own slots"
        assert torch.equal(got, split), f"{end - start} new of {slots} own slots"


@pytest.mark.parametrize("num_prefix", [512, *UNALIGNED_PREFIXES])
@pytest.mark.parametrize("shape", [(3, 3, 64), (2, 4, 128)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtypes", list(DTYPES), ids=lambda d: f"{d[0]}-{d[1]}")
def test_cascade_attention_gives_each_sequence_its_bits_alone(dtypes, shape, num_prefix):
    check_cascade_attention("cuda", dtypes, shape, num_prefix)


def check_prefix_read_by_one_launch(device, monkeypatch, num_prefix: int = 256) -> None:
    """The cascade call reads the prefix's whole PREFIX_BLOCKs in one launch, for the rows of
    every sequence, and each sequence's launch the rest, through a view of the prefix."""
    launches = []
    launch = triton_invariant_attention._launch

    def recording(*args, **kwargs):
        bound = inspect.signature(launch).bind(*args, **kwargs).arguments
        launches.append((bound["pass_name"], bound["keys"], bound.get("prefix")))
        return launch(*args, **kwargs)

    monkeypatch.setattr(triton_invariant_attention, "_launch", recording)
    prefix = _head_major(num_prefix, 2, 64, num_prefix + 64, torch.float32, device)
    own = [(*_head_major(40, 2, 64, 64, torch.float32, device), 40) for _ in range(3)]
    q = torch.randn(33, 4, 64, device=device)
    triton_invariant_attention.cascade_attention(q, [(0, 1), (1, 32), (32, 33)], own, *prefix)
    block = triton_invariant_attention.PREFIX_BLOCK
    aligned = num_prefix // block * block
    if aligned == 0:  # no whole block to share: each sequence's launch reads all of it
        assert [name for name, _, _ in launches] == ["whole"] * 3
        assert all(extra[0].data_ptr() == prefix[0].data_ptr() for _, _, extra in launches)
        return
    reading_prefix = [name for name, keys, _ in launches if keys.data_ptr() == prefix[0].data_ptr()]
    assert reading_prefix == ["prefix"]
    assert launches[0][1].shape[0] == aligned
    assert [name for name, _, _ in launches] == ["prefix", "own", "own", "own"]
    assert launches[0][2] is None
    for _, _, extra in launches[1:]:  # the prefix's tail, if any, read where it lies
        if aligned == num_prefix:
            assert extra is None
        else:
            assert extra[0].data_ptr() == prefix[0][aligned:].data_ptr()
            assert extra[0].shape[0] == num_prefix - aligned


@pytest.mark.parametrize("num_prefix", [256, 300, 37])
def test_cascade_attention_reads_the_prefix_in_one_launch(monkeypatch, num_prefix):
    check_prefix_read_by_one_launch("cuda", monkeypatch, num_prefix)


def check_two_prefixes_in_one_forward(runner: ModelRunner, monkeypatch, steps: int = 3) -> None:
    """Sessions over two shared prefixes, one-token steps and 31-token verifications in one
    forward: each session's logits are those of its private copy decoded alone, bit for bit, and
    each layer of each forward reads each prefix in one cascade call."""
    prefix_caches = []
    for seed in (1, 2):
        cache = runner.new_cache(600)
        ids = torch.randint(3, 512, (600,), generator=torch.Generator().manual_seed(seed))
        runner.prefill(ids, cache, num_logits=0, chunk_size=256)
        prefix_caches.append(cache)
    sessions = [
        (cache, num_new)
        for cache, counts in zip(prefix_caches, [(1, 31, 1), (31, 1)])
        for num_new in counts
    ]
    generator = torch.Generator().manual_seed(3)
    suffixes = [torch.randint(3, 512, (n,), generator=generator).tolist() for _, n in sessions]
    group_sizes = []
    cascade = triton_invariant_attention.cascade_attention

    def counting(q, spans, *args):
        group_sizes.append(len(spans))
        return cascade(q, spans, *args)

    monkeypatch.setattr(triton_invariant_attention, "cascade_attention", counting)
    shared = [shared_clone(cache, 700) for cache, _ in sessions]
    together = _decode(runner, shared, suffixes, steps, invariant=True)
    assert group_sizes == [3, 2] * (steps * runner.config.num_layers)
    for index, ((cache, _), suffix) in enumerate(zip(sessions, suffixes)):
        alone = _decode(runner, [cache.clone(700)], [suffix], steps, invariant=True)[0]
        for step, (got, want) in enumerate(zip(together[index], alone)):
            assert torch.equal(got, want), (index, step)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sessions_over_two_prefixes_read_each_once_with_their_own_bits(
    tiny_checkpoint, monkeypatch, dtype
):
    loaded = load_model(str(tiny_checkpoint("llama")), dtype=dtype, device="cuda")
    runner = ModelRunner(loaded.config, loaded.weights, "cuda")
    check_two_prefixes_in_one_forward(runner, monkeypatch)


def test_invariant_attention_refuses_a_prefix_in_another_dtype_and_a_window_over_one():
    keys, values = _head_major(10, 3, 64, 16, torch.float32)
    q = torch.randn(2, 9, 64, device="cuda")
    kernel = triton_invariant_attention.invariant_attention
    with pytest.raises(ValueError, match="over a cache in"):
        kernel(q, keys, values, 10, None, *_head_major(100, 3, 64, 128, torch.bfloat16))
    window_mask = torch.ones(3, 2, 10, dtype=torch.bool, device="cuda")
    with pytest.raises(ValueError, match="window"):
        kernel(q, keys, values, 10, window_mask, *_head_major(256, 3, 64, 256, torch.float32))


def test_fast_attention_over_16_bit_keys_runs_the_kernel_unconverted():
    torch.manual_seed(1)
    keys, values = _head_major(700, 3, 64, 1024, torch.bfloat16)
    q = torch.randn(1, 9, 64, device="cuda")
    actual = attention(q, keys, values, 700, invariant=False)
    expected = _reference(q, keys.float(), values.float(), 700, None)
    torch.testing.assert_close(actual.double(), expected, atol=1e-5, rtol=1e-5)
    with triton_ops.switched_off():  # library attention over converted keys
        converted = attention(q, keys, values, 700, invariant=False)
    torch.testing.assert_close(actual, converted, atol=1e-5, rtol=1e-5)


def test_float32_model_drafts_over_a_bfloat16_cache(tiny_checkpoint, monkeypatch):
    """The draft steps hand 16-bit keys to the kernel as they are; the output is still full
    decoding's."""
    mixed_calls = []
    kernel = triton_invariant_attention.invariant_attention

    def counting(q, keys, *args, **kwargs):
        mixed_calls.append(keys.dtype != q.dtype)
        return kernel(q, keys, *args, **kwargs)

    monkeypatch.setattr(triton_invariant_attention, "invariant_attention", counting)
    engine = Engine.from_pretrained(str(tiny_checkpoint("llama")), device="cuda")
    ids = tuple(torch.randint(3, 512, (200,), generator=torch.Generator().manual_seed(1)).tolist())
    params = SamplingParams(max_new_tokens=40)
    (full,) = engine.generate([Request(ids, 180, params, DecodeMode.FULL)])
    compressor = dataclasses.replace(pick("streamingllm")[0], dtype="bfloat16")
    (out,) = engine.generate([Request(ids, 180, params, DecodeMode.VERICACHE, compressor, 8)])
    assert out.token_ids == full.token_ids
    assert any(mixed_calls), "no draft step reached the kernel with bfloat16 keys"


@pytest.mark.parametrize("name", ["decode-4bit", "verify-8-tokens", "verify-32-tokens"])
def test_packed_attention_reads_strided_residual_kv(name):
    """Head-major residual buffers are read through their strides, with the same result as
    contiguous copies."""
    q, packed, keys, values, mask = inputs_to_cuda(*random_inputs(CASES[name], torch.bfloat16))
    num_residual, num_kv_heads, head_dim = keys.shape
    buffers = keys.new_zeros(2, num_kv_heads, num_residual + 50, head_dim)
    buffers[0, :, :num_residual] = keys.transpose(0, 1)
    buffers[1, :, :num_residual] = values.transpose(0, 1)
    strided = [buffer.transpose(0, 1)[:num_residual] for buffer in buffers]
    actual = triton_attention.packed_attention(q, packed, *strided, mask)
    assert torch.equal(actual, triton_attention.packed_attention(q, packed, keys, values, mask))
    reference = packed_attention_reference(q, packed, keys, values, mask)
    torch.testing.assert_close(actual, reference, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("layout", ["head-major", "mixed"])
def test_gather_slots_reads_strided_inputs(layout):
    generator = torch.Generator().manual_seed(0)
    keys, values = torch.randn(2, 4, 600, 96, generator=generator).bfloat16().cuda()
    keys, values = keys.transpose(0, 1), values.transpose(0, 1)  # [600, 4, 96], head-major
    if layout == "mixed":  # strides that differ: both are copied first
        values = values.contiguous()
    positions = torch.randint(0, 10**6, (4, 600), generator=generator).cuda().T
    slot_index = torch.randint(0, 600, (4, 150), generator=generator).cuda().T  # [150, 4], strided
    expected = gather_slots(*(t.cpu() for t in (keys, values, positions, slot_index)))
    actual = triton_ops.gather_slots(keys, values, positions, slot_index)
    for got, want in zip(actual, expected):
        assert torch.equal(got.cpu(), want)
