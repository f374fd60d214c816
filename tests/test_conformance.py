"""Every compressor through the same checks, on a real (tiny) model: sizes as promised, kept
positions, dtype and device preserved, state round trip, source untouched, `vericache` == `full`.

The compressors are the shared table (tests/compressor_table.py), which must cover the registry.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.compressor_table import TABLE, row_id
from vericache.compress import (
    COMPRESSORS,
    CompressionKind,
    CompressionMode,
    ModelContext,
    SnapKV,
    StreamingLLM,
    cache_from_state,
)
from vericache.engine.request import DecodeMode, Request, SamplingParams
from vericache.kv.compressed import CompressedKV

PREFIX, SUFFIX, MAX_NEW = 300, 10, 32


def _prompt(vocab: int = 512, seed: int = 3) -> tuple[int, ...]:
    generator = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(3, vocab, (PREFIX + SUFFIX,), generator=generator).tolist())


@pytest.fixture(scope="module")
def engine(tiny_engine):
    return tiny_engine()


@pytest.fixture(scope="module")
def prefix(engine):
    """(prefix token ids, their full KV) on the tiny Llama."""
    ids = _prompt()[:PREFIX]
    return ids, engine.prefix_kv(ids)


def _compress(engine, prefix, compressor) -> CompressedKV:
    ids, full = prefix
    return compressor.compress(full, ModelContext(engine.runner, ids))


@pytest.fixture(scope="module")
def full_output(engine):
    params = SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)
    (out,) = engine.generate([Request(_prompt(), PREFIX, params, DecodeMode.FULL)])
    return out.token_ids


@pytest.mark.parametrize("compressor", TABLE, ids=row_id)
def test_sizes_as_promised(engine, prefix, compressor):
    full = prefix[1]
    compressed = _compress(engine, prefix, compressor)
    c = engine.model_config
    per_token = c.num_kv_heads * c.head_dim * 2 * 4  # keys and values of a token, fp32
    assert isinstance(compressed, CompressedKV) and compressed.num_tokens == PREFIX
    if compressor.kind is CompressionKind.TOKEN_DROPPING:
        expected = _expected_slots(compressor, c.num_layers)
        assert [layer.num_slots for layer in compressed.layers] == expected
        assert compressed.nbytes == sum(expected) * per_token
        assert compressed.nbytes <= full.nbytes / compressor.ratio + c.num_layers * per_token
    elif compressor.kind is CompressionKind.COMPOSED:  # the dropper's slots, quantized
        expected = _expected_slots(compressor.dropper, c.num_layers)
        assert [layer.num_slots for layer in compressed.layers] == expected
        quantizer = compressor.quantizer
        block = quantizer.group_size  # the kept slots are quantized in whole groups
        assert compressed.nbytes == _expected_quantized_bytes(
            compressed, quantizer, c, expected, block
        )
        dropped_nbytes = sum(expected) * per_token
        assert compressed.nbytes < dropped_nbytes < full.nbytes
    else:
        slots = [PREFIX] * c.num_layers
        assert compressed.nbytes == _expected_quantized_bytes(compressed, compressor, c, slots)
        assert compressed.nbytes < full.nbytes
    assert compressed.resident_bytes >= compressed.nbytes


def _expected_quantized_bytes(
    compressed, quantizer, c, slots: list[int], block: int | None = None
) -> int:
    """Per layer of slots[i] tokens, quantized in blocks of `block` (the quantizer's residual
    window): packed codes, fp16 key statistics per channel and group, fp16 value statistics per
    token, the exact residual, and (KVQuant) 8 bytes per sparse outlier: int32 index, fp32 value."""
    block = block or quantizer.residual_length or quantizer.group_size
    per_token = c.num_kv_heads * c.head_dim
    total = 0
    for layer, num_slots in zip(compressed.layers, slots):
        quantized = num_slots // block * block
        codes = 2 * quantized * per_token * quantizer.bits // 8
        key_stats = 2 * (quantized // quantizer.group_size) * per_token * 2
        value_stats = 2 * quantized * c.num_kv_heads * 2
        residual = 2 * (num_slots - quantized) * per_token * 4
        state = layer.to_state().tensors
        num = state.get("key_outlier_index", torch.empty(0)).numel()
        num += state.get("value_outlier_index", torch.empty(0)).numel()
        share = quantizer.__dict__.get("outlier_fraction", 0.0) * quantized * per_token * 2
        assert num <= 1.1 * share + 4 * per_token  # about the fraction asked for
        total += codes + key_stats + value_stats + residual + 8 * num
    return total


def _expected_slots(compressor, num_layers: int) -> list[int]:
    if isinstance(compressor, StreamingLLM):
        return [compressor.slot_budget(PREFIX)] * num_layers
    if isinstance(compressor, SnapKV):  # PyramidKV too
        budgets = compressor.layer_budgets(PREFIX, num_layers)
        assert sum(budgets) <= math.ceil(PREFIX / compressor.ratio) * num_layers + num_layers
        return budgets
    return [math.ceil(PREFIX / compressor.ratio)] * num_layers


@pytest.mark.parametrize("compressor", TABLE, ids=row_id)
def test_positions_kept_and_dtype_device_preserved(engine, prefix, compressor):
    full = prefix[1]
    compressed = _compress(engine, prefix, compressor)
    dropped = None
    if compressor.kind is CompressionKind.COMPOSED:
        dropped = _compress(engine, prefix, compressor.dropper)
    for index, source in enumerate(full.layers):
        positions = compressed.kept_positions(index).long()  # [slots, H]
        assert bool((positions[1:] > positions[:-1]).all()), "ascending, no repeats, per head"
        assert int(positions.min()) >= 0 and int(positions.max()) < PREFIX
        keys, values = compressed.decompress(index)
        source_keys, source_values = source.keys_values()
        assert keys.dtype == values.dtype == source_keys.dtype
        assert keys.device == source_keys.device and keys.shape[0] == positions.shape[0]
        heads = torch.arange(positions.shape[1])
        if compressor.kind is CompressionKind.TOKEN_DROPPING:
            assert torch.equal(keys, source_keys[positions, heads])  # exact KV of kept tokens
            assert torch.equal(values, source_values[positions, heads])
        elif dropped is not None:  # the dropper's tokens, near their exact KV
            assert torch.equal(positions, dropped.kept_positions(index).long())
            exact = source_keys[positions, heads]
            assert (keys - exact).abs().max() < 0.5 * exact.abs().max()
        else:
            assert positions.tolist() == [[p] * positions.shape[1] for p in range(PREFIX)]
            assert (keys - source_keys[:PREFIX]).abs().max() < 0.5 * source_keys.abs().max()


@pytest.mark.parametrize("compressor", TABLE, ids=row_id)
def test_state_round_trip_and_source_unchanged(engine, prefix, compressor):
    full = prefix[1]
    before = full.to_state()
    compressed = _compress(engine, prefix, compressor)
    assert full.to_state().equals(before)
    state = compressed.to_state()
    assert state.compressor == compressor.spec()
    rebuilt = cache_from_state(state, rope=engine.runner.rope)
    assert rebuilt.to_state().equals(state)
    for index in range(len(full.layers)):
        assert all(
            torch.equal(a, b)
            for a, b in zip(rebuilt.decompress(index), compressed.decompress(index))
        )


@pytest.mark.parametrize("compressor", TABLE, ids=row_id)
def test_vericache_equals_full(engine, full_output, compressor):
    params = SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)
    requests = [
        Request(_prompt(), PREFIX, params, mode, compressor, draft_len=8)
        for mode in (DecodeMode.VERICACHE, DecodeMode.LOSSY)
    ]
    vericache, lossy = engine.generate(requests)
    assert vericache.token_ids == full_output
    assert len(lossy.token_ids) == MAX_NEW  # the lossy baseline runs to the end too
    assert vericache.stats.rounds < MAX_NEW  # drafts were accepted: fewer rounds than tokens


@pytest.mark.parametrize("compressor", TABLE, ids=row_id)
def test_empty_prefix(engine, compressor):
    # Nothing to compress: the whole prompt is the user turn.
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    prompt = _prompt()[:SUFFIX]
    full, vericache = engine.generate(
        [
            Request(prompt, 0, params, DecodeMode.FULL),
            Request(prompt, 0, params, compressor=compressor),
        ]
    )
    assert vericache.token_ids == full.token_ids


@pytest.mark.parametrize(
    "compressor", [c for c in TABLE if c.records_queries], ids=lambda c: c.label
)
def test_online_eviction_holds_the_budget(engine, compressor):
    params = SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)
    request = Request(_prompt(), PREFIX, params, DecodeMode.LOSSY, compressor)
    seq = engine.starter.start(request)
    while not seq.is_finished:
        engine.step([seq])
        if not seq.is_finished:
            cache = seq.compressed_cache
            # 1/ratio of the tokens seen: the budget grows as decoding goes on.
            assert cache.budgets == [math.ceil(cache.num_tokens / compressor.ratio)] * 2
            assert all(layer.num_slots <= cache.budgets[0] for layer in cache.layers)
    assert compressor.mode is CompressionMode.ONLINE


def test_the_table_covers_every_registered_compressor_easy_and_hard():
    single = [row for row in TABLE if row.kind is not CompressionKind.COMPOSED]
    assert sorted(row.name for row in single) == sorted(2 * list(COMPRESSORS))
    assert any(row.kind is CompressionKind.COMPOSED for row in TABLE)
    for easy, hard in zip(TABLE[::2], TABLE[1::2]):
        composed = easy.kind is hard.kind is CompressionKind.COMPOSED  # two compositions
        assert (easy.name == hard.name or composed) and easy != hard
