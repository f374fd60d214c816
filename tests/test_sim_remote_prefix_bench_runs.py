"""Pipeline 2 simulated as a benchmark on one machine serves it: a stream timed after an untimed
first wave, workers that slow each other down on a shared memory system, and requests that accept
what they accepted when served."""

from __future__ import annotations

import dataclasses

import pytest

from tests.sim_scenarios import remote_prefix_scenario
from vericache.errors import InvalidRequestError
from vericache.sim.profiles import device_profile, model_profile
from vericache.sim.remote_prefix import FullPool, VeriCacheRequest, simulate_full
from vericache.sim.remote_prefix_auto import simulate_auto
from vericache.sim.remote_prefix_workers import Run, sessions

NUM_TOKENS = 32


def _scenario(**changes):
    """One verifier and one drafter, two prefixes in turn, a closed loop of two."""
    scenario = remote_prefix_scenario(
        num_drafters=1, num_prefixes=2, prefixes_in_turn=True, concurrency=2,
        arrivals=(0.0,) * 6, output_lengths=dataclasses.replace(
            remote_prefix_scenario().output_lengths, lengths=(NUM_TOKENS,)
        ),
    )  # fmt: skip
    return dataclasses.replace(scenario, **changes)


def test_the_stream_after_an_untimed_wave_starts_on_empty_workers():
    """The wave's sessions end before any other starts; the report marks where the rest began,
    and times them alone."""
    run = Run(_scenario(warmup_sessions=2))
    opened = []
    real_start = VeriCacheRequest.start

    def start(run, prefix, turns, arrival_s):
        opened.append((run.sim.now, turns.number, prefix))
        real_start(run, prefix, turns, arrival_s)

    report = run.serve(start)
    wave_end = report.timed_from_s
    assert [number for _, number, _ in opened] == list(range(6))
    assert all(at == 0.0 for at, number, _ in opened if number < 2)
    assert all(at >= wave_end > 0 for at, number, _ in opened if number >= 2)
    assert [at for at, number, _ in opened if number in (2, 3)] == [wave_end] * 2
    # The wave asks the prefixes the stream starts with, as a benchmark's wave serves its first
    # requests again.
    assert [prefix for _, _, prefix in opened] == [0, 1, 0, 1, 0, 1]
    assert report.untimed_tokens == 2 * NUM_TOKENS
    assert report.num_output_tokens == 6 * NUM_TOKENS
    timed = 4 * NUM_TOKENS / (report.elapsed_s - wave_end)
    assert report.timed_tokens_per_s == pytest.approx(timed)


def test_a_wave_needs_a_closed_loop_and_sessions_after_it():
    for changes in ({"concurrency": None}, {"warmup_sessions": 6}):
        with pytest.raises(InvalidRequestError):
            _scenario(**({"warmup_sessions": 2} | changes))


def test_with_many_prefixes_the_wave_repeats_the_streams_first_prefixes():
    scenario = _scenario(num_prefixes=8, arrivals=(0.0,) * 10, warmup_sessions=2)
    assert [prefix for _, prefix, _ in sessions(scenario)] == [0, 1, 0, 1, 2, 3, 4, 5, 6, 7]


def test_workers_on_one_memory_system_slow_each_other_down():
    """Both pools decoding at once each run the profile's co-runner slowdown slower; a pool
    alone runs as fast as on a device of its own. SmolLM2-135M on a CPU, prefixes a fast link
    away: the forwards bind."""
    device = dataclasses.replace(device_profile("cpu"), co_runner_slowdown=1.5)
    apart = _scenario(
        model=model_profile("smollm2-135m"), device=device, prefix_tokens=1000, element_size=4,
        network_bytes_per_s=20e9, network_latency_s=0.0,
    )  # fmt: skip
    shared = dataclasses.replace(apart, workers_share_memory=True)
    rates = {FullPool.LOCAL: 1.0, FullPool.REMOTE: 1.0}
    both_apart = simulate_full(apart, FullPool.BOTH, rates)
    both_shared = simulate_full(shared, FullPool.BOTH, rates)
    assert both_shared.elapsed_s > 1.3 * both_apart.elapsed_s
    assert both_shared.num_output_tokens == both_apart.num_output_tokens
    local_apart = simulate_full(apart, FullPool.LOCAL)
    local_shared = simulate_full(shared, FullPool.LOCAL)
    assert local_shared.elapsed_s == pytest.approx(local_apart.elapsed_s)


