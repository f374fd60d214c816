"""bench sim-validate's predictions: every configuration a CPU benchmark served is simulated from
the benchmark's own record (stream, link, memory, acceptance) and the calibrated profile, and the
error is the largest over them. The benchmarks themselves are exercised by their own tests."""

from __future__ import annotations

import copy
import dataclasses
import json
import random
import statistics

import pytest

from tests.sim_validate_data import CPU, MODEL, REMOTE_PREFIX
from vericache.bench import sim_validate, sim_validate_serve
from vericache.bench.serve_stagger import POLICIES
from vericache.bench.sim_validate_remote_prefix import (
    remote_prefix_predictions,
)
from vericache.bench.sim_validate_scenarios import (
    NUM_SEEDS,
    gpu_predictions,
    long_context_predictions,
    measured_acceptance,
    served_rounds,
    stagger_predictions,
)
from vericache.bench.sim_validate_serve import serve_stagger_predictions
from vericache.model.loader import DEFAULT_MODEL, load_tokenizer
from vericache.scheduler import LockstepScheduler, StaggeredScheduler
from vericache.sim.profiles import device_profile

H200 = device_profile("h200")


LONG_CONTEXT = {
    "config": {
        "compressor": "snapkv-4x-bf16", "num_requests": 6, "prompt_tokens": [1400] * 6,
        "max_tokens": 24, "draft_len": 30, "weights_bytes": 651_306_240,
        "budget_bytes": 651_306_240 + 4 * 80_000_000, "pcie_bandwidth_bytes_per_s": 2e9,
    },
    "runs": {
        "full": {"stats": {"decode_tokens_per_s": 30.0}, "mean_accepted_per_round": 0.0},
        "vericache": {"stats": {"decode_tokens_per_s": 60.0}, "mean_accepted_per_round": 10.0},
    },
}  # fmt: skip


STAGGER = {
    "config": {
        "compressor": "snapkv-4x", "num_requests": 8, "prompt_tokens": [1000] * 8,
        "max_tokens": 32, "draft_len": 12, "link_bytes_per_s": 2e8, "window": 160,
        "load_slack": 1,
    },
    "runs": {
        name: {"stats": {"decode_tokens_per_s": 40.0}, "mean_accepted_per_round": 8.0}
        for name in ("lockstep", "staggered")
    },
}  # fmt: skip


def _served(tokens_per_s: float, accepted: list[list[int]]) -> dict:
    rounds = [a for request in accepted for a in request]
    return {
        "tokens_per_s": tokens_per_s, "mean_accepted_per_round": sum(rounds) / len(rounds),
        "accepted_per_round_by_request": accepted,
    }  # fmt: skip


# Four requests of 32 tokens over one 1200-token prefix, x = 12; the verifier holds two full KVs
# and loads one in about six draft steps (the store read at 2 GB/s, then the 200 MB/s path).
SERVE_STAGGER = {
    "config": {
        "model": DEFAULT_MODEL, "compressor": "kvzip-4x", "num_prefixes": 1, "num_requests": 4,
        "max_tokens": 32, "draft_len": 12, "resident_full_kvs": 2.0, "load_draft_steps": 3.0,
        "window": 160, "quick": True,
    },
    "summary": {"load_bandwidth_mb_s": 200.0},
    "request_full_kv_bytes": 60_000_000,
    "prefix_full_kv_bytes": 55_296_000,
    "prefixes": [
        {"num_tokens": 1200, "full_kv_bytes": 55_296_000, "compressed_kv_bytes": 13_824_000},
    ],
    "drafter_kv_cache_bytes": 4 << 30,
    "full_local": {"store_bytes": 400_000_000, "store_wait_s": 0.2},
    "runs": {
        policy: _served(rate, [[12, 5, 12], [3, 12, 8, 6], [12, 12, 4], [7, 12, 9]])
        for policy, rate in zip(POLICIES, (10.0, 8.0, 12.0))
    },
}  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer(embedded_tokenizer_dir):
    return load_tokenizer(embedded_tokenizer_dir)  # its weights are never converted


