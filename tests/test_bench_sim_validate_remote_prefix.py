"""bench sim-validate's remote-prefix predictions: both streams of a `bench remote-prefix` result
simulated from its own record (the link as its fetches crossed it, the drafter's take-in, each
request's rounds, the serving work its machine's cores carried), each role's forwards beside the
served ones, and each cell held to the mean of its serves."""

from __future__ import annotations

import copy
import statistics

import pytest

from tests.sim_validate_data import CPU, MODEL, REMOTE_PREFIX, served_cell
from vericache.bench.remote_prefix_cells import FEW, MANY, Cell
from vericache.bench.sim_validate_remote_prefix import (
    host_cpu_s_per_forward,
    network_bytes_per_s,
    receive_bytes_per_s,
    remote_prefix_predictions,
)
from vericache.bench.sim_validate_scenarios import RoleForwards
from vericache.model.loader import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer(embedded_tokenizer_dir):
    return load_tokenizer(embedded_tokenizer_dir)  # its weights are never converted


def _many_prefix_cell(mode: str, tokens_per_s: float, draft_len=None, accepted=None) -> dict:
    name = Cell(mode, 1, draft_len, workload=MANY).name
    return served_cell(mode, tokens_per_s, draft_len, accepted) | {"name": name, "workload": MANY}


def test_the_many_prefix_stream_and_auto_are_predicted_with_warm_nodes(tokenizer):
    result = copy.deepcopy(REMOTE_PREFIX)
    result["config"]["many_requests"] = 6
    result["many_prefixes"] = [
        {"num_tokens": 3000 + i, "compressed_wire_bytes": 17e6, "full_wire_bytes": 138e6}
        for i in range(3)
    ]
    result["many_prefix_budgets"] = {"drafter_kv_bytes": 276e6, "host_tier_bytes": 520e6}
    result["cells"] += [
        _many_prefix_cell("full_local", 30.0), _many_prefix_cell("full_remote", 25.0),
        _many_prefix_cell("full_both", 35.0), _many_prefix_cell("vericache", 40.0, 8, 5.0),
        _many_prefix_cell("auto", 42.0, 8),
    ]  # fmt: skip
    predictions = remote_prefix_predictions(result, MODEL, CPU, tokenizer)
    assert [p.configuration for p in predictions] == [c["name"] for c in result["cells"]]
    assert all(p.predicted_tokens_per_s > 0 for p in predictions)
    # The few-prefix stream's cells are predicted as before the many-prefix stream was added.
    alone = remote_prefix_predictions(REMOTE_PREFIX, MODEL, CPU, tokenizer)
    assert [p.predicted_tokens_per_s for p in predictions[: len(alone)]] == pytest.approx(
        [p.predicted_tokens_per_s for p in alone]
    )


def test_each_roles_forwards_are_set_beside_the_served_ones_where_a_run_counted_them(tokenizer):
    counted = copy.deepcopy(REMOTE_PREFIX)
    for cell in counted["cells"]:
        cell["samples"][0] |= {
            "verifiers_forwards": 80, "verifiers_forward_rows": 120,
            "verifiers_forward_cpu_s": 2.0, "drafters_forwards": 40, "drafters_forward_rows": 40,
            "drafters_forward_cpu_s": 0.0,
        }  # fmt: skip
    predictions = {
        p.configuration: p for p in remote_prefix_predictions(counted, MODEL, CPU, tokenizer)
    }
    local = predictions["full_local"]
    assert local.measured_forwards["verifiers"] == RoleForwards(80, 1.5, 0.025)
    assert local.predicted_forwards["drafters"] == RoleForwards(0, 0.0)
    # 4 timed requests of 32 tokens, 2 at a time: about 2 x 32 forwards of up to 2 jobs; the
    # untimed first wave's 32 or so are not counted.
    verifiers = local.predicted_forwards["verifiers"]
    assert 60 <= verifiers.forwards <= 80 and 1.5 < verifiers.mean_batch <= 2
    assert 0.01 < verifiers.mean_seconds < 1
    remote = predictions["full_remote"].predicted_forwards
    assert remote["verifiers"].forwards == 0 and remote["drafters"].forwards >= 60
    drafted = predictions["vericache x=8 rtt=0.0"].predicted_forwards
    assert drafted["drafters"].forwards > drafted["verifiers"].forwards > 0
    uncounted = remote_prefix_predictions(REMOTE_PREFIX, MODEL, CPU, tokenizer)
    assert all(p.measured_forwards == {} for p in uncounted)


