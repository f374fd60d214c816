"""The simulator against measurement: small versions of the CPU benchmarks run for real, the same
workloads simulated with the CPU profile calibrated in the same run, and predicted tokens/s set
against measured ones per configuration.

In one run, on one torch thread per worker (the Ray workers' setting, and the calibration's):
1. `vericache calibrate`'s measurements on this CPU give the device profile (vericache/sim), each
   timing the mean of a calibration before the benchmarks and one after them.
2. `bench remote-prefix --quick`: FULL_LOCAL, FULL_REMOTE, FULL_BOTH and VERICACHE at two draft
   lengths and over a link with latency, served through the SDK on Ray workers, each cell the
   median of `--repeats` (3) serves.
3. `bench long-context --quick`: full-KV decoding and VERICACHE at one memory budget, and
   `bench stagger --quick`: lock-step against staggered scheduling over a slow link.
4. `bench serve-stagger --quick`: the distributed system's rounds per request, lock-step and
   staggered, on Ray workers whose verifier holds two full KVs.
5. Each configuration simulated (bench/sim_validate_scenarios.py, sim_validate_remote_prefix.py,
   and sim_validate_serve.py for serve-stagger, its scheduled rounds planned by the scheduler the
   coordinator ran): the stream (timed as served, after its untimed first wave), the link (with
   the sender's encoding), the memory and each request's accepted drafts per round from the
   benchmark's own result, the device from the profile, its workers sharing this CPU's memory
   system (the profile's co-runner slowdown) and its cores (where the run counted its forwards'
   CPU: the serving work outside forwards, per forward, from the run's own CPU accounting, which
   takes its time from the forwards while every core computes). Nothing is fitted to the throughput.

`--from-json` simulates an earlier run's measurements again with the simulator as it is now, its
profile fitted again to its stored calibration timings (a change to the simulator or the fit
checked in seconds, nothing run for real); the result keeps the machine
the measurements came from (`measured_environment`). Serve-stagger is predicted where the earlier
run measured it; a CPU calibration from before the co-runner slowdown was measured takes the
bundled CPU profile's (`calibration.co_runner` says so).
With `--remote-prefix RESULT`, a full `bench remote-prefix` run's cells (its 3-prefix and
8-prefix streams, several serves a cell) are simulated in place of the earlier run's quick ones,
priced by the earlier run's profile: the two runs must come from one kind of machine, whose speed
may have moved between them (`measured_environment` keeps both). `--remote-prefix RESULT` alone
calibrates this machine now and simulates that run's cells only; the run must have been served on
this model of CPU. Where the run counted its workers' forwards (each role's forwards and the jobs
each held), the prediction sets the simulated ones beside them.

Headline `cpu_prediction_error`: the largest |predicted / measured - 1| over the configurations
(target <= 0.20). The committed H200 runs (long-context and stagger) are predicted too, from the
H200 datasheet with the overheads of the committed decode-speed run on it:
`gpu_prediction_error`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from vericache.bench import long_context, remote_prefix, serve_stagger, stagger
from vericache.bench.common import environment, pyplot, save_figure
from vericache.bench.sim_validate_remote_prefix import remote_prefix_predictions
from vericache.bench.sim_validate_scenarios import (
    Prediction,
    gpu_predictions,
    long_context_predictions,
    stagger_predictions,
)
from vericache.bench.sim_validate_serve import serve_stagger_predictions
from vericache.model.loader import DEFAULT_MODEL, load_tokenizer, resolve_tokenizer_dir
from vericache.sim.calibration_fit import averaged, refit
from vericache.sim.profiles import device_profile, model_profile

TARGET = 0.20
RESULTS = Path(__file__).parent / "results"
ARCH = "smollm2-135m"


def add_arguments(parser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument(
        "--repeats", type=int, default=3, help="serves per remote-prefix cell (the median)"
    )
    parser.add_argument(
        "--from-json",
        type=Path,
        help="an earlier sim-validate result: its profile and measurements simulated again by "
        "the simulator as it is now, nothing run for real",
    )
    parser.add_argument(
        "--remote-prefix",
        type=Path,
        help="a full `bench remote-prefix` result, simulated in place of the earlier run's "
        "quick one with --from-json (its profile, from the same kind of machine, prices it); "
        "alone, priced by a calibration of this machine (the model of CPU that served it)",
    )


def run(args) -> dict:
    if args.from_json is not None:
        earlier = json.loads(args.from_json.read_text())
        calibration = _with_co_runner(
            {**earlier.get("calibration", {}), "profile": earlier["profile"]}
        )
        if "forwards" in calibration:  # its measurements stored: fitted by today's fit
            calibration = refit(calibration, model_profile(ARCH))
        measured = earlier["measured"]
        measured_on = earlier.get("measured_environment", earlier["environment"])
        if args.remote_prefix is not None:
            served = json.loads(args.remote_prefix.read_text())
            measured = measured | {"remote-prefix": served}
            measured_on = measured_on | {"remote_prefix": served["environment"]}
    elif args.remote_prefix is not None:
        calibration, measured = _calibrated_for(json.loads(args.remote_prefix.read_text()))
        measured_on = {"remote_prefix": measured["remote-prefix"]["environment"]}
    else:
        calibration, measured = _measure(args)
        measured_on = environment()
        _keep_measurements(args, calibration, measured)
    predictions, gpu, gpu_device = _predict(calibration, measured, args.model)
    for p in predictions + gpu:
        print(
            f"[sim-validate] {p.benchmark} {p.configuration}: measured "
            f"{p.measured_tokens_per_s:.2f}, predicted {p.predicted_tokens_per_s:.2f} tokens/s"
            + "".join(
                f"; {role} forwards {served.forwards:.0f} x {served.mean_batch:.2f} jobs "
                f"x {1000 * served.mean_seconds:.0f} ms, predicted "
                f"{p.predicted_forwards[role].forwards:.0f} x "
                f"{p.predicted_forwards[role].mean_batch:.2f} x "
                f"{1000 * p.predicted_forwards[role].mean_seconds:.0f} ms"
                for role, served in p.measured_forwards.items()
            )
        )
    record = result(predictions, gpu, calibration, dataclasses.asdict(gpu_device), measured)
    return record | {"measured_environment": measured_on}


def _with_co_runner(calibration: dict) -> dict:
    """A CPU calibration from before `vericache calibrate` measured the co-runner slowdown, with
    the bundled CPU profile's: measured on the machine these benchmarks run on (a 2-core AMD EPYC,
    its source says), as the calibration's own would have been."""
    if calibration.get("co_runner") or calibration["profile"]["name"] != "cpu":
        return calibration
    bundled = device_profile("cpu")
    co_runner = {"slowdown": bundled.co_runner_slowdown, "source": bundled.source}
    profile = calibration["profile"] | {"co_runner_slowdown": bundled.co_runner_slowdown}
    return calibration | {"profile": profile, "co_runner": co_runner}


