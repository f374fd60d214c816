"""A kept set the verifier steers (compress/steering.py): the output stays full decoding's, greedy
and sampled, in the engine and the long-context engine; each refresh keeps the dropper's budget
and window, moves kept positions to where the verifications attend, and leaves the prefix's shared
compressed KV as it was; only droppers that keep their tokens once are steered."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.test_conformance import PREFIX, _prompt
from tests.test_engine_sampling import long_context_generate
from vericache.compress import H2O, KIVI, KVzip, PyramidKV, SnapKV, build_compressor
from vericache.compress.composed import Composed
from vericache.compress.kept_set import (
    LayerRegrouped,
    apply_refresh,
    kept_positions,
    refreshed_positions,
    stored_kept_positions,
)
from vericache.compress.steering import KeptSetSteering, attention_mass
from vericache.engine.request import (
    DEFAULT_STEER_EVERY,
    STEERED_PREFIX_TOKENS,
    DecodeMode,
    Request,
    SamplingParams,
)
from vericache.errors import InvalidRequestError
from vericache.kv.prefixed import shared_clone
from vericache.kv.quantized import quantized_groups

MAX_NEW = 32
GREEDY = SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)
SAMPLED = dataclasses.replace(GREEDY, temperature=0.8, top_p=0.9, seed=3)
DROPPERS = [SnapKV(ratio=4, window=8), PyramidKV(ratio=4), KVzip(ratio=4, chunk_size=64)]
# SnapKV's 75 kept slots of the 300-token prefix: two whole KIVI groups of 32, and 11 past them.
COMPOSED = Composed(SnapKV(ratio=4, window=8), KIVI(bits=4))


def _request(compressor=None, params=GREEDY, steer_every=0, seed=3) -> Request:
    mode = DecodeMode.FULL if compressor is None else DecodeMode.VERICACHE
    return Request(
        _prompt(seed=seed), PREFIX, params, mode, compressor, draft_len=6, steer_every=steer_every
    )


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("compressor", [*DROPPERS, COMPOSED], ids=lambda c: c.name)
def test_a_steered_drafter_still_gives_full_decodings_output(tiny_engine, compressor, params):
    engine = tiny_engine()
    full, plain, steered = engine.generate(
        [_request(None, params), _request(compressor, params), _request(compressor, params, 2)]
    )
    assert plain.token_ids == full.token_ids == steered.token_ids
    assert steered.stats.rounds < MAX_NEW
    assert sum(steered.stats.changed_per_refresh) > 0  # its kept set did move


def test_a_refresh_keeps_the_budget_and_window_and_moves_positions(tiny_engine, monkeypatch):
    engine = tiny_engine()
    compressor = SnapKV(ratio=4, window=8)
    before = engine.compressed_prefix_kv(_prompt()[:PREFIX], compressor).to_state()
    refreshed = []
    real_step = engine.step

    def step(batch):
        real_step(batch)
        for seq in batch:
            if seq.steering is not None and seq.steering.num_refreshes > len(refreshed):
                refreshed.append(
                    [layer.shared.positions().clone() for layer in seq.compressed_cache.layers]
                )

    monkeypatch.setattr(engine, "step", step)
    (steered,) = engine.generate([_request(compressor, steer_every=1)])
    assert refreshed, "no refresh ran"
    budget = compressor.layer_budgets(PREFIX, len(refreshed[0]))
    for positions, kept in zip(refreshed[0], budget):
        assert positions.shape[0] == kept  # the same number of slots per head
        assert bool((positions[1:] > positions[:-1]).all())  # ascending per head
        window = torch.arange(PREFIX - 8, PREFIX, dtype=positions.dtype)
        assert torch.isin(window, positions[:, 0]).all()  # the window stays
    original = [layer.tensors["positions"] for layer in before.layers]
    moved = sum(int((~torch.isin(p[:, 0], o[:, 0])).sum()) for p, o in zip(refreshed[-1], original))
    assert moved > 0  # the verifications asked for other positions
    # The request's stats tell the set's size and what each refresh replaced (a remote drafter's
    # link bytes, sim/steering_link.py).
    stats = steered.stats
    assert stats.kept_entries == sum(int(p.numel()) for p in refreshed[0])
    assert len(stats.changed_per_refresh) == len(refreshed)
    assert 0 < max(stats.changed_per_refresh) <= stats.kept_entries
    # Steering edits the request's own copy: the prefix's shared compressed KV is unchanged.
    after = engine.compressed_prefix_kv(_prompt()[:PREFIX], compressor).to_state()
    assert after.equals(before)


@pytest.mark.parametrize("compressor", [SnapKV(ratio=4, window=8), COMPOSED], ids=lambda c: c.name)
def test_the_long_context_engine_steers_over_the_full_kv_it_loads(tiny_engine, compressor):
    engine = tiny_engine()
    (steered,) = long_context_generate(engine, [_request(compressor, steer_every=2)])
    (full,) = engine.generate([_request()])
    assert steered.token_ids == full.token_ids


def test_attention_mass_ranks_the_key_a_query_points_at():
    keys = torch.zeros(5, 1, 4)
    keys[3, 0, 0] = 10.0  # [P=5, Hkv=1, D=4]
    queries = torch.zeros(2, 3, 4)
    queries[:, :, 0] = 1.0  # [n=2, Hq=3, D]: three heads of one group
    mass = attention_mass(queries, keys)
    assert mass.shape == (1, 5) and int(mass.argmax()) == 3
    assert float(mass.sum()) == pytest.approx(2 * 3)  # each row and head's softmax sums to one


@pytest.mark.parametrize(
    ("compressor", "mode", "words"),
    [
        (KIVI(bits=4), DecodeMode.VERICACHE, "not kivi"),
        (H2O(ratio=4), DecodeMode.VERICACHE, "not h2o"),
        (build_compressor("snapkv+kvquant"), DecodeMode.VERICACHE, r"not snapkv\+kvquant"),
        (SnapKV(ratio=4), DecodeMode.LOSSY, "mode 'vericache' only"),
    ],
)
def test_only_a_dropper_that_keeps_its_tokens_once_is_steered(compressor, mode, words):
    with pytest.raises(InvalidRequestError, match=words):
        Request(_prompt(), PREFIX, GREEDY, mode, compressor, steer_every=2)
    with pytest.raises(InvalidRequestError, match=">= 0"):
        Request(_prompt(), PREFIX, GREEDY, DecodeMode.VERICACHE, SnapKV(), steer_every=-1)


def test_a_request_that_does_not_choose_is_steered_where_the_prefix_is_long():
    long_prompt, long_prefix = tuple(range(1, STEERED_PREFIX_TOKENS + 40)), STEERED_PREFIX_TOKENS
    snapkv = SnapKV()

    def default(prefix=long_prefix, mode=DecodeMode.VERICACHE, compressor=snapkv, **chosen):
        return Request(long_prompt, prefix, GREEDY, mode, compressor, **chosen).steer_every

    assert default() == DEFAULT_STEER_EVERY == 1
    assert default(prefix=STEERED_PREFIX_TOKENS - 1) == 0  # a short system turn: it loses there
    assert default(compressor=KIVI(bits=4)) == default(compressor=H2O(ratio=4)) == 0
    # A composition steers when asked, not by default: it was measured to gain nothing.
    assert default(compressor=COMPOSED) == 0 and default(compressor=COMPOSED, steer_every=1) == 1
    assert default(mode=DecodeMode.LOSSY) == default(mode=DecodeMode.FULL, compressor=None) == 0
    assert default(steer_every=0) == 0 and default(steer_every=3) == 3  # its own choice stands


def _planned(engine, compressor, base_version: int = 0):
    """A steering over the tiny model's compressed prefix, fed random verification queries, and
    the refresh it plans from `base_version`; the full and the compressed prefix."""
    prefix = _prompt()[:PREFIX]
    full = engine.prefix_kv(prefix)
    compressed = engine.compressed_prefix_kv(prefix, compressor)
    steering = KeptSetSteering.of(1, compressed, PREFIX, compressor)
    _observe_queries(engine, steering, len(compressed.layers), seed=0)
    assert steering.round_done()
    return steering, steering.plan(full, base_version), full, compressed


def _observe_queries(engine, steering: KeptSetSteering, num_layers: int, seed: int) -> None:
    """Random verification queries [7, Hq, D] for every layer, as the runner's hook gives them."""
    generator = torch.Generator().manual_seed(seed)
    config = engine.runner.config
    for index in range(num_layers):
        queries = torch.randn(7, config.num_heads, config.head_dim, generator=generator)
        steering.observe(index, None, queries, None)


