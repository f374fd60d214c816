"""KV cache mechanics: dense layers, KVCache bookkeeping, and the property that makes compressed
drafting correct: a compressed cache keeps its tokens' original RoPE positions, and new tokens are
rotated at their true positions, not at their slot index."""

from __future__ import annotations

import contextlib
import math
import pickle

import pytest
import torch
import transformers

from tests.compressor_table import pick, row_id
from vericache.compress import KIVI, StreamingLLM
from vericache.errors import CacheStateError
from vericache.kv.cache import DenseLayerKV, KVCache
from vericache.kv.exact import ExactKV
from vericache.kv.pool import BufferPool
from vericache.model.loader import load_model
from vericache.model.runner import ModelRunner, SequenceInput

NUM_KV_HEADS, HEAD_DIM = 2, 8
ATOL = 1e-4


def _kv(num_tokens: int, seed: int = 0, dtype=torch.float32):
    """Random keys and values, [T, H, D] each."""
    generator = torch.Generator().manual_seed(seed)
    shape = (num_tokens, NUM_KV_HEADS, HEAD_DIM)
    keys = torch.randn(shape, generator=generator)
    return keys.to(dtype), torch.randn(shape, generator=generator).to(dtype)


def _full_cache(num_tokens: int, num_layers: int = 2, seed: int = 0) -> KVCache:
    layers = [
        DenseLayerKV.from_tensors(*_kv(num_tokens, seed + index), torch.arange(num_tokens))
        for index in range(num_layers)
    ]
    return KVCache(layers, num_tokens=num_tokens)


def _append(cache: KVCache, num_new: int, seed: int) -> None:
    """What a forward does: new tokens' KV into every layer, then `advance` (uncommitted)."""
    positions = torch.arange(cache.num_tokens, cache.num_tokens + num_new)
    for index, layer in enumerate(cache.layers):
        layer.append(*_kv(num_new, seed + index), positions)
    cache.advance(num_new)


def _snapshot(cache: KVCache):
    layers = [(layer.positions(), *layer.keys_values()) for layer in cache.layers]
    return cache.num_tokens, [[t.clone() for t in layer] for layer in layers]


def _assert_unchanged(cache: KVCache, snapshot) -> None:
    num_tokens, layers = snapshot
    assert cache.num_tokens == num_tokens
    for layer, (positions, keys, values) in zip(cache.layers, layers, strict=True):
        now_keys, now_values = layer.keys_values()
        assert torch.equal(layer.positions(), positions)
        assert torch.equal(now_keys, keys) and torch.equal(now_values, values)


def _per_head(positions: list[int]) -> list[list[int]]:
    return [[p] * NUM_KV_HEADS for p in positions]


# DenseLayerKV


def test_dense_append_grows_past_capacity_keeping_contents():
    layer = DenseLayerKV(NUM_KV_HEADS, HEAD_DIM, torch.float32, "cpu", capacity=4)
    keys, values = _kv(700)
    # Crosses the initial 256 slots and the doubled 512.
    for start, end in [(0, 3), (3, 250), (250, 260), (260, 700)]:
        layer.append(keys[start:end], values[start:end], torch.arange(start, end))
        assert layer.num_slots == end
        got_keys, got_values = layer.keys_values()
        assert torch.equal(got_keys, keys[:end]) and torch.equal(got_values, values[:end])
    assert layer.positions().tolist() == _per_head(list(range(700)))


@pytest.mark.parametrize("pad_to", [1, 4, 7, 1024])
def test_dense_padded_view_is_finite_beyond_num_slots(pad_to):
    layer = DenseLayerKV(NUM_KV_HEADS, HEAD_DIM, torch.float32, "cpu")
    keys, values = _kv(10)
    layer.append(keys * 1e30, values * 1e30, torch.arange(10))
    layer.drop_last(4)
    padded_keys, padded_values = layer.keys_values(pad_to=pad_to)
    assert padded_keys.shape == (math.ceil(6 / pad_to) * pad_to, NUM_KV_HEADS, HEAD_DIM)
    assert torch.equal(padded_keys[:6], keys[:6] * 1e30)
    assert torch.equal(padded_values[:6], values[:6] * 1e30)
    assert torch.isfinite(padded_keys).all() and torch.isfinite(padded_values).all()