def _keep_measurements(args, calibration: dict, measured: dict) -> None:
    """Writes what was measured beside `--json` (NAME.measured.json) before anything is
    simulated: a run of half an hour stays usable with --from-json whatever the simulation does."""
    if getattr(args, "json", None):
        kept = {"calibration": calibration, "profile": calibration["profile"]}
        kept |= {"measured": measured, "environment": environment()}
        Path(args.json).with_suffix(".measured.json").write_text(json.dumps(kept, indent=1))


def _calibrated_for(served: dict) -> tuple[dict, dict]:
    """This CPU's profile, calibrated now, for a full `bench remote-prefix` run served on this
    model of CPU (a profile prices one model's forwards, not another's); the run as measured."""
    here, there = environment()["cpu"], served["environment"]["cpu"]
    if here != there:
        raise ValueError(f"the run was served on {there}; this machine is {here}")
    return _calibrate_cpu(), {"remote-prefix": served}


def _calibrate_cpu() -> dict:
    """One calibration of this CPU on one torch thread, as a worker runs."""
    import torch

    from vericache.calibration.calibrate import CalibrationPlan, calibrate

    torch.set_num_threads(1)
    model, device = model_profile(ARCH), torch.device("cpu")
    return calibrate(model, device, CalibrationPlan.for_device(device, model))


def _measure(args) -> tuple[dict, dict]:
    """This CPU's profile (one torch thread, as a worker runs), calibrated before and after the
    quick benchmarks run, so that a drift of the machine's speed over the run averages out."""
    before = _calibrate_cpu()
    measured = {
        "remote-prefix": remote_prefix.run(
            _quick_args(remote_prefix, args.model, repeats=args.repeats)
        ),
        "long-context": long_context.run(_quick_args(long_context, args.model, device="cpu")),
        "stagger": stagger.run(_quick_args(stagger, args.model, device="cpu")),
        "serve-stagger": serve_stagger.run(_quick_args(serve_stagger, args.model)),
    }
    calibration = averaged(before, _calibrate_cpu(), model_profile(ARCH))
    print(f"[sim-validate] calibrated: {calibration['profile']['hbm_bytes_per_s'] / 1e9:.1f} GB/s")
    return calibration, measured


