"""A simulation described in a YAML (or JSON) file: `vericache sim --scenario FILE.yaml`.

    pipeline: long-context          # Pipeline 1 (Pipeline 2 is to come)
    model: llama-3.1-70b            # a bundled model profile, or a JSON file
    device: h100-nvl                # a bundled device profile, or a calibration's JSON
    tensor_parallel: 2
    prompt_tokens: 32768
    kv_budget: 0.2                  # compressed KV: this share of the prompt's tokens
    draft_len: 25
    scheduler: staggered            # or lockstep
    requests: {count: 64, rate_per_s: 0.5}     # Poisson; or {count: 64} all at t=0
    output_tokens: [256, 512]       # drawn per request
    acceptance: {mean_accepted: 18, at_draft_len: 25}   # published; or {first_mismatch: [...]}
    seed: 0

Every field is checked, unknown ones refused. The result sets VeriCache against full-KV decoding
on the same device and memory, and names the sources of its profiles and acceptance.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from vericache.errors import InvalidRequestError
from vericache.scheduler import LockstepScheduler, StaggeredScheduler
from vericache.sim.long_context import (
    LongContextScenario,
    SimReport,
    simulate_full_kv,
    simulate_vericache,
)
from vericache.sim.profiles import device_profile, model_profile
from vericache.sim.workload import (
    AcceptanceTrace,
    OutputLengths,
    poisson_arrivals,
    rate_for_mean_accepted,
)

_FIELDS = {
    "pipeline", "model", "device", "tensor_parallel", "prompt_tokens", "kv_budget", "draft_len",
    "scheduler", "requests", "output_tokens", "acceptance", "seed", "activation_reserve",
}  # fmt: skip


def load_scenario(path: Path) -> dict:
    """The scenario file's fields, parsed (YAML or JSON; `run_scenario` checks them)."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        reason = exc.strerror
        raise InvalidRequestError(f"cannot read the scenario {Path(path).name}: {reason}") from None
    except yaml.YAMLError as exc:
        raise InvalidRequestError(f"the scenario {Path(path).name} is not YAML: {exc}") from None
    if not isinstance(data, dict):
        raise InvalidRequestError("a scenario is a mapping of fields")
    return data


def run_scenario(data: dict) -> dict:
    """Simulates the scenario: VeriCache with its scheduler, and full-KV decoding."""
    unknown = sorted(set(data) - _FIELDS)
    if unknown:
        raise InvalidRequestError(f"unknown scenario fields: {unknown}")
    if data.get("pipeline", "long-context") != "long-context":
        raise InvalidRequestError("pipeline must be long-context (remote-prefix is to come)")
    scenario = _long_context(data)
    make_scheduler = _scheduler(data.get("scheduler", "staggered"), scenario.draft_len)
    vericache, full = simulate_vericache(scenario, make_scheduler), simulate_full_kv(scenario)
    return {
        "scenario": data,
        "vericache": _summary(vericache),
        "full_kv": _summary(full),
        "speedup": vericache.tokens_per_s / full.tokens_per_s,
        "sources": {"device": scenario.device.source, "acceptance": scenario.acceptance.source},
    }


def _scheduler(name: str, draft_len: int):
    """The scheduler the scenario names: staggered, or lock-step with its loads overlapping the
    drafts (the stronger lock-step baseline)."""
    if name == "staggered":
        return StaggeredScheduler
    if name == "lockstep":
        return lambda costs: LockstepScheduler(costs, draft_len, overlap_loads=True)
    raise InvalidRequestError(f"scheduler must be staggered or lockstep, got {name!r}")


def _long_context(data: dict) -> LongContextScenario:
    requests = _mapping(data, "requests", {"count", "rate_per_s"})
    count = _int(requests, "count")
    seed = int(data.get("seed", 0))
    if "rate_per_s" in requests:
        arrivals = tuple(poisson_arrivals(float(requests["rate_per_s"]), count, seed))
    else:
        arrivals = (0.0,) * count
    lengths = data.get("output_tokens", [256])
    lengths = lengths if isinstance(lengths, list) else [lengths]
    try:
        return LongContextScenario(
            model=model_profile(str(data["model"])),
            device=device_profile(str(data["device"])),
            prompt_tokens=_int(data, "prompt_tokens"),
            kv_budget=float(data["kv_budget"]),
            draft_len=_int(data, "draft_len"),
            arrivals=arrivals,
            output_lengths=OutputLengths(tuple(int(n) for n in lengths)),
            acceptance=_acceptance(data, _int(data, "draft_len")),
            tensor_parallel=int(data.get("tensor_parallel", 1)),
            activation_reserve=float(data.get("activation_reserve", 0.1)),
            seed=seed,
        )
    except KeyError as exc:
        raise InvalidRequestError(f"the scenario lacks the field {exc.args[0]!r}") from None
    except (TypeError, ValueError) as exc:
        raise InvalidRequestError(f"a scenario field has the wrong type: {exc}") from None


def _acceptance(data: dict, draft_len: int) -> AcceptanceTrace:
    spec = _mapping(data, "acceptance", {"mean_accepted", "at_draft_len", "first_mismatch"})
    if "first_mismatch" in spec:
        return AcceptanceTrace("measured: the scenario's rounds", tuple(spec["first_mismatch"]))
    at = int(spec.get("at_draft_len", draft_len))
    mean = float(spec["mean_accepted"])
    rate = rate_for_mean_accepted(mean, at)
    return AcceptanceTrace.from_rate(rate, f"{mean:g} accepted per round at x={at}")


def _mapping(data: dict, name: str, allowed: set[str]) -> dict:
    value = data.get(name)
    if not isinstance(value, dict):
        raise InvalidRequestError(f"the scenario's {name!r} must be a mapping")
    unknown = sorted(set(value) - allowed)
    if unknown:
        raise InvalidRequestError(f"unknown fields of {name!r}: {unknown}")
    return value


def _int(data: dict, name: str) -> int:
    value = data.get(name)
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(f"the scenario's {name!r} must be an integer, got {value!r}")
    return value


def _summary(report: SimReport) -> dict:
    rounds = report.accepted_per_round
    return {
        "tokens_per_s": report.tokens_per_s,
        "num_output_tokens": report.num_output_tokens,
        "elapsed_s": report.elapsed_s,
        "device_utilization": report.device_busy_s / report.elapsed_s if report.elapsed_s else 0,
        "p50_latency_s": report.latency_percentile(0.5),
        "p99_latency_s": report.latency_percentile(0.99),
        "num_stalls": report.num_stalls,
        "stall_s": report.stall_s,
        "link_bytes": report.link_bytes,
        "mean_accepted_per_round": sum(rounds) / len(rounds) if rounds else None,
    }
