"""Scheduler unit tests on hand-built inputs (no model): costs and S, the ADMIT search order, the
timeline of a round, waiting and admission as memory frees, lock-step rounds, the protocol's
errors. Units: 1 s iterations and 100 bytes/s, so a 200-byte full KV loads in S = 2 iterations."""

from __future__ import annotations

import subprocess
import sys

import pytest

from vericache.errors import InvalidRequestError, VeriCacheError
from vericache.scheduler import (
    CostModel,
    LockstepScheduler,
    SchedulerConfig,
    SchedulerRequest,
    SchedulerStateError,
    StaggeredScheduler,
    draft_len_order,
)


def _costs(budget=10_000, weights=100, bandwidth=100.0) -> CostModel:
    return CostModel(1.0, bandwidth, budget, weights)


def _req(rid, full=200, compressed=50, draft_len=4) -> SchedulerRequest:
    return SchedulerRequest(rid, full, compressed, draft_len)


def _run(scheduler, num_iterations, accepted=0, finish=()):
    """Runs iterations, verifying every planned request; returns the plans."""
    plans = []
    for _ in range(num_iterations):
        plan = scheduler.schedule()
        for verify in plan.verifies:
            scheduler.on_verified(verify.request_id, accepted, verify.request_id in finish)
        scheduler.end_iteration()
        plans.append(plan)
    return plans


def _verify_iterations(plans) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for plan in plans:
        for verify in plan.verifies:
            out.setdefault(verify.request_id, []).append(plan.iteration)
    return out


# -- costs ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "num_bytes, expected",
    [(1, 1), (50, 1), (100, 1), (101, 2), (200, 2), (201, 3), (1000, 10)],
)
def test_num_load_iterations(num_bytes, expected):
    assert _costs().num_load_iterations(num_bytes) == expected


def test_calibrate_takes_median_iteration_and_total_bandwidth():
    costs = CostModel.calibrate([5.0, 1.0, 1.2], [(100, 1.0), (300, 1.0)], 1000, 10)
    assert costs.iteration_s == 1.2
    assert costs.link_bytes_per_s == 200.0
    with pytest.raises(InvalidRequestError):
        CostModel.calibrate([], [(100, 1.0)], 1000)
    with pytest.raises(InvalidRequestError):
        CostModel.calibrate([1.0], [(100, 0.0)], 1000)


def test_online_refinement_changes_s():
    costs = _costs()
    assert costs.num_load_iterations(200) == 2
    for _ in range(60):
        costs.observe_load(200, 8.0)  # 25 bytes/s: a quarter of the calibrated bandwidth
    assert costs.link_bytes_per_s == pytest.approx(25.0, rel=1e-3)
    assert costs.num_load_iterations(200) == 8
    for _ in range(60):
        costs.observe_iteration(2.0)
    assert costs.num_load_iterations(200) == 4


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(iteration_s=0.0, link_bytes_per_s=1, memory_budget_bytes=1),
        dict(iteration_s=1, link_bytes_per_s=-1, memory_budget_bytes=1),
        dict(iteration_s=1, link_bytes_per_s=1, memory_budget_bytes=0),
        dict(iteration_s=1, link_bytes_per_s=1, memory_budget_bytes=10, weights_bytes=10),
        dict(iteration_s=float("nan"), link_bytes_per_s=1, memory_budget_bytes=1),
        dict(iteration_s=1, link_bytes_per_s=1, memory_budget_bytes=1, alpha=0),
    ],
)
def test_bad_costs_are_refused(kwargs):
    with pytest.raises(InvalidRequestError):
        CostModel(**kwargs)


# -- ADMIT ------------------------------------------------------------------------------------


def test_draft_len_order():
    assert list(draft_len_order(5, 2, 9)) == [5, 4, 6, 3, 7, 2, 8, 9]
    assert list(draft_len_order(1, 3, 6)) == [3, 4, 5, 6]  # clamped up to S
    assert list(draft_len_order(20, 3, 6)) == [6, 5, 4, 3]  # clamped down to W-1


