"""What steering a remote drafter's kept set costs its link (sim/steering_link.py), as the
simulator carries it and `mode: auto` prices it: a central verifier's refreshes add their bytes to
the draft calls; a warm node refreshes in place and adds none."""

from __future__ import annotations

import dataclasses

import pytest

from tests.sim_scenarios import remote_prefix_scenario
from tests.test_auto_path import KV_BYTES_PER_TOKEN, LINK, SHAPE, VERICACHE, costs
from tests.test_sim_scenario import REMOTE
from vericache.errors import InvalidRequestError
from vericache.scheduler import StaggeredScheduler
from vericache.serve.backends.path_costs import PathOption
from vericache.sim.remote_prefix import simulate_vericache
from vericache.sim.remote_prefix_scheduled import simulate_vericache_scheduled
from vericache.sim.scenario import build_remote_prefix
from vericache.sim.steering_link import (
    ENTRY_INDEX_BYTES,
    REFRESH_SHARE_GROWTH,
    STEERED_REFRESH_SHARE,
    refresh_bytes,
    refresh_bytes_per_round,
)
from vericache.sim.workload import OutputLengths


def test_a_refresh_carries_the_replaced_share_of_the_kept_set_and_its_indices():
    kept = 1e6  # bytes of kept keys and values, 64-wide heads in bf16: 256 bytes an entry
    assert refresh_bytes(kept, 64) == pytest.approx(
        STEERED_REFRESH_SHARE * kept * (256 + ENTRY_INDEX_BYTES) / 256
    )
    assert refresh_bytes_per_round(kept, 0, 64) == 0.0  # not steered
    assert refresh_bytes(kept, 64, regrouped=True) == kept  # a composition's groups, whole
    # Every 2 rounds a refresh replaces more, as measured, and is sent half as often.
    every_two = refresh_bytes(kept, 64) * 2**REFRESH_SHARE_GROWTH
    assert refresh_bytes(kept, 64, steer_every=2) == pytest.approx(every_two)
    assert refresh_bytes_per_round(kept, 2, 64) == pytest.approx(every_two / 2)
    assert refresh_bytes(kept, 64, steer_every=1000) == pytest.approx(kept * (256 + 16) / 256)
    with pytest.raises(ValueError, match="steer_every"):
        refresh_bytes_per_round(kept, -1, 64)


def test_auto_prices_a_central_verifiers_refreshes_and_a_warm_node_none():
    prices = costs()
    steered = dataclasses.replace(SHAPE, steer_every=1)

    def per_token(option: PathOption, shape) -> float:
        return prices.seconds_per_token(option, shape, 0.6, 0)

    central = PathOption(VERICACHE, "drafter-0", 0, 0, False, LINK)
    grouped = dataclasses.replace(steered, regrouped=True)
    assert per_token(central, grouped) > per_token(central, steered)  # the groups resent whole
    kept_bytes = SHAPE.prefix_tokens * KV_BYTES_PER_TOKEN * SHAPE.compressed_share
    link_s = LINK.transfer_s(refresh_bytes(kept_bytes, 64))  # a round's refresh on the link
    tokens_a_round = 0.6 * SHAPE.draft_len + 1
    added = per_token(central, steered) - per_token(central, SHAPE)
    assert added == pytest.approx(link_s / tokens_a_round)
    warm = dataclasses.replace(central, is_warm=True)
    assert per_token(warm, steered) == per_token(warm, SHAPE)


def _staggered(scenario):
    return simulate_vericache_scheduled(scenario, StaggeredScheduler)


@pytest.mark.parametrize(
    "simulate", [simulate_vericache, _staggered], ids=["per-request", "staggered"]
)
def test_the_simulator_sends_each_refresh_with_the_next_draft_call(simulate):
    # Every round accepts 19 of its drafts: 99 tokens after the first are 5 rounds a session.
    base = remote_prefix_scenario(
        arrivals=(0.0,) * 8, output_lengths=OutputLengths((100,)),
        accepted_by_session=((19,) * 5,) * 8,
    )  # fmt: skip
    plain, steered = (simulate(dataclasses.replace(base, steer_every=every)) for every in (0, 1))
    # A refresh after every verified round but each session's last, which none follows.
    assert len(plain.accepted_per_round) == len(steered.accepted_per_round) == 5 * 8
    refreshes = 4 * 8
    expected = refreshes * refresh_bytes(base.prefix_bytes(compressed=True), base.model.head_dim)
    assert steered.link_bytes - plain.link_bytes == pytest.approx(expected, rel=1e-6)
    assert steered.tokens_per_s <= plain.tokens_per_s
    # A composition's refresh resends its kept groups whole.
    grouped = simulate(dataclasses.replace(base, steer_every=1, compressed_groups=True))
    whole = refreshes * base.prefix_bytes(compressed=True)
    assert grouped.link_bytes - plain.link_bytes == pytest.approx(whole, rel=1e-6)


def test_a_scenario_file_names_its_steering_and_a_negative_one_is_refused():
    steered = build_remote_prefix(REMOTE | {"steer_every": 2, "compressed_groups": True})
    assert (steered.steer_every, steered.compressed_groups) == (2, True)
    assert build_remote_prefix(REMOTE).steer_every == 0
    with pytest.raises(InvalidRequestError, match="steer_every"):
        remote_prefix_scenario(steer_every=-1)