def test_every_served_configuration_is_predicted(tokenizer):
    predictions = remote_prefix_predictions(REMOTE_PREFIX, MODEL, CPU, tokenizer)
    predictions += long_context_predictions(LONG_CONTEXT, MODEL, CPU)
    names = [p.configuration for p in predictions]
    assert names == [c["name"] for c in REMOTE_PREFIX["cells"]] + ["full", "vericache"]
    assert all(p.predicted_tokens_per_s > 0 for p in predictions)
    for p in predictions:
        assert p.relative_error == pytest.approx(
            p.predicted_tokens_per_s / p.measured_tokens_per_s - 1
        )
    by_name = {p.configuration: p for p in predictions}
    # Latency on the link toward the drafter only slows VERICACHE down.
    near, far = by_name["vericache x=30 rtt=0.0"], by_name["vericache x=30 rtt=0.02"]
    assert far.predicted_tokens_per_s < near.predicted_tokens_per_s


def test_predictions_follow_the_measured_acceptance_and_the_link(tokenizer):
    base = remote_prefix_predictions(REMOTE_PREFIX, MODEL, CPU, tokenizer)
    changed = copy.deepcopy(REMOTE_PREFIX)
    changed["cells"][4]["samples"][0]["mean_accepted_per_round"] = 2.0
    changed["bandwidth_bytes_per_s"] = 3e6  # FULL_REMOTE's prefixes crawl in
    lower = remote_prefix_predictions(changed, MODEL, CPU, tokenizer)
    assert lower[4].predicted_tokens_per_s < base[4].predicted_tokens_per_s
    assert lower[1].predicted_tokens_per_s < base[1].predicted_tokens_per_s


def test_the_summary_gives_the_largest_error():
    predictions = long_context_predictions(LONG_CONTEXT, MODEL, CPU)
    gpu, gpu_device = gpu_predictions(sim_validate.committed_gpu_runs(), MODEL, H200)
    measured = {"long-context": LONG_CONTEXT | {"summary": {}}}
    result = sim_validate.result(predictions, gpu, {"profile": {}}, {}, measured)
    summary = result["summary"]
    largest = max(abs(p.relative_error) for p in predictions)
    assert summary["cpu_prediction_error"] == largest
    assert summary["meets_target"] == (largest <= sim_validate.TARGET)
    assert summary["gpu_prediction_error"] == max(abs(p.relative_error) for p in gpu)
    assert {"long-context: full", "long-context: vericache"} < set(
        summary["relative_error_by_configuration"]
    )


def test_the_h200_profile_takes_its_overheads_from_the_committed_decode_speed_run():
    """The 135M engine on an H200 is bound by its overheads: a forward's, a row's, and what the
    batch-invariant kernels add to a row, each from the committed step times."""
    runs = sim_validate.committed_gpu_runs()
    gpu, device = gpu_predictions(runs, MODEL, H200)
    steps = runs["decode_speed_cuda"]["step_ms"]
    assert device.exact_row_overhead_s * MODEL.num_layers * 1e3 == pytest.approx(
        steps["full_invariant"] - steps["full_fast"]
    )
    assert device.forward_overhead_s > 10 * H200.forward_overhead_s > 0
    assert [p.benchmark for p in gpu] == ["long-context (H200)"] * 2 + ["stagger (H200)"] * 2


def test_the_benchmarks_run_at_their_quick_settings():
    from vericache.bench import long_context, remote_prefix, serve_stagger

    args = sim_validate._quick_args(remote_prefix, DEFAULT_MODEL)
    spec = remote_prefix.stream_spec(args)
    assert args.quick and spec.num_requests == 4 and spec.repeats == 1
    args = sim_validate._quick_args(long_context, DEFAULT_MODEL, device="cpu")
    assert args.quick and args.device == "cpu" and args.compressor == "snapkv-4x-bf16"
    spec = serve_stagger.setup(sim_validate._quick_args(serve_stagger, DEFAULT_MODEL))
    assert spec.quick and spec.num_requests == 4 and spec.max_tokens == 32