def test_dense_layer_hands_out_head_major_views_that_survive_growth():
    # Decode attention streams each head's keys from one block: per head, the [T, D] rows of a
    # view lie back to back, before and after the buffers grow.
    keys, values = _kv(300)
    layer = DenseLayerKV(NUM_KV_HEADS, HEAD_DIM, torch.float32, "cpu", capacity=256)
    layer.append(keys[:200], values[:200], torch.arange(200))
    layer.append(keys[200:], values[200:], torch.arange(200, 300))  # grows past 256
    got_keys, got_values = layer.keys_values()
    assert torch.equal(got_keys, keys) and torch.equal(got_values, values)
    for view in (got_keys, got_values):
        assert all(view[:, head].is_contiguous() for head in range(NUM_KV_HEADS))
    assert layer.nbytes == keys.nbytes + values.nbytes


def test_dense_drop_last_removes_newest_slots():
    keys, values = _kv(10)
    layer = DenseLayerKV.from_tensors(keys, values, torch.arange(10))
    layer.drop_last(4)
    new_keys, new_values = _kv(2, seed=5)
    layer.append(new_keys, new_values, torch.tensor([6, 7]))
    got_keys, got_values = layer.keys_values()
    assert torch.equal(got_keys, torch.cat([keys[:6], new_keys]))
    assert torch.equal(got_values, torch.cat([values[:6], new_values]))
    assert layer.positions().tolist() == _per_head(list(range(8)))
    with pytest.raises(CacheStateError):
        layer.drop_last(9)
    assert layer.num_slots == 8


def test_dense_retain_keeps_per_head_slots_and_positions():
    keys, values = _kv(8)
    layer = DenseLayerKV.from_tensors(keys, values, torch.arange(8))
    slot_index = torch.tensor([[0, 1], [2, 4], [5, 7]])  # [k, H]: each head keeps its own slots
    layer.retain(slot_index)
    assert layer.num_slots == 3
    assert layer.positions().tolist() == slot_index.tolist()
    got_keys, got_values = layer.keys_values()
    for head in range(NUM_KV_HEADS):
        assert torch.equal(got_keys[:, head], keys[slot_index[:, head], head])
        assert torch.equal(got_values[:, head], values[slot_index[:, head], head])
    new_keys, new_values = _kv(1, seed=9)
    layer.append(new_keys, new_values, torch.tensor([8]))
    assert layer.positions().tolist() == slot_index.tolist() + [[8, 8]]
    assert torch.equal(layer.keys_values()[0][3], new_keys[0])


# KVCache


def test_truncate_rolls_back_uncommitted_tokens():
    cache = _full_cache(10)
    before = _snapshot(cache)
    _append(cache, 5, seed=10)
    assert cache.num_tokens == 15 and cache.is_full
    cache.truncate(15)  # nothing to roll back
    assert cache.num_tokens == 15
    cache.truncate(12)
    assert cache.num_tokens == 12 and all(layer.num_slots == 12 for layer in cache.layers)
    assert torch.equal(cache.layers[1].keys_values()[0][10:], _kv(2, seed=11)[0])
    cache.truncate(10)
    _assert_unchanged(cache, before)
    with pytest.raises(CacheStateError):
        cache.truncate(11)  # more tokens than the cache has seen


@pytest.mark.parametrize(
    "compressor",
    [StreamingLLM(ratio=4, num_sinks=2), KIVI(bits=4, group_size=8, residual_length=8)],
    ids=lambda c: c.label,
)
def test_truncate_below_a_compressed_token_raises(compressor):
    # StreamingLLM keeps positions 0, 1, 32..39; KIVI quantized 0..31 and holds 32..39 exactly.
    cache = compressor.compress(_full_cache(40))
    before = _snapshot(cache)
    _append(cache, 3, seed=7)
    cache.truncate(40)
    _assert_unchanged(cache, before)
    with pytest.raises(CacheStateError):
        cache.truncate(31)  # token 31 was evicted or quantized
    _assert_unchanged(cache, before)