def test_round_timeline():
    scheduler = StaggeredScheduler(_costs())
    scheduler.add_request(_req("a", draft_len=4))
    plans = _run(scheduler, 10, accepted=3)
    assert [p.draft_ids for p in plans[:5]] == [("a",)] * 4 + [()]
    # The load books iterations 2-3 and completes before the verification in iteration 4.
    assert [p.iteration for p in plans if p.loads] == [2, 7]
    assert plans[2].loads[0].verify_iteration == 4 and plans[2].loads[0].num_bytes == 200
    assert [(p.iteration, v.num_drafts) for p in plans for v in p.verifies] == [
        (4, 4),
        (9, 4),
    ]
    assert [p.draft_ids for p in plans[5:9]] == [("a",)] * 4  # re-admitted after iteration 4
    metrics = scheduler.request_state("a").metrics
    assert (metrics.num_rounds, metrics.num_accepted, metrics.num_output_tokens) == (2, 6, 8)


def test_a_verification_longer_than_an_iteration_spans_several():
    # A verification of 2.5 iterations spans V = 3: it starts right after the drafts, others
    # draft meanwhile, and it is reported (and its full KV released) in its third iteration.
    costs = _costs()
    costs.observe_verification(2.5)
    assert costs.num_verify_iterations() == 3
    scheduler = StaggeredScheduler(costs, SchedulerConfig(window=16))
    scheduler.add_request(_req("a", draft_len=4))
    plans = _run(scheduler, 14, accepted=3)
    assert [(p.iteration, [v.request_id for v in p.verify_starts]) for p in plans[:7]] == [
        (0, []), (1, []), (2, []), (3, []), (4, ["a"]), (5, []), (6, []),
    ]  # fmt: skip
    assert [p.iteration for p in plans if p.verifies] == [6, 13]
    assert plans[2].loads[0].verify_iteration == 4  # the load ends before the verification starts
    assert [p.draft_ids for p in plans[4:11]] == [()] * 3 + [("a",)] * 4  # drafts again after 6
    assert scheduler.full_kv_reserved_bytes(scheduler.iteration) == 0
    # Full KV stays reserved while the verification runs (iterations 4-6 of the first round).
    memory = [m.memory_bytes for m in scheduler.metrics.iterations]
    assert memory[2:7] == [100 + 50 + 200] * 5 and memory[7] == 100 + 50


def test_lockstep_verifications_span_several_iterations():
    costs = _costs()
    costs.observe_verification(1.5)  # V = 2
    scheduler = LockstepScheduler(costs, draft_len=4, config=SchedulerConfig(window=16))
    for rid in "ab":
        scheduler.add_request(_req(rid))
    plans = _run(scheduler, 12)
    # 400 bytes load in iterations 4-7; both start verifying in 8 and are reported in 9.
    assert [len(p.verify_starts) for p in plans[:10]] == [0] * 8 + [2, 0]
    assert [len(p.verifies) for p in plans[:10]] == [0] * 9 + [2]
    assert plans[10].draft_ids == ("a", "b")


def test_admit_tries_best_then_minus_one_plus_one():
    # S = 1 and no slack: each load must take the iteration right before its verification.
    scheduler = StaggeredScheduler(_costs(), SchedulerConfig(window=16, load_slack=0))
    for rid in "abcde":
        scheduler.add_request(_req(rid, full=100, draft_len=5))
    plan = scheduler.schedule()
    draft_lens = {rid: scheduler.request_state(rid).reservation.num_drafts for rid in "abcde"}
    assert draft_lens == {"a": 5, "b": 4, "c": 6, "d": 3, "e": 7}
    assert set(plan.draft_ids) == set("abcde")


@pytest.mark.parametrize(
    "load_slack, b_draft_len, b_bookings",
    [(1, 6, ((3, 1.0), (4, 0.5))), (0, 5, ((3, 1.0), (4, 0.5)))],
)
def test_load_slack_uses_partly_booked_iterations(load_slack, b_draft_len, b_bookings):
    # 150-byte loads (S = 2) leave half an iteration free, which the next load may use: with a
    # slack iteration b verifies with a; without, b's load must end right before its own verify.
    config = SchedulerConfig(window=16, load_slack=load_slack)
    scheduler = StaggeredScheduler(_costs(), config)
    scheduler.add_request(_req("a", full=150, draft_len=6))
    scheduler.add_request(_req("b", full=150, draft_len=6))
    scheduler.schedule()
    a, b = (scheduler.request_state(rid).reservation for rid in "ab")
    assert a.link_bookings == ((4, 0.5), (5, 1.0))
    assert (b.num_drafts, b.link_bookings) == (b_draft_len, b_bookings)
    assert all(scheduler.link_booked_s(i) <= 1.0 for i in range(16))