def test_both_schedulings_are_simulated_by_their_own_scheduler():
    lockstep, staggered = stagger_predictions(STAGGER, MODEL, CPU)
    assert (lockstep.configuration, staggered.configuration) == ("lockstep", "staggered")
    # Over a link where a load takes longer than the drafts hide, staggering wins.
    assert staggered.predicted_tokens_per_s > lockstep.predicted_tokens_per_s


def test_an_earlier_cpu_calibration_without_a_co_runner_takes_the_bundled_cpus():
    earlier = {"profile": dataclasses.asdict(CPU), "dtype": "float32"}
    calibration = sim_validate._with_co_runner(earlier)
    bundled = device_profile("cpu").co_runner_slowdown
    assert calibration["profile"]["co_runner_slowdown"] == bundled > 1
    assert calibration["co_runner"]["source"] == device_profile("cpu").source
    measured = earlier | {"co_runner": {"slowdown": 1.1}}
    assert sim_validate._with_co_runner(measured) is measured


def test_the_committed_runs_full_kv_cells_on_the_drafter_are_predicted_within_a_quarter(
    tmp_path,
):
    """The committed CPU run simulated again: the cells where the drafter decodes full KV it
    fetched, or where both workers decode at once, which a simulator that timed the stream
    without its first wave's end, priced no co-runner and fetched at the bare link's rate
    predicted 36-48% fast."""
    from vericache.cli.bench import parse_benchmark_args

    committed = sim_validate.RESULTS / "sim_validate.json"
    module, args = parse_benchmark_args("sim-validate", ["--from-json", str(committed)])
    errors = module.run(args)["summary"]["relative_error_by_configuration"]
    for name in ("full_remote d=1", "full_both d=1", "vericache x=8 d=1 per-request"):
        assert abs(errors[f"remote-prefix: {name}"]) < 0.25, name
    assert abs(errors["remote-prefix: many-prefixes: full_remote d=1"]) < 0.25


def test_served_rounds_are_rebuilt_from_the_budget():
    # x=4, 12 tokens: rounds accept 4 of 4, 1 of 4 (its second rejected), then 3 of the 3 the
    # budget leaves; at 3 tokens and x=8, one round of 1 draft (rejected), then none to draft.
    assert served_rounds([[4, 1, 3]], 4, 12) == [[4, 4], [4, 1], [3, 3]]
    assert served_rounds([[0, 0]], 8, 3) == [[1, 0], [0, 0]]


def test_rounds_that_kept_all_their_drafts_are_lower_bounds_not_left_out():
    # Every round cut short by the budget with all its drafts kept, but one that rejected its
    # sixth: leaving them out replayed 5 a round; as lower bounds they replay what they kept.
    run = {"rounds": [[23, 23], [12, 12], [6, 5], [3, 3], [0, 0]], "mean_accepted_per_round": 9}
    trace = measured_acceptance(run, 30, "test")
    assert (trace.first_mismatch, trace.kept_all) == ((5,), (23, 12, 3))
    rng = random.Random(0)
    draws = [trace.accepted(12, rng) for _ in range(4000)]
    # At x=12: 23 and 12 keep 12; 3 goes on past 3, to 23, 12 or 5 (12, 12, 5); 5 stays 5.
    assert statistics.mean(draws) == pytest.approx((12 + 12 + 5 + (12 + 12 + 5) / 3) / 4, rel=0.03)
    older = {"first_mismatch": [5, 0], "mean_accepted_per_round": 9}  # before rounds were kept
    assert measured_acceptance(older, 30, "test").first_mismatch == (5, 0)


