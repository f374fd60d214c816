"""bench coupling: the keep rates of both couplings from a pair of distributions, the per-round
figures from keep rates, and p and q lined up position by position on a real engine."""

from __future__ import annotations

import pytest
import torch

from vericache.bench.coupling import _distributions, _rates, per_round
from vericache.compress import build_compressor
from vericache.engine.prompt import PromptIds
from vericache.engine.request import SamplingParams


def test_identical_distributions_always_keep_and_disjoint_ones_never():
    p = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.5, 0.5, 0.0, 0.0]])
    q = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.0, 0.0, 0.5, 0.5]])
    rates = _rates(p, q, draws=200, generator=torch.Generator().manual_seed(0))
    assert rates["rejection"] == pytest.approx([1.0, 0.0])
    assert rates["seeded"] == [1.0, 0.0]


def test_seeded_keeps_less_than_rejection_and_at_least_the_communication_free_bound():
    p = torch.tensor([[0.6, 0.3, 0.1]])
    q = torch.tensor([[0.3, 0.6, 0.1]])
    rates = _rates(p, q, draws=20000, generator=torch.Generator().manual_seed(0))
    (tv,) = rates["tv"]
    assert tv == pytest.approx(0.3)
    (seeded,) = rates["seeded"]
    assert (1 - tv) / (1 + tv) - 0.02 <= seeded < 1 - tv


def test_a_round_keeps_the_sum_of_the_running_products_of_its_rates():
    rate, x = 0.9, 30
    assert per_round([rate] * 100, x) == pytest.approx(rate * (1 - rate**x) / (1 - rate))
    # Rounds start at positions 0..50: each even start keeps 1, each odd one 0.
    assert per_round([1.0, 0.0] * 40, x) == pytest.approx(26 / 51)


@pytest.mark.parametrize(("ratio", "same"), [(1.0, True), (4.0, False)])
def test_draft_and_target_distributions_line_up_position_by_position(tiny_engine, ratio, same):
    engine = tiny_engine()
    prompt = PromptIds(tuple(range(3, 83)), num_prefix_tokens=60)
    output = (7, 9, 11, 13, 15, 17)
    params = SamplingParams(max_new_tokens=len(output), temperature=0.7, seed=1)
    compressor = build_compressor("streamingllm", ratio=ratio)
    p, q = _distributions(engine, prompt, compressor, output, params)
    assert p.shape == q.shape == (len(output), engine.model_config.vocab_size)
    tv = 0.5 * (p - q).abs().sum(-1)
    # Keeping every token, the drafter's q is the verifier's p at every position (an off-by-one
    # position would differ); dropping three quarters of the context, it is not.
    assert bool(tv.max() < 1e-3) is same