def test_serving_work_takes_its_time_from_forwards_where_every_core_computes():
    """On a 2-core machine, the serving work outside forwards runs on the core a lone pool leaves
    free; with both pools decoding it stretches each forward by its share."""
    cpu = _scenario(
        model=model_profile("smollm2-135m"), device=device_profile("cpu"), prefix_tokens=1000,
        element_size=4, network_bytes_per_s=20e9, network_latency_s=0.0,
        workers_share_memory=True,
    )  # fmt: skip
    served = dataclasses.replace(cpu, machine_cores=2, host_cpu_s_per_forward=0.05)
    rates = {FullPool.LOCAL: 1.0, FullPool.REMOTE: 1.0}
    both, both_served = (simulate_full(s, FullPool.BOTH, rates) for s in (cpu, served))
    assert both_served.elapsed_s > 1.15 * both.elapsed_s
    forwards = both_served.timed_forwards
    assert forwards["verifiers"].forwards > 0 and forwards["drafters"].forwards > 0
    assert both_served.timed_forwards["verifiers"].mean_seconds > 0.05
    local, local_served = (simulate_full(s, FullPool.LOCAL) for s in (cpu, served))
    assert local_served.elapsed_s == pytest.approx(local.elapsed_s)
    roomy = dataclasses.replace(served, machine_cores=3)
    assert simulate_full(roomy, FullPool.BOTH, rates).elapsed_s == pytest.approx(both.elapsed_s)


def test_auto_prices_the_serving_work_a_second_worker_costs_on_a_full_machine():
    """Where setting the idle drafter computing fills the machine's cores, every forward beside it
    waits for the serving work too: auto, which prices that, keeps more of a wave on the verifier
    the more the work costs, and counts requests placed on a worker as busy before they compute."""
    cpu = _scenario(
        model=model_profile("smollm2-135m"), device=device_profile("cpu"), prefix_tokens=1000,
        element_size=4, network_bytes_per_s=20e9, network_latency_s=0.0,
        workers_share_memory=True, machine_cores=2, concurrency=4, arrivals=(0.0,) * 8,
    )  # fmt: skip
    drafted = []
    for host_s in (0.0, 0.2):
        report = simulate_auto(dataclasses.replace(cpu, host_cpu_s_per_forward=host_s))
        drafted.append(report.timed_forwards["drafters"].rows)
    assert drafted[1] < drafted[0]


def test_each_session_accepts_its_recorded_rounds_then_draws():
    recorded = ((3, 40, 0), (7,))
    scenario = _scenario(arrivals=(0.0,) * 2, concurrency=1, accepted_by_session=recorded)
    run = Run(scenario)
    accepted = []
    real_verified = VeriCacheRequest._verified

    def verified(request):
        real_verified(request)
        accepted.append((request.turns.number, request.run.report.accepted_per_round[-1]))

    VeriCacheRequest._verified = verified
    try:
        run.serve(VeriCacheRequest.start)
    finally:
        VeriCacheRequest._verified = real_verified
    first = [a for number, a in accepted if number == 0]
    second = [a for number, a in accepted if number == 1]
    # After the prefill's token and a round that kept 3, the budget leaves 26 drafts: a record of
    # 40 keeps those 26.
    assert first == [3, 26]
    assert second[0] == 7 and len(second) > 1  # past its record, drawn