def test_a_refresh_carries_what_changes_and_makes_the_set_it_planned(tiny_engine):
    engine, compressor = tiny_engine(), SnapKV(ratio=4, window=8)
    steering, refresh, full, compressed = _planned(engine, compressor)
    base = kept_positions(compressed, PREFIX)
    stored = stored_kept_positions(compressed.to_state())
    assert all(torch.equal(a, b) for a, b in zip(stored, base))
    assert refresh.version == 1 and refresh.base_version == 0 and refresh.num_changed > 0
    # It carries the changed entries alone: a position and a row each, not the whole set.
    whole = sum(p.numel() for p in base if p is not None)
    assert refresh.num_changed < whole
    session = shared_clone(compressed, compressed.num_tokens + 16)
    apply_refresh(session, PREFIX, refresh)
    made = kept_positions(session, PREFIX)
    for got, planned in zip(made, refreshed_positions(base, refresh)):
        assert torch.equal(got, planned)
    for layer in refresh.layers:  # each added entry holds the full KV's row at its position
        kept = session.layers[layer.index].shared
        positions = kept.positions()
        keys, _ = kept.slots(0, kept.num_slots)
        full_keys, _ = full.layers[layer.index].keys_values()
        for head, added in zip(layer.heads.tolist(), layer.added.tolist()):
            slot = int((positions[:, head] == added).nonzero())
            assert torch.equal(keys[slot, head], full_keys[added, head].to(keys.dtype))
    # The prefix's shared compressed KV is as it was.
    assert all(torch.equal(a, b) for a, b in zip(kept_positions(compressed, PREFIX), base))