@pytest.mark.parametrize("serve_stagger", [False, True], ids=["before-serve-stagger", "all"])
def test_an_earlier_runs_measurements_are_simulated_again(tmp_path, serve_stagger):
    """An earlier run is simulated again, serve-stagger where it measured it (runs before it
    was served have none)."""
    from vericache.cli.bench import parse_benchmark_args

    measured = {"remote-prefix": REMOTE_PREFIX, "long-context": LONG_CONTEXT, "stagger": STAGGER}
    if serve_stagger:
        measured["serve-stagger"] = SERVE_STAGGER
    earlier = {
        "profile": dataclasses.asdict(CPU),
        "measured": measured,
        "environment": {"cpu": "the machine that measured"},
    }
    path = tmp_path / "earlier.json"
    path.write_text(json.dumps(earlier))
    module, args = parse_benchmark_args("sim-validate", ["--from-json", str(path)])
    result = module.run(args)
    assert result["measured_environment"] == {"cpu": "the machine that measured"}
    num_served = len(POLICIES) if serve_stagger else 0
    num_cpu = len(REMOTE_PREFIX["cells"]) + 2 + 2 + num_served
    assert len(result["predictions"]) == num_cpu + 4  # 4: H200
    served = [p for p in result["predictions"] if p["benchmark"] == "serve-stagger"]
    assert [p["configuration"] for p in served] == list(POLICIES)[:num_served]
    assert result["summary"]["cpu_prediction_error"] >= 0


def test_a_full_remote_prefix_run_is_simulated_in_place_of_the_earlier_quick_one(tmp_path):
    from vericache.cli.bench import parse_benchmark_args

    measured = {"remote-prefix": REMOTE_PREFIX, "long-context": LONG_CONTEXT, "stagger": STAGGER}
    earlier = {"profile": dataclasses.asdict(CPU), "measured": measured, "environment": {}}
    (tmp_path / "earlier.json").write_text(json.dumps(earlier))
    # The full run: its full-KV cells alone, served on another day.
    full_cells = [c for c in REMOTE_PREFIX["cells"] if c["mode"] != "vericache"]
    served = REMOTE_PREFIX | {"cells": full_cells, "environment": {"cpu": "the full run's"}}
    (tmp_path / "full.json").write_text(json.dumps(served))
    given = ["--from-json", str(tmp_path / "earlier.json")]
    module, args = parse_benchmark_args(
        "sim-validate", [*given, "--remote-prefix", str(tmp_path / "full.json")]
    )
    result = module.run(args)
    remote = [
        p["configuration"] for p in result["predictions"] if p["benchmark"] == "remote-prefix"
    ]
    assert remote == [c["name"] for c in full_cells]
    assert result["measured_environment"]["remote_prefix"] == {"cpu": "the full run's"}
    module, args = parse_benchmark_args(
        "sim-validate", ["--remote-prefix", str(tmp_path / "full.json")]
    )
    with pytest.raises(ValueError, match="served on the full run's"):  # another model of CPU
        module.run(args)


def test_a_full_remote_prefix_run_alone_is_priced_by_a_calibration_of_its_machine(
    tmp_path, monkeypatch
):
    from vericache.bench.common import environment
    from vericache.calibration import calibrate
    from vericache.cli.bench import parse_benchmark_args

    calibrated = []

    def calibrated_now(*args) -> dict:
        calibrated.append(args)
        return {"profile": dataclasses.asdict(CPU)}

    monkeypatch.setattr(calibrate, "calibrate", calibrated_now)
    served = REMOTE_PREFIX | {"environment": {"cpu": environment()["cpu"]}}
    (tmp_path / "full.json").write_text(json.dumps(served))
    module, args = parse_benchmark_args(
        "sim-validate", ["--remote-prefix", str(tmp_path / "full.json")]
    )
    result = module.run(args)
    assert len(calibrated) == 1
    cpu_cells = [p["configuration"] for p in result["predictions"] if "H200" not in p["benchmark"]]
    assert cpu_cells == [c["name"] for c in REMOTE_PREFIX["cells"]]  # nothing else served
    assert result["profile"] == dataclasses.asdict(CPU)


def test_every_serve_stagger_policy_is_predicted(tokenizer):
    predictions = serve_stagger_predictions(SERVE_STAGGER, MODEL, CPU, tokenizer)
    assert [p.configuration for p in predictions] == list(POLICIES)
    assert {p.benchmark for p in predictions} == {"serve-stagger"}
    for p in predictions:
        assert p.measured_tokens_per_s == SERVE_STAGGER["runs"][p.configuration]["tokens_per_s"]
        assert p.predicted_tokens_per_s > 0


