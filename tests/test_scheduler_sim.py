"""Scheduler invariants over random workloads in the discrete simulator, and staggered against
lock-step scheduling on the paper's link-bound example (no model anywhere)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vericache.scheduler import (
    LockstepScheduler,
    SchedulerConfig,
    SchedulerRequest,
    StaggeredScheduler,
)
from vericache.scheduler.simulate import GB, SimHardware, SimRequest, paper_example, simulate

HARDWARE = SimHardware(iteration_s=1.0, link_bytes_per_s=100.0, memory_budget_bytes=0)
MAX_SPAN = 5  # the largest S a random request's load has


class InvariantChecker:
    """Checks every plan: rings within capacity over the whole window, every verification on the
    iteration its load was started for; and tracks the longest wait of admitted requests."""

    def __init__(self):
        self.verify_at: dict[str, int] = {}
        self.waiting_for: dict[str, int] = {}
        self.max_resident_wait = 0

    def __call__(self, scheduler, plan):
        costs, now = scheduler.costs, plan.iteration
        for i in range(now, now + scheduler.config.window):
            assert scheduler.link_booked_s(i) <= costs.iteration_s * (1 + 1e-9)
            assert scheduler.memory_in_use(i) <= costs.memory_budget_bytes
        for load in plan.loads:
            assert load.request_id not in self.verify_at
            assert now < load.verify_iteration < now + scheduler.config.window
            self.verify_at[load.request_id] = load.verify_iteration
        for verify in plan.verifies:
            assert self.verify_at.pop(verify.request_id) == now
        assert not set(plan.draft_ids) & {v.request_id for v in plan.verifies}
        self._track_waits(scheduler)

    def _track_waits(self, scheduler):
        for rid in scheduler.waiting_ids:
            if scheduler.request_state(rid).is_resident:
                self.waiting_for[rid] = self.waiting_for.get(rid, 0) + 1
                self.max_resident_wait = max(self.max_resident_wait, self.waiting_for[rid])
        for rid in set(self.waiting_for) - set(scheduler.waiting_ids):
            del self.waiting_for[rid]


@st.composite
def workloads(draw):
    window = draw(st.integers(8, 24))
    sizes = st.tuples(
        st.integers(1, MAX_SPAN * 100),  # full KV: S in [1, MAX_SPAN]
        st.integers(0, 100),  # compressed KV
        st.integers(1, 12),  # preferred draft length
        st.integers(1, 40),  # output tokens
        st.floats(0, 1),  # acceptance
        st.integers(0, 30),  # arrival iteration
    )
    rows = draw(st.lists(sizes, min_size=1, max_size=10))
    requests = [
        SimRequest(SchedulerRequest(f"r{i}", full, comp, x), tokens, acceptance, arrival)
        for i, (full, comp, x, tokens, acceptance, arrival) in enumerate(rows)
    ]
    weights = 100
    largest = max(r.request.full_kv_bytes + r.request.compressed_kv_bytes for r in requests)
    budget = weights + largest + draw(st.integers(0, 1500))
    hardware = SimHardware(1.0, 100.0, budget, weights)
    config = SchedulerConfig(
        window=window,
        load_slack=draw(st.integers(0, 2)),
        starvation_limit=draw(st.integers(0, 2 * window)),
    )
    return requests, hardware, config, draw(st.integers(0, 2**16))


def _check_run(scheduler, requests, hardware, seed):
    checker = InvariantChecker()
    result = simulate(
        scheduler, requests, hardware, seed=seed, on_plan=checker, max_iterations=20_000
    )
    assert result.num_stalls == 0  # every full KV arrived before its verification
    assert result.num_output_tokens == sum(r.num_output_tokens for r in requests)
    assert set(result.requests) == {r.request.request_id for r in requests}  # none starved
    assert not checker.verify_at
    assert result.peak_memory_bytes <= hardware.memory_budget_bytes
    return result, checker


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_staggered_invariants(workload):
    requests, hardware, config, seed = workload
    scheduler = StaggeredScheduler(hardware.costs(), config)
    _, checker = _check_run(scheduler, requests, hardware, seed)
    # A resident request never waits long: aging, then one window to drain, per request ahead.
    assert checker.max_resident_wait <= config.starvation_limit + len(requests) * config.window


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(), st.booleans(), st.integers(1, 10))
def test_lockstep_invariants(workload, overlap_loads, draft_len):
    requests, hardware, config, seed = workload
    # A round must fit the window: x plus the longest single load.
    scheduler = LockstepScheduler(
        hardware.costs(), min(draft_len, config.window - 1 - MAX_SPAN), config, overlap_loads
    )
    result, _ = _check_run(scheduler, requests, hardware, seed)
    for metrics in result.iterations:
        # All running requests draft together, then verify together.
        assert metrics.num_drafting in (0, metrics.num_running)
        assert metrics.num_verifying in (0, metrics.num_running)


def test_aging_admits_a_large_load_among_busy_small_ones():
    # 15 small requests book one iteration each, spread over the window; a load of 10 iterations
    # finds no room until aging holds the small ones back and the window drains.
    hardware = SimHardware(1.0, 100.0, 10**6, 0)
    small = [SimRequest(SchedulerRequest(f"s{i}", 100, 1, 15), 2000, 0.9) for i in range(15)]
    big = SimRequest(SchedulerRequest("big", 1000, 1, 15), 100, 0.9, arrival_iteration=40)
    waits = {}
    for limit in (16, 10**6):
        config = SchedulerConfig(window=16, load_slack=0, starvation_limit=limit)
        result = simulate(StaggeredScheduler(hardware.costs(), config), small + [big], hardware)
        waits[limit] = result.requests["big"].max_wait_iterations
    assert waits[16] <= 16 + 16
    assert waits[10**6] > 500  # without aging it waits for the small requests to finish


def _compare(num_requests, draft_len):
    requests, hardware = paper_example(num_requests=num_requests, draft_len=draft_len)
    config = SchedulerConfig(window=64)
    return {
        "staggered": simulate(StaggeredScheduler(hardware.costs(), config), requests, hardware),
        "lockstep": simulate(
            LockstepScheduler(hardware.costs(), draft_len, config), requests, hardware
        ),
        "lockstep_overlap": simulate(
            LockstepScheduler(hardware.costs(), draft_len, config, overlap_loads=True),
            requests,
            hardware,
        ),
    }


def test_staggered_beats_lockstep_when_link_bound():
    # Ten 4 GB loads take 20 iterations per round of 10 draft steps: lock-step stalls, staggering
    # keeps drafting and lets ADMIT lengthen the drafts to what the link allows.
    results = _compare(num_requests=10, draft_len=10)
    staggered = results["staggered"]
    for name in ("lockstep", "lockstep_overlap"):
        assert staggered.tokens_per_s >= 1.3 * results[name].tokens_per_s, name
        assert results[name].peak_memory_bytes == (48 + 10 * (1 + 4)) * GB
    assert staggered.peak_memory_bytes <= (48 + 10 * 1 + 2 * 4) * GB
    assert all(r.num_stalls == 0 for r in results.values())


def test_paper_example_memory_and_throughput():
    # x = 30 (the paper's example): the link keeps up, so only the paper's lock-step (loads after
    # drafting) loses throughput; both lock-step variants hold all ten full KVs at once.
    results = _compare(num_requests=10, draft_len=30)
    staggered = results["staggered"]
    assert staggered.tokens_per_s >= 1.3 * results["lockstep"].tokens_per_s
    assert staggered.tokens_per_s >= 0.95 * results["lockstep_overlap"].tokens_per_s
    assert staggered.peak_memory_bytes <= (48 + 10 + 2 * 4) * GB
    assert staggered.mean("num_drafting") > results["lockstep"].mean("num_drafting")


@pytest.mark.parametrize("observe_costs", [False, True])
def test_online_refinement_stops_stalls(observe_costs):
    # Calibration said 100 GB/s; the link gives 50. Measured loads pull S up from 1 to 2.
    requests, hardware = paper_example(num_requests=10, draft_len=10, num_output_tokens=2000)
    costs = SimHardware(hardware.iteration_s, 100 * GB, 141 * GB, 48 * GB).costs()
    scheduler = StaggeredScheduler(costs, SchedulerConfig(window=64))
    result = simulate(scheduler, requests, hardware, observe_costs=observe_costs)
    if observe_costs:
        assert costs.link_bytes_per_s == pytest.approx(50 * GB, rel=1e-3)
        assert costs.num_load_iterations(4 * GB) == 2
        assert result.num_stalls <= 30
    else:
        assert result.num_stalls > 300