def test_a_refresh_is_checked_where_it_arrives(tiny_engine):
    engine = tiny_engine()
    steering, refresh, _, compressed = _planned(engine, SnapKV(ratio=4, window=8))
    sealed = refresh.sealed()
    assert sealed.is_intact() and not refresh.is_intact()  # unsealed: nothing to check
    layer = sealed.layers[0]
    damaged_keys = layer.keys.clone()
    damaged_keys.view(torch.uint8)[0] ^= 1  # one bit flipped on the way
    damaged = dataclasses.replace(
        sealed, layers=(dataclasses.replace(layer, keys=damaged_keys), *sealed.layers[1:])
    )
    assert not damaged.is_intact()
    # A drafter that lost refresh 1 still holds set 0: the next refresh is planned from it.
    assert steering.holds(0)
    _observe_queries(engine, steering, len(compressed.layers), seed=1)
    again = steering.plan(engine.prefix_kv(_prompt()[:PREFIX]), 0)
    assert (again.version, again.base_version) == (2, 0)
    apply_refresh(shared_clone(compressed, compressed.num_tokens + 4), PREFIX, again)


def test_a_compositions_refresh_quantizes_its_leading_groups_again_from_the_full_kv(tiny_engine):
    engine = tiny_engine()
    steering, refresh, full, compressed = _planned(engine, COMPOSED)
    base = kept_positions(compressed, PREFIX)
    assert all(
        torch.equal(a, b) for a, b in zip(stored_kept_positions(compressed.to_state()), base)
    )
    assert refresh.num_changed > 0 and all(
        isinstance(layer, LayerRegrouped) for layer in refresh.layers
    )
    session = compressed.clone()
    apply_refresh(session, PREFIX, refresh)
    made = kept_positions(session, PREFIX)
    for got, planned, before in zip(made, refreshed_positions(base, refresh), base):
        assert torch.equal(got, planned)
        assert got.shape == before.shape  # the same number of slots per head
        assert torch.equal(got[64:], before[64:])  # the 11 past the two groups stay
        assert bool((got[1:] > got[:-1]).all())  # ascending per head, below those 11
    for layer in refresh.layers:  # the groups as compressing with those positions stores them
        grouped = layer.groups["positions"]
        full_keys, full_values = full.layers[layer.index].keys_values()
        heads = torch.arange(grouped.shape[1])
        at = (grouped.long(), heads)
        expected = quantized_groups(full_keys[at], full_values[at], grouped, 4, 32)
        stored = session.layers[layer.index].to_state().tensors
        for name, tensor in expected.items():
            rows = tensor.shape[0]
            assert torch.equal(stored[name][:rows], tensor), name
    # The prefix's own compressed KV is as it was; a damaged refresh is told apart.
    assert all(torch.equal(a, b) for a, b in zip(kept_positions(compressed, PREFIX), base))
    sealed = refresh.sealed()
    layer = sealed.layers[0]
    codes = layer.groups["key_codes"].clone()
    codes[0, 0, 0] ^= 1
    groups = layer.groups | {"key_codes": codes}
    damaged = dataclasses.replace(sealed, layers=(LayerRegrouped(layer.index, 1, groups),))
    assert sealed.is_intact() and not damaged.is_intact()
