"""Every compressor through one conformance suite, then each mechanism's invariants: StreamingLLM's
sinks and recent window, KIVI's bit packing, quantization error and full-precision residual."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.compressor_table import pick, row_id
from vericache.compress import KIVI, CompressionKind, StreamingLLM, build_compressor
from vericache.errors import CacheStateError, InvalidRequestError
from vericache.kernels.quant import dequantize, pack, quantize, unpack
from vericache.kv.cache import DenseLayerKV, KVCache
from vericache.kv.exact import ExactKV
from vericache.kv.quantized import QuantizedLayerKV

NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM = 2, 2, 32
NUM_TOKENS = 100
FP32_BYTES, FP16_BYTES = 4, 2
# Small enough that a 100-token cache quantizes 6 blocks of 16 (96 tokens) and keeps 4 exact.
GROUP_SIZE, RESIDUAL_LENGTH = 8, 16

# The table's rows whose byte counts this file derives (`_expected_nbytes`): they need no model.
COMPRESSORS = pick("streamingllm", "kivi")


def _kv(num_tokens: int, seed: int):
    """Keys with per-channel offsets and scales (KIVI's outlier channels); values N(0, 1)."""
    generator = torch.Generator().manual_seed(seed)
    shape = (num_tokens, NUM_KV_HEADS, HEAD_DIM)
    channel_scale = torch.exp(torch.randn(NUM_KV_HEADS, HEAD_DIM, generator=generator))
    channel_offset = 3 * torch.randn(NUM_KV_HEADS, HEAD_DIM, generator=generator)
    keys = torch.randn(shape, generator=generator) * channel_scale + channel_offset
    return keys, torch.randn(shape, generator=generator)


def _full_cache(num_tokens: int = NUM_TOKENS, seed: int = 0) -> KVCache:
    layers = [
        DenseLayerKV.from_tensors(*_kv(num_tokens, seed + 100 * index), torch.arange(num_tokens))
        for index in range(NUM_LAYERS)
    ]
    return KVCache(layers, num_tokens=num_tokens)


def _append(cache: KVCache, num_new: int, seed: int) -> None:
    positions = torch.arange(cache.num_tokens, cache.num_tokens + num_new)
    for index, layer in enumerate(cache.layers):
        layer.append(*_kv(num_new, seed + 100 * index), positions)
    cache.advance(num_new)


def _snapshot(cache: KVCache):
    layers = [(layer.positions(), *layer.keys_values()) for layer in cache.layers]
    return cache.num_tokens, cache.nbytes, [[t.clone() for t in layer] for layer in layers]


def _assert_unchanged(cache: KVCache, snapshot) -> None:
    num_tokens, nbytes, layers = snapshot
    assert (cache.num_tokens, cache.nbytes) == (num_tokens, nbytes)
    for layer, (positions, keys, values) in zip(cache.layers, layers, strict=True):
        now_keys, now_values = layer.keys_values()
        assert torch.equal(layer.positions(), positions)
        assert torch.equal(now_keys, keys) and torch.equal(now_values, values)


def _budget(compressor: StreamingLLM, num_tokens: int) -> int:
    window = math.ceil(Fraction(num_tokens) / Fraction(compressor.ratio))
    return max(compressor.num_sinks + 1, window)


def _expected_nbytes(compressor, num_tokens: int) -> int:
    """Bytes of the compressed format, counted from its definition."""
    per_token = NUM_KV_HEADS * HEAD_DIM  # elements of one token's keys (or values) in one layer
    if isinstance(compressor, StreamingLLM):
        num_slots = min(num_tokens, _budget(compressor, num_tokens))
        return NUM_LAYERS * 2 * num_slots * per_token * FP32_BYTES
    group = compressor.group_size
    block = compressor.residual_length or group
    num_quantized = num_tokens // block * block
    codes = 2 * num_quantized * per_token * compressor.bits // 8
    key_meta = 2 * (num_quantized // group) * per_token * FP16_BYTES  # per channel and group
    value_meta = 2 * num_quantized * NUM_KV_HEADS * FP16_BYTES  # per token and head
    residual = 2 * (num_tokens - num_quantized) * per_token * FP32_BYTES
    return NUM_LAYERS * (codes + key_meta + value_meta + residual)


def _error_bound(x: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Sound per-element bound on |dequantize(quantize(x)) - x| for min-max statistics along `dim`.

    The fp16 zero z' <= low and the fp16 scale s' >= (high - z') / L (L = 2**bits - 1, s at least
    1e-6) make the grid cover [low, high], so every element rounds to its nearest step: the error
    is at most s' / 2. s' exceeds its exact value by one fp16 rounding (relative 2**-10 when
    rounded up, absolute 2**-24 when subnormal), and z' lies below low by as much, which s'
    absorbs. Plus fp32 arithmetic slack.
    """
    levels = (1 << bits) - 1
    x64 = x.double()
    low, high = x64.amin(dim, keepdim=True), x64.amax(dim, keepdim=True)
    zero_gap = low.abs() * 2**-10 + 2**-24
    scale = ((high - low + zero_gap) / levels).clamp_min(1e-6) * (1 + 2**-10) + 2**-24
    slack = 2**-20 * (x64.abs() + low.abs() + levels * scale)
    return (scale / 2 + slack).to(x.dtype)


# Conformance: every compressor


@pytest.mark.parametrize("compressor", COMPRESSORS, ids=row_id)
def test_compress_leaves_source_unchanged(compressor):
    full = _full_cache()
    before = _snapshot(full)
    compressed = compressor.compress(full)
    _append(compressed, 40, seed=7)  # editing the compressed cache must not reach the source
    compressor.update(compressed)
    _assert_unchanged(full, before)


@pytest.mark.parametrize("compressor", COMPRESSORS, ids=row_id)
def test_compressed_cache_counts_every_token_in_fewer_bytes(compressor):
    full = _full_cache()
    compressed = compressor.compress(full)
    assert compressed.num_tokens == full.num_tokens == NUM_TOKENS
    assert full.nbytes == NUM_LAYERS * 2 * NUM_TOKENS * NUM_KV_HEADS * HEAD_DIM * FP32_BYTES
    assert compressed.nbytes == _expected_nbytes(compressor, NUM_TOKENS)
    if compressor.kind is CompressionKind.QUANTIZATION or compressor.ratio > 1:
        assert compressed.nbytes < full.nbytes and not compressed.is_full
    else:
        assert compressed.nbytes == full.nbytes and compressed.is_full


@pytest.mark.parametrize("compressor", COMPRESSORS, ids=row_id)
def test_full_precision_slots_hold_the_source_kv_at_original_positions(compressor):
    full = _full_cache()
    compressed = compressor.compress(full)
    for layer, source in zip(compressed.layers, full.layers, strict=True):
        positions = layer.positions().long()
        assert torch.equal(positions, positions[:, :1].expand_as(positions))  # same for every head
        kept = positions[:, 0]
        assert bool((kept[1:] > kept[:-1]).all())  # ascending, no repeats
        assert int(kept[0]) == 0 and int(kept[-1]) == NUM_TOKENS - 1
        exact = layer.num_slots - getattr(layer, "num_quantized", 0)  # newest full-precision slots
        keys, values = layer.keys_values()
        source_keys, source_values = source.keys_values()
        assert torch.equal(keys[-exact:], source_keys[kept[-exact:]])
        assert torch.equal(values[-exact:], source_values[kept[-exact:]])


@pytest.mark.parametrize("compressor", COMPRESSORS, ids=row_id)
def test_uncommitted_tokens_roll_back(compressor):
    compressed = compressor.compress(_full_cache())
    before = _snapshot(compressed)
    _append(compressed, 3, seed=11)
    compressed.truncate(NUM_TOKENS)
    _assert_unchanged(compressed, before)


def test_registry_builds_by_name_with_labels():
    assert build_compressor("streamingllm", ratio=4) == StreamingLLM(ratio=4)
    assert build_compressor("streamingllm", ratio=4).label == "streamingllm-4x"
    assert build_compressor("streamingllm", ratio=8.0).label == "streamingllm-8x"
    assert build_compressor("streamingllm", ratio=2.5).label == "streamingllm-2.5x"
    assert build_compressor("kivi", bits=4).label == "kivi-4bit"
    assert build_compressor("kivi", bits=2, group_size=None) == KIVI(bits=2)  # None: default


BAD_REQUESTS = [
    ("nope", {}), ("streamingllm", {"bits": 4}), ("kivi", {"ratio": 4}),
    ("streamingllm", {"ratio": 0.5}), ("streamingllm", {"ratio": 0}),
    ("streamingllm", {"ratio": float("nan")}), ("streamingllm", {"ratio": float("inf")}),
    ("streamingllm", {"ratio": 1e9}),
    ("kivi", {"bits": 1}), ("kivi", {"bits": 3}), ("kivi", {"bits": 16}),
    ("kivi", {"group_size": 32, "residual_length": 48}), ("snapkv", {"kernel_size": 4}),
    ("h2o", {"recent_fraction": 1.0}), ("kvquant", {"outlier_fraction": 0.5}),
    ("streamingllm", {"dtype": "int8"}), ("kivi", {"dtype": "bfloat16"}),
]  # fmt: skip


@pytest.mark.parametrize("name, params", BAD_REQUESTS)
def test_registry_rejects_bad_requests(name, params):
    with pytest.raises(InvalidRequestError):
        build_compressor(name, **params)


@pytest.mark.parametrize("dtype, short", [(torch.bfloat16, "bf16"), (torch.float16, "fp16")])
def test_token_dropping_stores_its_slots_in_the_dtype_it_names(dtype, short):
    name = str(dtype).removeprefix("torch.")
    compressor = build_compressor("streamingllm", ratio=4, sliding=True, dtype=name)
    assert compressor.label == f"streamingllm-4x-{short}"
    assert build_compressor(**compressor.spec()["params"], name="streamingllm") == compressor
    full = _full_cache()
    cache = compressor.compress(full)
    reference = StreamingLLM(ratio=4, sliding=True).compress(full)
    assert 2 * cache.nbytes == reference.nbytes
    for layer, expected in zip(cache.layers, reference.layers, strict=True):
        keys, values = (t[: layer.num_slots] for t in layer.keys_values())
        expected_keys, expected_values = (t[: layer.num_slots] for t in expected.keys_values())
        assert keys.dtype == values.dtype == dtype
        assert torch.equal(keys, expected_keys.to(dtype))
        assert torch.equal(values, expected_values.to(dtype))
        assert torch.equal(layer.positions(), expected.positions())
    # Tokens committed later arrive in float32: stored in 16 bits too, through online eviction.
    _append(cache, 40, seed=3)
    compressor.update(cache)
    assert all(layer.keys_values()[0].dtype == dtype for layer in cache.layers)


# StreamingLLM


@pytest.mark.parametrize("num_sinks", [0, 4])
@pytest.mark.parametrize("ratio", [1, 2, 3.5, 4, 8])
@pytest.mark.parametrize("num_tokens", [1, 5, 6, 37, 100])
def test_streamingllm_keeps_sinks_and_recent_window(num_tokens, ratio, num_sinks):
    compressor = StreamingLLM(ratio=ratio, num_sinks=num_sinks)
    budget = _budget(compressor, num_tokens)
    if num_tokens <= budget:
        expected = list(range(num_tokens))
    else:
        expected = [*range(num_sinks), *range(num_tokens - (budget - num_sinks), num_tokens)]
    compressed = compressor.compress(_full_cache(num_tokens))
    assert compressed.budgets == [budget] * NUM_LAYERS
    for layer in compressed.layers:
        assert layer.positions().tolist() == [[p] * NUM_KV_HEADS for p in expected]


@pytest.mark.parametrize("sliding", [False, True])
def test_streamingllm_update_after_committed_tokens(sliding):
    compressor = StreamingLLM(ratio=4, sliding=sliding)
    cache = compressor.compress(_full_cache())  # budget 25: positions 0..3 and 79..99
    appended = _full_cache(NUM_TOKENS + 33, seed=5)  # source of the tokens committed later
    for num_new in (1, 2, 30):  # the last chunk is longer than the recent window
        cache.append_exact(ExactKV.of(appended, cache.num_tokens, cache.num_tokens + num_new))
        compressor.update(cache)
    total = NUM_TOKENS + 33
    if sliding:
        expected = [*range(4), *range(total - 21, total)]
    else:
        expected = [*range(4), *range(79, NUM_TOKENS), *range(NUM_TOKENS, total)]
    assert cache.num_tokens == total
    for layer, source in zip(cache.layers, appended.layers, strict=True):
        assert layer.num_slots == len(expected)
        assert layer.positions().tolist() == [[p] * NUM_KV_HEADS for p in expected]
        newest = torch.arange(NUM_TOKENS, total)[-21:]
        assert torch.equal(layer.keys_values()[0][-21:], source.keys_values()[0][newest])


# KIVI


@settings(max_examples=80, deadline=None, derandomize=True, database=None)
@given(
    bits=st.sampled_from([2, 4, 8]),
    leading=st.lists(st.integers(1, 4), max_size=3),
    num_bytes=st.integers(1, 12),
    seed=st.integers(0, 2**31 - 1),
)
def test_pack_unpack_round_trip(bits, leading, num_bytes, seed):
    shape = (*leading, num_bytes * 8 // bits)
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1 << bits, shape, generator=generator, dtype=torch.uint8)
    packed = pack(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (*leading, num_bytes)
    assert torch.equal(unpack(packed, bits), codes)


def test_pack_puts_lowest_bits_first():
    assert pack(torch.tensor([1, 2, 3, 0], dtype=torch.uint8), 2).tolist() == [1 | 2 << 2 | 3 << 4]
    assert pack(torch.tensor([0xA, 0x5], dtype=torch.uint8), 4).tolist() == [0x5A]


QUANTIZE_DATA = {
    "normal": lambda x: x,
    "offset": lambda x: 100 + 0.01 * x,  # fp16 rounding of the zero point dominates the error
    "constant": lambda x: torch.full_like(x, 3.3),
    "mixed_scales": lambda x: x * 10.0 ** torch.arange(-4, 2).view(6, 1, 1, 1),
}


@pytest.mark.parametrize("dim", [1, -1])
@pytest.mark.parametrize("data", sorted(QUANTIZE_DATA))
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_quantize_error_within_half_step_plus_fp16_rounding(bits, data, dim):
    x = QUANTIZE_DATA[data](torch.randn(6, 8, 2, 32, generator=torch.Generator().manual_seed(bits)))
    codes, scale, zero = quantize(x, bits, dim)
    assert codes.dtype == torch.uint8 and codes.shape == x.shape and int(codes.max()) < 1 << bits
    assert scale.dtype == zero.dtype == torch.float16 and scale.shape == x.sum(dim, True).shape
    error = (dequantize(codes, scale, zero, torch.float32) - x).abs()
    assert (error <= _error_bound(x, bits, dim)).all()


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_kivi_quantizes_keys_per_channel_and_values_per_token(bits):
    full = _full_cache()
    compressed = KIVI(bits, GROUP_SIZE, RESIDUAL_LENGTH).compress(full)
    for layer, source in zip(compressed.layers, full.layers, strict=True):
        assert layer.num_quantized == 96
        keys, values = layer.keys_values()
        source_keys, source_values = source.keys_values()
        groups = source_keys[:96].unflatten(0, (-1, GROUP_SIZE))  # [G, group_size, H, D]
        key_bound = _error_bound(groups, bits, dim=1).flatten(0, 1)
        assert ((keys[:96] - source_keys[:96]).abs() <= key_bound).all()
        value_bound = _error_bound(source_values[:96], bits, dim=-1)
        assert ((values[:96] - source_values[:96]).abs() <= value_bound).all()
        assert not torch.equal(keys[:96], source_keys[:96])  # it did quantize
        # The newest tokens (the 4 past the last whole residual block) come back bit for bit.
        assert torch.equal(keys[96:], source_keys[96:])
        assert torch.equal(values[96:], source_values[96:])


def test_kivi_4bit_is_3x_smaller_than_fp32_on_a_long_cache():
    # Per token and head, quantized: 32 code bytes (32 channels at 4 bits), key scale and zero
    # amortised over a group of 8 (2 * 32 * 2 / 8 = 16 bytes), value scale and zero (4 bytes):
    # 52 bytes against 256 in fp32 (4.9x), less the exact residual.
    compressor = KIVI(4, GROUP_SIZE, RESIDUAL_LENGTH)
    full = _full_cache(400)
    compressed = compressor.compress(full)
    assert compressed.nbytes == _expected_nbytes(compressor, 400)
    assert full.nbytes >= 3 * compressed.nbytes


def test_flush_quantizes_only_whole_groups():
    layer = QuantizedLayerKV(NUM_KV_HEADS, HEAD_DIM, torch.float32, "cpu", bits=4, group_size=8)
    layer.append(*_kv(13, seed=3), torch.arange(13))
    layer.flush(0)
    assert (layer.num_quantized, layer.residual.num_slots) == (8, 5)  # partial group stays exact

    compressor = KIVI(4, GROUP_SIZE, RESIDUAL_LENGTH)
    source = _full_cache(53, seed=2)
    cache = compressor.compress(_full_cache(30, seed=2))
    earlier = cache.layers[0].keys_values()[0].clone()
    for num_new in (1, 2, 20):
        cache.append_exact(ExactKV.of(source, cache.num_tokens, cache.num_tokens + num_new))
        compressor.update(cache)
        num_tokens = cache.num_tokens
        num_quantized = num_tokens // RESIDUAL_LENGTH * RESIDUAL_LENGTH
        for layer, source_layer in zip(cache.layers, source.layers, strict=True):
            assert layer.num_quantized == num_quantized
            assert layer.positions().tolist() == [[p] * NUM_KV_HEADS for p in range(num_tokens)]
            exact = source_layer.keys_values()[0][num_quantized:num_tokens]
            assert torch.equal(layer.keys_values()[0][num_quantized:], exact)
    # Groups quantized earlier decode the same after later flushes.
    assert torch.equal(cache.layers[0].keys_values()[0][:8], earlier[:8])


def test_kivi_rollback_stops_at_the_residual():
    cache = KIVI(4, GROUP_SIZE, RESIDUAL_LENGTH).compress(_full_cache())
    before = _snapshot(cache)  # 96 quantized tokens, 4 exact
    _append(cache, 20, seed=13)  # uncommitted: more than a block, but not flushed before commit
    cache.truncate(NUM_TOKENS)
    _assert_unchanged(cache, before)
    with pytest.raises(CacheStateError):
        cache.layers[0].drop_last(5)
    with pytest.raises(CacheStateError):
        cache.truncate(95)
    _assert_unchanged(cache, before)


def test_a_composition_is_named_by_its_parts_and_each_part_takes_its_own_parameters():
    composed = build_compressor("snapkv+kivi", ratio=4, bits=2, window=8, residual_length=0)
    assert composed.name == "snapkv+kivi" and composed.label == "snapkv-4x+kivi-2bit"
    assert composed.kind is CompressionKind.COMPOSED and composed.kept_token_ratio == 4
    assert (composed.dropper.window, composed.quantizer.residual_length) == (8, 0)
    spec = composed.spec()  # what the codec and the catalog store
    assert build_compressor(spec["name"], **spec["params"]) == composed


COMPOSABLE = "droppers: kvzip, pyramidkv, snapkv; quantizers: kivi, kvquant"


@pytest.mark.parametrize(
    ("name", "params", "words"),
    [
        ("snapkv+kvzip", {}, "token_dropping and token_dropping"),
        ("kivi+kvquant", {}, "quantization and quantization"),
        ("kivi+snapkv", {}, "a token dropper then a quantizer"),
        ("h2o+kivi", {}, "evicts tokens while decoding"),
        ("snapkv+kivi+kvquant", {}, "two parts"),
    ],
)
def test_parts_that_do_not_compose_are_refused_naming_those_that_do(name, params, words):
    with pytest.raises(InvalidRequestError, match=words) as refused:
        build_compressor(name, **params)
    assert COMPOSABLE in str(refused.value)


@pytest.mark.parametrize(
    ("params", "words"),
    [
        ({"dtype": "bfloat16"}, "dtype does not apply"),
        ({"temperature": 1}, "takes no parameter 'temperature'"),
        ({"ratio": 0.5}, "ratio must lie in"),  # c would exceed the full KV's
    ],
)
def test_a_composition_s_parameters_are_checked(params, words):
    with pytest.raises(InvalidRequestError, match=words):
        build_compressor("snapkv+kivi", **params)
    with pytest.raises(InvalidRequestError, match="unknown compressor 'zip'"):
        build_compressor("snapkv+zip")
