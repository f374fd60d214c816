"""Mechanisms behind the scored compressors: attention scores, selection, pooling, layer budgets,
H2O's online eviction, KVQuant's outliers and pre-RoPE keys."""

from __future__ import annotations

import math

import pytest
import torch

from vericache.compress import H2O, PyramidKV, SnapKV
from vericache.compress.scoring import (
    accumulate_attention,
    attention_probs,
    pool_scores,
    select_slots,
)
from vericache.kv.cache import DenseLayerKV, KVCache
from vericache.kv.compressed import CompressedKV
from vericache.kv.outlier_quantized import OutlierQuantizedLayerKV, rotate, split_outliers
from vericache.model.config import RopeConfig
from vericache.model.rope import RotaryEmbedding


def _layer(num_slots=12, heads=2, dim=8, seed=0) -> DenseLayerKV:
    generator = torch.Generator().manual_seed(seed)
    keys, values = torch.randn(2, num_slots, heads, dim, generator=generator)
    return DenseLayerKV.from_tensors(keys, values, torch.arange(num_slots))


def test_attention_probs_match_a_direct_softmax_and_are_causal():
    layer = _layer()
    generator = torch.Generator().manual_seed(1)
    queries = torch.randn(3, 4, 8, generator=generator)  # 4 query heads over 2 KV heads
    positions = torch.tensor([5, 9, 11])
    keys = layer.keys_values()[0][:12]
    probs = attention_probs(queries, positions, keys, layer.positions())  # [Hkv, g, n, S]
    for head in range(4):
        kv_head = head // 2
        for row, position in enumerate(positions.tolist()):
            scores = keys[: position + 1, kv_head] @ queries[row, head] / math.sqrt(8)
            expected = torch.softmax(scores, dim=0)
            got = probs[kv_head, head % 2, row]
            torch.testing.assert_close(got[: position + 1], expected)
            assert float(got[position + 1 :].abs().sum()) == 0.0
    summed = accumulate_attention(queries, positions, layer, num_slots=12)
    torch.testing.assert_close(summed, probs.sum(dim=(1, 2)).T)
    assert summed.shape == (12, 2)


def test_select_slots_keeps_forced_then_top_scores_in_slot_order():
    scores = torch.tensor([[5.0, 0.0], [1.0, 9.0], [7.0, 1.0], [0.0, 2.0], [3.0, 3.0]])
    forced = torch.tensor([False, False, False, True, False])
    kept = select_slots(scores, budget=3, forced=forced)
    assert kept.T.tolist() == [[0, 2, 3], [1, 3, 4]]
    assert select_slots(scores, budget=9).T.tolist() == [[0, 1, 2, 3, 4]] * 2


def test_max_pooling_spreads_a_peak_to_its_neighbours():
    scores = torch.zeros(9, 1)
    scores[4] = 1.0
    assert pool_scores(scores, 3, "max")[:, 0].tolist() == [0, 0, 0, 1, 1, 1, 0, 0, 0]
    assert pool_scores(scores, 1, "max").equal(scores)


@pytest.mark.parametrize("num_layers", [1, 2, 30])
def test_pyramid_budgets_fall_with_depth_and_keep_snapkv_total(num_layers):
    pyramid, snap = PyramidKV(ratio=4, beta=20), SnapKV(ratio=4)
    budgets = pyramid.layer_budgets(3500, num_layers)
    assert budgets == sorted(budgets, reverse=True)
    total = sum(snap.layer_budgets(3500, num_layers))
    assert abs(sum(budgets) - total) <= num_layers  # rounding only
    if num_layers > 1:
        assert budgets[-1] == round(875 / 20) and budgets[0] > 875


def test_h2o_update_keeps_recent_tokens_and_heaviest_hitters():
    compressor = H2O(ratio=4, recent_fraction=0.5)  # 10 tokens seen: the budget stays 4
    layer = _layer(num_slots=10)
    scores = torch.tensor([9.0, 0, 0, 8, 0, 0, 0, 0, 0, 0]).unsqueeze(1).repeat(1, 2)
    cache = CompressedKV([layer], 10, compressor, budgets=[4], extras={"scores": [scores]})
    compressor.update(cache)
    # Budget 4: the 2 newest slots (8, 9), then the heaviest of the rest (0 and 3).
    assert cache.layers[0].positions()[:, 0].tolist() == [0, 3, 8, 9]
    assert cache.extras["scores"][0][:, 0].tolist() == [9.0, 8.0, 0.0, 0.0]


def test_h2o_scores_committed_drafter_queries_only():
    compressor = H2O(ratio=1)
    layer = _layer(num_slots=6)
    cache = CompressedKV(
        [layer], 6, compressor, budgets=[6], extras={"scores": [torch.zeros(6, 2)]}
    )
    query = torch.randn(1, 4, 8, generator=torch.Generator().manual_seed(3))
    cache.observe(0, torch.tensor([5]), query, layer)  # committed (position < num_tokens)
    cache.observe(0, torch.tensor([6]), query, layer)  # a rejected draft: ignored
    compressor.update(cache)
    expected = accumulate_attention(query, torch.tensor([5]), layer, 6)
    torch.testing.assert_close(cache.extras["scores"][0], expected)
    assert cache.observed == [[]]


def test_split_outliers_takes_the_extremes_per_channel():
    x = torch.zeros(100, 1, 2)
    x[7, 0, 0], x[50, 0, 1], x[60, 0, 1] = 40.0, -30.0, 25.0
    clamped, index, values = split_outliers(x, 0.04, dims=(0,))  # 2 per channel
    assert sorted(values.tolist()) == [-30.0, 25.0, 40.0]
    assert float(clamped.abs().max()) == 0.0
    flat = torch.zeros(200)
    flat[index.long()] = values
    assert torch.equal(flat.view(100, 1, 2), x)


def test_kvquant_layer_keeps_outliers_exact_and_undoes_rope():
    rope = RotaryEmbedding(RopeConfig(theta=10000.0), 16, 512, "cpu", torch.float32)
    generator = torch.Generator().manual_seed(0)
    keys, values = torch.randn(2, 64, 2, 16, generator=generator)
    keys[10, 1, 3] = 80.0
    positions = torch.arange(64).unsqueeze(1).expand(-1, 2)
    rotated = rotate(rope, keys, positions, inverse=False)
    torch.testing.assert_close(rotate(rope, rotated, positions, inverse=True), keys)
    layer = OutlierQuantizedLayerKV(2, 16, torch.float32, "cpu", 4, 16, 0.02, rope)
    layer.append(rotated, values, torch.arange(64))
    layer.flush(0)
    assert layer.num_quantized == 64
    got_keys, got_values = layer.keys_values()
    unrotated = rotate(rope, got_keys, positions, inverse=True)
    assert float(unrotated[10, 1, 3]) == pytest.approx(80.0, abs=1e-4)  # the outlier, exact
    # Without the outlier stretching its channel, the rest quantizes finely.
    assert float((unrotated - keys).abs().max()) < 0.5
    cache = KVCache([layer], 64)
    assert cache.nbytes > 0


def test_forced_slots_that_do_not_all_fit_are_chosen_by_score():
    scores = torch.tensor([[0.5], [3.0], [2.0], [9.0]])
    forced = torch.tensor([True, True, True, False])
    assert select_slots(scores, budget=2, forced=forced)[:, 0].tolist() == [1, 2]