def _prefix(full: KVCache, num_tokens: int) -> KVCache:
    layers = []
    for layer in full.layers:
        keys, values = layer.keys_values()
        prefix = keys[:num_tokens], values[:num_tokens], torch.arange(num_tokens)
        layers.append(DenseLayerKV.from_tensors(*prefix))
    return KVCache(layers, num_tokens=num_tokens)


def test_append_exact_takes_exact_kv_of_a_token_range():
    full = _full_cache(20, seed=3)
    draft = StreamingLLM(ratio=4, num_sinks=1).compress(_prefix(full, 12))  # keeps 0, 10, 11
    draft.append_exact(ExactKV.of(full, 12, 20))
    assert draft.num_tokens == 20
    kept = [0, 10, 11, *range(12, 20)]
    for layer, source in zip(draft.layers, full.layers, strict=True):
        assert layer.positions().tolist() == _per_head(kept)
        keys, values = layer.keys_values()
        source_keys, source_values = source.keys_values()
        assert torch.equal(keys, source_keys[kept]) and torch.equal(values, source_values[kept])

    catching_up = _prefix(full, 12)
    catching_up.append_exact(ExactKV.of(full, 12, 20, copy=False))
    assert catching_up.is_full
    _assert_unchanged(catching_up, _snapshot(full))


def test_exact_kv_needs_an_uncompressed_source_holding_the_range():
    full = _full_cache(20, seed=3)
    compressed = StreamingLLM(ratio=4).compress(full)
    for source, start, end in [(full, 12, 21), (full, 12, 10), (full, -1, 4), (compressed, 12, 20)]:
        with pytest.raises(CacheStateError):
            ExactKV.of(source, start, end)


def test_append_exact_refuses_tokens_that_do_not_follow_the_cache():
    full = _full_cache(20, seed=3)
    target = _prefix(full, 12)
    before = _snapshot(target)
    for start, end in [(11, 20), (13, 20)]:
        with pytest.raises(CacheStateError):
            target.append_exact(ExactKV.of(full, start, end))
        _assert_unchanged(target, before)


def test_is_full():
    assert KVCache.empty(2, NUM_KV_HEADS, HEAD_DIM, torch.float32, "cpu").is_full
    cache = _full_cache(10)
    assert cache.is_full
    for layer in cache.layers:
        layer.append(*_kv(1, seed=4), torch.tensor([10]))
    assert not cache.is_full  # appended but not advanced
    cache.advance(1)
    assert cache.is_full
    assert not StreamingLLM(ratio=2).compress(cache).is_full
    assert not KIVI(bits=4, group_size=2, residual_length=2).compress(cache).is_full
    assert StreamingLLM(ratio=4).compress(_full_cache(3)).is_full  # short prefix: nothing dropped


def test_nbytes_counts_resident_keys_and_values_only():
    assert _full_cache(10, num_layers=3).nbytes == 3 * 2 * 10 * NUM_KV_HEADS * HEAD_DIM * 4
    layer = DenseLayerKV(NUM_KV_HEADS, HEAD_DIM, torch.float16, "cpu", capacity=1000)
    layer.append(*_kv(10, dtype=torch.float16), torch.arange(10))
    assert layer.nbytes == 2 * 10 * NUM_KV_HEADS * HEAD_DIM * 2  # capacity is not counted
    layer.drop_last(4)
    assert layer.nbytes == 2 * 6 * NUM_KV_HEADS * HEAD_DIM * 2


# Clones: a drafter or verifier session starts from a clone of a shared prefix cache