def test_serve_staggers_scheduled_policies_are_planned_by_the_coordinators_own_scheduler(
    tokenizer, monkeypatch
):
    """Lock-step and staggered rounds, each by the scheduler the served coordinator made for it,
    with the run's window (lock-step's loads after its drafts, as served)."""
    made = []
    real = sim_validate_serve.simulate_vericache_scheduled

    def recorded(scenario, make_scheduler):
        def make(costs):
            made.append(make_scheduler(costs))
            return made[-1]

        return real(scenario, make)

    monkeypatch.setattr(sim_validate_serve, "simulate_vericache_scheduled", recorded)
    per_request, lockstep, staggered = serve_stagger_predictions(
        SERVE_STAGGER, MODEL, CPU, tokenizer
    )
    # One scheduler per simulation: each policy is simulated at every seed of its draws.
    expected = [LockstepScheduler] * NUM_SEEDS + [StaggeredScheduler] * NUM_SEEDS
    assert [type(scheduler) for scheduler in made] == expected
    assert {scheduler.config.window for scheduler in made} == {160}
    assert made[0].draft_len == 12 and not made[0].overlap_loads
    # Two full KVs of room for four requests, each load six draft steps long: lock-step's
    # verifications wait for their loads after the drafts, staggered ones do not.
    assert staggered.predicted_tokens_per_s > lockstep.predicted_tokens_per_s


def test_serve_stagger_follows_the_accepted_drafts_of_its_per_request_rounds(tokenizer):
    base = serve_stagger_predictions(SERVE_STAGGER, MODEL, CPU, tokenizer)
    changed = copy.deepcopy(SERVE_STAGGER)
    changed["runs"]["per-request"] = _served(10.0, [[1, 0, 2, 0, 1, 3, 0, 1, 2, 0, 1, 0]] * 4)
    lower = serve_stagger_predictions(changed, MODEL, CPU, tokenizer)
    for before, after in zip(base, lower, strict=True):
        assert after.predicted_tokens_per_s < before.predicted_tokens_per_s


def test_an_earlier_runs_calibration_timings_are_fitted_again(tmp_path):
    """Where an earlier run stored its calibration's timings, its profile is fitted again to them
    (here: timings of a device like CPU, under a stored profile ten times too fast)."""
    from vericache.cli.bench import parse_benchmark_args
    from vericache.sim.calibration_fit import predicted_seconds

    products = [
        {"rows": rows, "weight_bytes": 1e9, "flops": 2e9 * rows,
         "seconds": max(1e9 / CPU.hbm_bytes_per_s, 2e9 * rows / CPU.peak_flops)}
        for rows in (1, 2, 4, 8, 64)  # the roofline turns at 4 rows: exact between them
    ]  # fmt: skip
    forwards = [
        {"num_layers": layers, "new_tokens": 1, "context": context, "batch": batch, "exact": False}
        for layers in (15, 30)
        for context in (1024, 4096)
        for batch in (1, 4)
    ]
    for forward in forwards:
        forward["seconds"] = predicted_seconds(CPU, MODEL, forward, 4)
    stored = dataclasses.replace(CPU, hbm_bytes_per_s=10 * CPU.hbm_bytes_per_s)
    earlier = {
        "profile": dataclasses.asdict(stored),
        "calibration": {"dtype": "float32", "products": products, "forwards": forwards},
        "measured": {"remote-prefix": REMOTE_PREFIX, "long-context": LONG_CONTEXT,
                     "stagger": STAGGER},
        "environment": {"cpu": "the machine that measured"},
    }  # fmt: skip
    path = tmp_path / "earlier.json"
    path.write_text(json.dumps(earlier))
    module, args = parse_benchmark_args("sim-validate", ["--from-json", str(path)])
    result = module.run(args)
    assert result["profile"]["hbm_bytes_per_s"] == pytest.approx(CPU.hbm_bytes_per_s)
    for forward in result["calibration"]["forwards"]:
        assert forward["predicted_s"] == pytest.approx(forward["seconds"], rel=0.05)