def _predict(calibration: dict, measured: dict, model_name: str):
    from vericache.sim.profiles import DeviceProfile

    model, profile = model_profile(ARCH), DeviceProfile(**calibration["profile"])
    tokenizer = load_tokenizer(resolve_tokenizer_dir(model_name))  # no weights needed
    predictions = remote_prefix_predictions(measured["remote-prefix"], model, profile, tokenizer)
    if "long-context" in measured:  # a full remote-prefix run validated alone has none
        predictions += long_context_predictions(measured["long-context"], model, profile)
        predictions += stagger_predictions(measured["stagger"], model, profile)
    if "serve-stagger" in measured:  # runs before it did not serve it
        predictions += serve_stagger_predictions(
            measured["serve-stagger"], model, profile, tokenizer
        )
    gpu, gpu_device = gpu_predictions(committed_gpu_runs(), model, device_profile("h200"))
    return predictions, gpu, gpu_device


def committed_gpu_runs() -> dict:
    """The H200 runs under bench/results/, by file name."""
    names = ("decode_speed_cuda", "long_context_cuda", "stagger_cuda")
    return {name: json.loads((RESULTS / f"{name}.json").read_text()) for name in names}


def result(
    predictions: list[Prediction],
    gpu: list[Prediction],
    calibration: dict,
    gpu_profile: dict,
    measured: dict,
) -> dict:
    error = max(abs(p.relative_error) for p in predictions)
    gpu_error = max((abs(p.relative_error) for p in gpu), default=None)
    return {
        "benchmark": "sim-validate",
        "summary": {
            "cpu_prediction_error": error,
            "meets_target": error <= TARGET,
            "gpu_prediction_error": gpu_error,
            "relative_error_by_configuration": {
                f"{p.benchmark}: {p.configuration}": p.relative_error for p in predictions + gpu
            },
        },
        "definitions": {
            "relative_error": "predicted tokens/s / measured - 1, one configuration",
            "cpu_prediction_error": f"the largest |relative_error| on this CPU (target <= "
            f"{TARGET:g})",
            "gpu_prediction_error": "the largest |relative_error| over the committed H200 runs, "
            "from the H200 datasheet with the overheads of the committed decode-speed run",
        },
        "predictions": [
            dataclasses.asdict(p) | {"relative_error": p.relative_error} for p in predictions + gpu
        ],
        "profile": calibration["profile"],
        # What the profile was fitted from (products, copies, forwards), so that a later fit can
        # be tried on the same measurements.
        "calibration": {k: v for k, v in calibration.items() if k != "profile"},
        "gpu_profile": gpu_profile,
        "measured_summaries": {name: r.get("summary") for name, r in measured.items()},
        "measured": measured,
        "environment": environment(),
    }


def _quick_args(module, model: str, **overrides) -> argparse.Namespace:
    """The benchmark's own defaults, reduced (--quick)."""
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    args = parser.parse_args([])
    args.quick, args.model = True, model
    for name, value in overrides.items():
        setattr(args, name, value)
    return args


def plot(result: dict, path) -> None:
    plt = pyplot()
    predictions = result["predictions"]
    names = [f"{p['benchmark']}: {p['configuration']}" for p in predictions]
    errors = [100 * p["relative_error"] for p in predictions]
    figure, axes = plt.subplots(figsize=(9, 0.35 * len(names) + 1.2))
    colors = ["tab:blue" if "H200" not in name else "tab:green" for name in names]
    axes.barh(names, errors, color=colors)
    axes.axvspan(-100 * TARGET, 100 * TARGET, color="tab:gray", alpha=0.15)
    axes.axvline(0, color="black", linewidth=0.8)
    axes.invert_yaxis()
    axes.tick_params(axis="y", labelsize=8)
    axes.set_xlabel("simulated / measured tokens/s - 1, % (band: the 20% target)")
    summary = result["summary"]
    title = (
        f"largest error: this CPU {summary['cpu_prediction_error']:.0%} (blue), "
        f"the committed H200 runs {summary['gpu_prediction_error']:.0%} (green)"
    )
    save_figure(figure, path, title)