@contextlib.contextmanager
def _poisoned_allocations():
    """Uninitialised allocations hand back NaN (floats) or -1 (integers), as reused memory may:
    a clone that relied on fresh buffers being zero then fails."""
    real = {"empty": torch.empty, "empty_like": torch.empty_like}
    real_new_empty = torch.Tensor.new_empty

    def poison(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.fill_(math.nan if tensor.is_floating_point() else -1)

    with pytest.MonkeyPatch.context() as patch:
        for name, allocate in real.items():
            patch.setattr(
                torch, name, lambda *a, _allocate=allocate, **k: poison(_allocate(*a, **k))
            )
        patch.setattr(torch.Tensor, "new_empty", lambda *a, **k: poison(real_new_empty(*a, **k)))
        yield


CLONE_COMPRESSORS = [None, *pick("streamingllm", "kivi")]


def _compressor_id(compressor) -> str:
    return "full" if compressor is None else row_id(compressor)


@pytest.mark.parametrize("compressor", CLONE_COMPRESSORS, ids=_compressor_id)
def test_clone_copies_resident_slots_and_is_independent(compressor):
    source = _full_cache(40) if compressor is None else compressor.compress(_full_cache(40))
    before = _snapshot(source)
    with _poisoned_allocations():
        twin = source.clone(capacity=300)  # room beyond the resident slots, left unfilled
    _assert_unchanged(twin, before)
    for layer in twin.layers:
        padded_keys, padded_values = layer.keys_values(pad_to=1024)
        assert torch.isfinite(padded_keys).all() and torch.isfinite(padded_values).all()
    _append(twin, 5, seed=20)
    _assert_unchanged(source, before)
    twin_before = _snapshot(twin)
    _append(source, 3, seed=30)
    _assert_unchanged(twin, twin_before)


@pytest.fixture(scope="module")
def tiny_runner(tiny_checkpoint) -> ModelRunner:
    loaded = load_model(str(tiny_checkpoint("llama")))
    return ModelRunner(loaded.config, loaded.weights)


@pytest.mark.parametrize("invariant", [False, True], ids=["fast", "invariant"])
@pytest.mark.parametrize("compressor", CLONE_COMPRESSORS, ids=_compressor_id)
def test_decoding_over_a_clone_matches_decoding_over_its_source(tiny_runner, compressor, invariant):
    """Batch-invariant attention reads keys and values in whole KEY_ALIGN blocks: the unfilled
    slots of a clone must not reach its logits."""
    ids = torch.randint(3, 512, (PREFIX + 8,), generator=torch.Generator().manual_seed(1))
    prefix = tiny_runner.new_cache()
    tiny_runner.forward([SequenceInput(ids[:PREFIX], prefix, 0)])
    source = prefix if compressor is None else compressor.compress(prefix)
    with _poisoned_allocations():
        twin = source.clone(capacity=1500)

    def decode(cache: KVCache) -> torch.Tensor:
        # Two one-token steps, then a verification-like forward of six tokens.
        steps = [(PREFIX, PREFIX + 1), (PREFIX + 1, PREFIX + 2), (PREFIX + 2, PREFIX + 8)]
        logits = [
            tiny_runner.forward([SequenceInput(ids[a:b], cache, b - a)], invariant=invariant)[0]
            for a, b in steps
        ]
        return torch.cat(logits)

    ours, reference = decode(twin), decode(source)
    assert torch.isfinite(ours).all()
    assert torch.equal(ours, reference)


# Original positions after compression, end to end


PREFIX, NUM_DECODE = 60, 3


def test_compressed_cache_keeps_original_rope_positions(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    loaded = load_model(str(path))
    runner = ModelRunner(loaded.config, loaded.weights)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    ids = torch.randint(3, 512, (PREFIX + NUM_DECODE,), generator=torch.Generator().manual_seed(0))
    full = runner.new_cache()
    runner.forward([SequenceInput(ids[:PREFIX], full, 1)])
    compressor = StreamingLLM(ratio=4)
    # Budget ceil(60 / 4) = 15 slots: the 4 sinks and the 11 newest tokens.
    kept = [*range(4), *range(PREFIX - 11, PREFIX)]

    def decode(position_error: int = 0):
        cache = compressor.compress(full)
        cache.num_tokens += position_error  # a runner that rotates new tokens at the wrong position
        logits = [
            runner.forward([SequenceInput(ids[t : t + 1], cache, 1)])[0]
            for t in range(PREFIX, PREFIX + NUM_DECODE)
        ]
        return cache, torch.cat(logits)

    cache, ours = decode()
    decoded = list(range(PREFIX, PREFIX + NUM_DECODE))
    for layer in cache.layers:
        assert layer.positions().tolist() == _per_head(kept + decoded)

    # transformers on the whole sequence at positions 0..T-1; each decoded token attends to the
    # kept prefix tokens and the decoded tokens up to itself. 4D bool mask, True = attend.
    total = PREFIX + NUM_DECODE
    mask = torch.ones(total, total, dtype=torch.bool).tril()
    mask[PREFIX:, :PREFIX] = False
    mask[PREFIX:, kept] = True
    with torch.no_grad():
        reference = hf(ids.unsqueeze(0), attention_mask=mask.view(1, 1, total, total)).logits[0]
        full_attention = hf(ids.unsqueeze(0)).logits[0, PREFIX:]
    torch.testing.assert_close(ours, reference[PREFIX:], atol=ATOL, rtol=0)

    # The comparison can fail: dropping tokens changes the logits, and so does a position error
    # of one or rotating new tokens at their slot index.
    assert (ours - full_attention).abs().max() > 100 * ATOL
    for position_error in (-1, 1, len(kept) - PREFIX):
        _, wrong = decode(position_error)
        assert (wrong - reference[PREFIX:]).abs().max() > 100 * ATOL


def test_a_pool_hands_released_buffers_to_the_next_cache_of_their_shape():
    pool = BufferPool(max_bytes=1 << 30)
    first = KVCache.empty(2, 2, 8, torch.float32, "cpu", capacity=300, pool=pool)
    buffers = _buffer_addresses(first)
    first.release(pool)
    assert first.layers == [] and pool.nbytes > 0
    again = KVCache.empty(2, 2, 8, torch.float32, "cpu", capacity=300, pool=pool)
    assert _buffer_addresses(again) == buffers
    assert pool.nbytes == 0 and pool.num_reused == 6  # keys, values, positions per layer
    # Another shape or dtype gets new buffers; a full pool drops what it is given.
    other = KVCache.empty(2, 2, 8, torch.bfloat16, "cpu", capacity=300, pool=pool)
    assert not _buffer_addresses(other) & buffers
    small = BufferPool(max_bytes=1)
    other.release(small)
    assert small.nbytes == 0


def _buffer_addresses(cache: KVCache) -> set[int]:
    return {
        buffer.data_ptr()
        for layer in cache.layers
        for buffer in (layer._keys, layer._values, layer._positions)
    }


def test_a_clone_into_pooled_buffers_holds_the_same_kv():
    full = _full_cache(20, seed=3)
    pool = BufferPool(max_bytes=1 << 30)
    stale = full.clone(capacity=64)
    stale.release(pool)
    copy = full.clone(capacity=64, pool=pool)
    assert pool.num_reused > 0
    _assert_unchanged(copy, _snapshot(full))


def test_exact_kv_crosses_processes_packed_and_whole():
    full = _full_cache(20, seed=3)
    exact = ExactKV.of(full, 12, 20)
    back = pickle.loads(pickle.dumps(exact))
    assert back.start == 12 and back.num_tokens == 8 and len(back.keys) == len(full.layers)
    for mine, theirs in zip((*exact.keys, *exact.values), (*back.keys, *back.values)):
        assert torch.equal(mine, theirs)
    assert pickle.loads(pickle.dumps(ExactKV(3, (), ()))) == ExactKV(3, (), ())