def test_memory_pushes_verifications_apart():
    # Room for one full KV in flight at a time: b's load must not overlap a's.
    budget = 100 + 2 * 50 + 200
    scheduler = StaggeredScheduler(_costs(budget=budget), SchedulerConfig(window=16))
    scheduler.add_request(_req("a"))
    scheduler.add_request(_req("b"))
    plans = _run(scheduler, 20)
    for plan in plans:
        assert scheduler.metrics.iterations[plan.iteration].memory_bytes <= budget
    verify_iterations = _verify_iterations(plans)
    assert verify_iterations["a"][0] == 4 and verify_iterations["b"][0] == 7
    assert scheduler.metrics.peak_memory_bytes == budget


def test_waiting_request_admitted_when_memory_frees():
    # b's compressed KV fits only once a has finished (a verifies in iteration 4, then finishes).
    scheduler = StaggeredScheduler(_costs(budget=100 + 50 + 200))
    scheduler.add_request(_req("a"))
    scheduler.add_request(_req("b"))
    plans = _run(scheduler, 5, finish={"a"})
    assert all(p.draft_ids == ("a",) for p in plans[:4])
    assert scheduler.waiting_ids == ["b"]
    assert [m.num_waiting for m in scheduler.metrics.iterations] == [1] * 5
    plan = scheduler.schedule()
    assert plan.draft_ids == ("b",) and scheduler.num_waiting == 0
    assert scheduler.request_state("b").metrics.num_waited_iterations == 5


@pytest.mark.parametrize(
    "budget, is_admitted, a_verifies", [(799, False, [6, 13]), (800, True, [6, 15])]
)
def test_new_request_keeps_room_for_the_largest_full_kv(budget, is_admitted, a_verifies):
    # After a's verification in iteration 6 no full KV is in flight and c's would fit beside the
    # resident KV, but with 799 bytes a's 600-byte full KV could then never load again.
    scheduler = StaggeredScheduler(_costs(budget=budget))
    scheduler.add_request(_req("a", full=600))  # S = 6: verifies in iteration 6
    scheduler.add_request(_req("c", full=100))
    plans = _run(scheduler, 20)
    assert _verify_iterations(plans)["a"][:2] == a_verifies  # c's loads push a's apart
    assert ("c" in scheduler.waiting_ids) != is_admitted
    assert all(("c" in p.draft_ids) == is_admitted for p in plans[:6])


def test_draft_len_policy_and_updates():
    scheduler = StaggeredScheduler(_costs(), choose_draft_len=lambda state: state.draft_len + 1)
    scheduler.add_request(_req("a", draft_len=4))
    plans = _run(scheduler, 6)
    assert plans[5 - 0].verifies[0].num_drafts == 5
    scheduler.set_draft_len("a", 8)
    plan = scheduler.schedule()
    assert scheduler.request_state("a").reservation.num_drafts == 9
    assert plan.draft_ids == ("a",)


def test_abort_frees_reservations():
    scheduler = StaggeredScheduler(_costs())
    scheduler.add_request(_req("a"))
    scheduler.add_request(_req("b", compressed=70))
    scheduler.schedule()
    scheduler.end_iteration()
    # a loads in iterations 2-3 for its verification in 4; b loads in 0-1 and verifies in 3.
    assert scheduler.link_booked_s(2) == 1.0 and scheduler.full_kv_reserved_bytes(4) == 200
    scheduler.abort("a")
    assert scheduler.link_booked_s(2) == 0.0 and scheduler.full_kv_reserved_bytes(4) == 0
    assert scheduler.full_kv_reserved_bytes(3) == 200
    assert scheduler.resident_bytes == 70
    scheduler.abort("b")
    assert not scheduler.has_requests and scheduler.resident_bytes == 0
    with pytest.raises(InvalidRequestError):
        scheduler.abort("b")


def test_load_longer_than_the_window_after_drift_books_the_window():
    scheduler = StaggeredScheduler(_costs(), SchedulerConfig(window=8))
    scheduler.add_request(_req("a", full=600))  # S = 6 of at most 7
    _run(scheduler, 7)
    for _ in range(60):
        scheduler.costs.observe_load(600, 12.0)  # S = 12 now
    plan = scheduler.schedule()
    reservation = scheduler.request_state("a").reservation
    assert plan.draft_ids == ("a",) and reservation.num_drafts == 7
    assert reservation.link_bookings == tuple((i, 1.0) for i in range(7, 14))


# -- lock-step --------------------------------------------------------------------------------