def test_serving_work_per_forward_is_what_a_streams_serves_spent_outside_their_forwards():
    cells = [
        {"samples": [{
            "cpu_s": {"verifiers": 9.0, "drafters": 4.0, "this_process": 1.0, "other": 1.0},
            "verifiers_forwards": 60, "verifiers_forward_cpu_s": 8.0,
            "drafters_forwards": 40, "drafters_forward_cpu_s": 3.0,
        }]},
        {"samples": [{"cpu_s": {"verifiers": 5.0}}]},  # uncounted: left out
    ]  # fmt: skip
    assert host_cpu_s_per_forward(cells) == pytest.approx(4.0 / 100)
    assert host_cpu_s_per_forward(cells[1:]) == 0.0


def test_a_fetch_crosses_the_wire_in_codec_bytes_behind_the_senders_encoding():
    """The simulator's link moves KV bytes: the run's bandwidth in wire bytes, each also waiting
    for the verifier to encode it (its CPU in FULL_REMOTE per byte sent)."""
    kv_per_wire = statistics.mean((55_296_000 / 55_000_000, 64_512_000 / 64_000_000))
    wire_s = 1 / 30e6 + 0.5 / 120e6
    assert network_bytes_per_s(REMOTE_PREFIX, FEW) == pytest.approx(kv_per_wire / wire_s)


def test_taking_fetched_kv_in_costs_the_drafter_what_its_requests_waited(tokenizer):
    """What FULL_REMOTE's requests waited for their fetches beyond the link's time for the bytes
    is the drafter's take-in (0.5 s for 120 MB here), and slows the simulated FULL_REMOTE; none
    waited, none charged."""
    fetched = 120e6 * statistics.mean((55_296_000 / 55_000_000, 64_512_000 / 64_000_000))
    assert receive_bytes_per_s(REMOTE_PREFIX) == pytest.approx(fetched / 0.5)
    charged = remote_prefix_predictions(REMOTE_PREFIX, MODEL, CPU, tokenizer)[1]
    free = copy.deepcopy(REMOTE_PREFIX)
    free["cells"][1]["samples"][0]["link_wait_s"] = 4.5  # the link's time alone
    assert receive_bytes_per_s(free) is None
    uncharged = remote_prefix_predictions(free, MODEL, CPU, tokenizer)[1]
    assert charged.predicted_tokens_per_s < uncharged.predicted_tokens_per_s


def test_vericache_requests_accept_what_each_accepted_when_served(tokenizer):
    """The same rounds in another order of the requests: a draw from the pooled rounds sees no
    difference, the run's own order does. A request whose rounds keep 2 drafts takes 11 rounds
    for its 32 tokens, one that keeps 8 four: served last, it decodes alone at the stream's end."""
    long, short = [8, 8, 8, 3], [2] * 10 + [0]
    early = copy.deepcopy(REMOTE_PREFIX)
    early["cells"][3]["samples"][0]["accepted_per_round_by_request"] = [long, short, long, long]
    last = copy.deepcopy(early)
    last["cells"][3]["samples"][0]["accepted_per_round_by_request"] = [long, long, long, short]
    by_early = remote_prefix_predictions(early, MODEL, CPU, tokenizer)[3]
    by_last = remote_prefix_predictions(last, MODEL, CPU, tokenizer)[3]
    assert by_last.predicted_tokens_per_s < 0.95 * by_early.predicted_tokens_per_s


def test_a_remote_prefix_cell_is_compared_with_the_mean_of_its_serves(tokenizer):
    """Serves can differ by a race (FULL_BOTH: whether the remote drafter holds the prefix it is
    sent), so the measured side is the mean of them, not one side's median."""
    raced = copy.deepcopy(REMOTE_PREFIX)
    cell = raced["cells"][0]
    first = cell["samples"][0]
    cell["samples"] = [first | {"tokens_per_s": rate} for rate in (19.1, 19.1, 26.4)]
    cell["tokens_per_s"] = 19.1  # the median
    measured = remote_prefix_predictions(raced, MODEL, CPU, tokenizer)[0].measured_tokens_per_s
    assert measured == pytest.approx((19.1 + 19.1 + 26.4) / 3)