def test_lockstep_loads_after_drafting():
    scheduler = LockstepScheduler(_costs(), draft_len=4, config=SchedulerConfig(window=16))
    for rid in "abc":
        scheduler.add_request(_req(rid))
    plans = _run(scheduler, 12)
    assert [len(p.draft_ids) for p in plans[:11]] == [3] * 4 + [0] * 7
    assert [len(p.loads) for p in plans[:11]] == [0] * 4 + [3] + [0] * 6
    # 600 bytes of full KV take 6 iterations (4-9); everyone verifies in iteration 10.
    assert [len(p.verifies) for p in plans[:11]] == [0] * 10 + [3]
    assert scheduler.metrics.peak_memory_bytes == 100 + 3 * 50 + 3 * 200
    assert plans[11].draft_ids == ("a", "b", "c")


def test_lockstep_overlapped_loads_stall_when_link_bound():
    scheduler = LockstepScheduler(
        _costs(), draft_len=4, config=SchedulerConfig(window=16), overlap_loads=True
    )
    for rid in "abc":
        scheduler.add_request(_req(rid))
    plans = _run(scheduler, 7)
    assert len(plans[0].loads) == 3  # all at once, as early as the round allows
    assert [len(p.draft_ids) for p in plans] == [3, 3, 3, 3, 0, 0, 0]
    assert [len(p.verifies) for p in plans] == [0] * 6 + [3]


def test_lockstep_new_requests_join_the_next_round():
    scheduler = LockstepScheduler(_costs(budget=100 + 2 * 50 + 2 * 200), draft_len=2)
    scheduler.add_request(_req("a"))
    scheduler.schedule()
    scheduler.add_request(_req("b"))
    scheduler.add_request(_req("c"))
    scheduler.end_iteration()
    plans = _run(scheduler, 5)
    assert [p.draft_ids for p in plans] == [("a",), (), (), (), ("a", "b")]
    assert scheduler.waiting_ids == ["c"]  # memory holds two full KVs at once


# -- errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields",
    [
        dict(request_id="", full_kv_bytes=1, compressed_kv_bytes=0),
        dict(request_id="r", full_kv_bytes=0, compressed_kv_bytes=0),
        dict(request_id="r", full_kv_bytes=-5, compressed_kv_bytes=0),
        dict(request_id="r", full_kv_bytes=1, compressed_kv_bytes=-1),
        dict(request_id="r", full_kv_bytes=1, compressed_kv_bytes=0, draft_len=0),
    ],
)
def test_bad_requests_are_refused(fields):
    with pytest.raises(InvalidRequestError):
        SchedulerRequest(**fields)


def test_requests_that_can_never_run_are_refused_at_add():
    scheduler = StaggeredScheduler(_costs(budget=1000), SchedulerConfig(window=8))
    with pytest.raises(InvalidRequestError, match="budget"):
        scheduler.add_request(_req("big", full=900, compressed=1))
    with pytest.raises(InvalidRequestError, match="window"):
        scheduler.add_request(_req("slow", full=800, compressed=1))  # S = 8 > W - 1
    scheduler.add_request(_req("a"))
    with pytest.raises(InvalidRequestError, match="already"):
        scheduler.add_request(_req("a"))
    with pytest.raises(InvalidRequestError, match="window"):
        LockstepScheduler(_costs(), draft_len=8, config=SchedulerConfig(window=8))
    with pytest.raises(InvalidRequestError):
        SchedulerConfig(window=1)


def test_protocol_errors():
    scheduler = StaggeredScheduler(_costs())
    with pytest.raises(SchedulerStateError):
        scheduler.end_iteration()
    scheduler.add_request(_req("a", draft_len=1))
    plans = _run(scheduler, 2)
    assert plans[1].verifies == ()
    plan = scheduler.schedule()
    assert [v.request_id for v in plan.verifies] == ["a"]
    with pytest.raises(SchedulerStateError):
        scheduler.schedule()
    with pytest.raises(SchedulerStateError, match="not reported"):
        scheduler.end_iteration()
    with pytest.raises(InvalidRequestError):
        scheduler.on_verified("a", 3)  # only 2 tokens were drafted (S = 2)
    with pytest.raises(SchedulerStateError):
        scheduler.on_verified("b", 0)
    scheduler.on_verified("a", 2)
    with pytest.raises(SchedulerStateError, match="reported already"):
        scheduler.on_verified("a", 0)
    scheduler.end_iteration()
    assert issubclass(SchedulerStateError, VeriCacheError)


def test_scheduler_is_pure_python():
    code = (
        "import sys, vericache.scheduler, vericache.scheduler.simulate; "
        "print(sorted({'torch', 'numpy', 'ray'} & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
