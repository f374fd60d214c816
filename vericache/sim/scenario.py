"""A simulation described in a YAML (or JSON) file: `vericache sim --scenario FILE.yaml`.

Pipeline 1, long-context decoding on one device (or tensor-parallel group):

    pipeline: long-context
    model: llama-3.1-70b            # a bundled model profile, or a JSON file
    device: h100-nvl                # a bundled device profile, or a calibration's JSON
    tensor_parallel: 2
    dtype: bfloat16                 # or float16, float32, fp8: weights, activations and KV
    prompt_tokens: 32768
    kv_budget: 0.2                  # compressed KV: this share of the prompt's tokens
    draft_len: 25
    compressed_dtype: fp8           # optional: the kept tokens' dtype (default: dtype)
    scheduler: staggered            # or lockstep
    adaptive_draft_len: false       # true: each round's length from its acceptance (<= draft_len)
    requests: {count: 64, rate_per_s: 0.5}     # Poisson; or {count: 64} all at t=0
    output_tokens: [256, 512]       # drawn per request
    acceptance: {mean_accepted: 18, at_draft_len: 25}   # published; or {first_mismatch: [...]},
                                    # or {bench: acceptance.json, kind: code, compressor: kivi-4bit}
    seed: 0

Pipeline 2, remote prefix caching (per-request rounds, as the coordinator's default):

    pipeline: remote-prefix
    model: qwen2.5-32b
    device: h200                    # every verifier and drafter
    tensor_parallel: 1              # devices per worker (each moves its share on its own links)
    verifiers: 1                    # beside the full-KV store
    drafters: 4                     # across the slow network
    prefix_tokens: 16384
    prefixes: 8                     # each request's drawn uniformly
    suffix_tokens: 64               # the prompt after its prefix
    compressed_ratio: 0.27          # compressed KV bytes / full (KIVI 4-bit)
    compressed_token_share: 1.0     # prefix tokens it keeps (token dropping at 4x: 0.25)
    store_gb_per_s: 40              # the store to each verifier
    network_gb_per_s: 1.2           # the store side to each drafter
    network_latency_ms: 10          # one way
    draft_len: 40
    scheduling: per-request         # or staggered, lockstep: each verifier's scheduler plans
    prefix_caching: true            # false: every session fetches its own copy of its prefix
    verifier_prefix_cache_gb: 20    # optional: each role holds its prefixes (one copy each,
    drafter_prefix_cache_gb: 2.5    #   shared) within this budget (default: its KV room)
    prefixes_in_turn: false         # true: request i asks prefix i % prefixes
    requests: {count: 64, concurrency: 8}   # or a rate_per_s: a closed loop of 8 clients
    output_tokens, acceptance, seed: as above
    host_tier_gb: 256               # optional: each node's host memory for prefixes' KV
    recompute_prefixes: false       # true: prefill a full prefix where that beats its fetch
    shared_prefix_attention: false  # true: a forward reads a shared prefix once (cascade)
    warm_nodes: false               # true: drafter nodes verify once their host tier is warm
    turns_per_session: 1            # a session's sequential turns, each a request of its own
    steer_every: 0                  # rounds between a central verifier's kept-set refreshes
    compressed_groups: false        # true: the kept tokens are quantized groups (snapkv+kivi)
    mode: vericache                 # or auto: each request's path chosen, reported beside it

Every field is checked, unknown ones refused. The result sets VeriCache against full-KV serving on
the same devices and memory (Pipeline 1: full-KV decoding; Pipeline 2: FULL_LOCAL, FULL_REMOTE and
FULL_BOTH, the best of them the baseline), and names the sources of its profiles and acceptance.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from vericache.errors import InvalidRequestError
from vericache.scheduler import CostModel, LockstepScheduler, StaggeredScheduler
from vericache.scheduler.adaptive import bounded_adaptive_draft_len
from vericache.sim.long_context import (
    LongContextScenario,
    SimReport,
    simulate_full_kv,
    simulate_vericache,
)
from vericache.sim.profiles import device_profile, model_profile
from vericache.sim.remote_prefix import FullPool, compare
from vericache.sim.remote_prefix import simulate_vericache as simulate_vericache_per_request
from vericache.sim.remote_prefix_auto import simulate_auto
from vericache.sim.remote_prefix_scenario import RemotePrefixScenario
from vericache.sim.remote_prefix_scheduled import simulate_vericache_scheduled
from vericache.sim.workload import (
    AcceptanceTrace,
    OutputLengths,
    poisson_arrivals,
    rate_for_mean_accepted,
    trace_from_bench,
)

_COMMON = {
    "dtype",
    "pipeline",
    "model",
    "device",
    "draft_len",
    "requests",
    "output_tokens",
    "acceptance",
    "seed",
}
_FIELDS = {
    "long-context": _COMMON
    | {"tensor_parallel", "prompt_tokens", "kv_budget", "scheduler", "activation_reserve"}
    | {"adaptive_draft_len", "compressed_dtype"},
    "remote-prefix": _COMMON | {
        "verifiers", "drafters", "prefix_tokens", "prefixes", "suffix_tokens", "compressed_ratio",
        "store_gb_per_s", "network_gb_per_s", "network_latency_ms", "scheduling",
        "tensor_parallel", "activation_reserve", "prefix_caching", "compressed_token_share",
        "verifier_prefix_cache_gb", "drafter_prefix_cache_gb", "prefixes_in_turn",
        "host_tier_gb", "recompute_prefixes", "shared_prefix_attention", "warm_nodes",
        "turns_per_session", "mode", "steer_every", "compressed_groups",
    },
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
    """Simulates the scenario: VeriCache, and full-KV serving on the same devices. The result
    holds a summary per configuration, `baselines` (the full-KV ones) and `speedup`, VeriCache
    over the best baseline."""
    pipeline = data.get("pipeline", "long-context")
    if pipeline not in _FIELDS:
        raise InvalidRequestError(
            f"pipeline must be long-context or remote-prefix, not {pipeline!r}"
        )
    unknown = sorted(set(data) - _FIELDS[pipeline])
    if unknown:
        raise InvalidRequestError(f"unknown scenario fields for {pipeline}: {unknown}")
    if pipeline == "long-context":
        scenario = build_long_context(data)
        adaptive = _bool(data, "adaptive_draft_len", False)
        make_scheduler = _scheduler(
            data.get("scheduler", "staggered"), scenario.draft_len, adaptive
        )
        reports = {
            "vericache": simulate_vericache(scenario, make_scheduler),
            "full_kv": simulate_full_kv(scenario),
        }
    else:
        scenario = build_remote_prefix(data)
        compared = compare(scenario, vericache_simulation(data, scenario.draft_len))
        reports = {name: compared[name] for name in ("vericache", *(p.value for p in FullPool))}
    systems = {"vericache"}
    if _mode(data) == "auto":
        reports["auto"] = simulate_auto(scenario)
        systems.add("auto")
    baselines = [name for name in reports if name not in systems]
    best = max(reports[name].tokens_per_s for name in baselines)
    result = {
        "scenario": data,
        **{name: report_summary(report) for name, report in reports.items()},
        "baselines": baselines,
        "speedup": reports["vericache"].tokens_per_s / best,
        "sources": {"device": scenario.device.source, "acceptance": scenario.acceptance.source},
    }
    if "auto" in reports:
        result["auto_speedup"] = reports["auto"].tokens_per_s / best
    return result


def _mode(data: dict) -> str:
    mode = data.get("mode", "vericache")
    if mode not in ("vericache", "auto"):
        raise InvalidRequestError(f"mode must be vericache or auto, not {mode!r}")
    if mode == "auto" and data.get("pipeline") != "remote-prefix":
        raise InvalidRequestError("mode: auto is for remote-prefix")
    return mode


def build_long_context(data: dict) -> LongContextScenario:
    """A Pipeline 1 scenario from a scenario file's fields."""
    return _build(_long_context, data)


def build_remote_prefix(data: dict) -> RemotePrefixScenario:
    """A Pipeline 2 scenario from a scenario file's fields."""
    return _build(_remote_prefix, data)


def _build(make, data: dict):
    """A scenario record from the file's fields, a missing or mistyped field a clear error."""
    try:
        return make(data)
    except KeyError as exc:
        raise InvalidRequestError(f"the scenario lacks the field {exc.args[0]!r}") from None
    except InvalidRequestError:
        raise  # already says which field and why
    except (TypeError, ValueError) as exc:
        raise InvalidRequestError(f"a scenario field has the wrong type: {exc}") from None


def vericache_simulation(data: dict, draft_len: int):
    """The simulation of VeriCache's rounds the scenario names: per-request, or each verifier's
    rounds planned by a scheduler."""
    name = data.get("scheduling", "per-request")
    if name not in ("per-request", "staggered", "lockstep"):
        raise InvalidRequestError(
            f"scheduling must be per-request, staggered or lockstep: {name!r}"
        )
    if name == "per-request":
        return simulate_vericache_per_request
    make_scheduler = _scheduler(name, draft_len)
    return lambda scenario: simulate_vericache_scheduled(scenario, make_scheduler)


def _scheduler(name: str, draft_len: int, adaptive: bool = False):
    """The scheduler the scenario names: staggered (with every round's length chosen from its
    request's acceptance and the costs, if adaptive, as the long-context engine does), or
    lock-step with its loads overlapping the drafts (the stronger lock-step baseline)."""
    if adaptive and name != "staggered":
        raise InvalidRequestError("adaptive_draft_len needs the staggered scheduler")
    if name == "staggered" and adaptive:
        return _adaptive_staggered
    if name == "staggered":
        return StaggeredScheduler
    if name == "lockstep":
        return lambda costs: LockstepScheduler(costs, draft_len, overlap_loads=True)
    raise InvalidRequestError(f"scheduler must be staggered or lockstep, got {name!r}")


def _adaptive_staggered(costs: CostModel) -> StaggeredScheduler:
    scheduler = StaggeredScheduler(costs)
    scheduler.choose_draft_len = bounded_adaptive_draft_len(scheduler)
    return scheduler


def _long_context(data: dict) -> LongContextScenario:
    return LongContextScenario(
        model=model_profile(str(data["model"])),
        device=device_profile(str(data["device"])),
        prompt_tokens=_int(data, "prompt_tokens"),
        kv_budget=float(data["kv_budget"]),
        draft_len=_int(data, "draft_len"),
        arrivals=_arrivals(data),
        output_lengths=_output_lengths(data),
        acceptance=_acceptance(data, _int(data, "draft_len")),
        tensor_parallel=int(data.get("tensor_parallel", 1)),
        activation_reserve=float(data.get("activation_reserve", 0.1)),
        seed=int(data.get("seed", 0)),
        element_size=_element_size(data),
        compressed_element_size=(
            _element_size(data, "compressed_dtype") if "compressed_dtype" in data else None
        ),
    )


def _remote_prefix(data: dict) -> RemotePrefixScenario:
    return RemotePrefixScenario(
        model=model_profile(str(data["model"])),
        device=device_profile(str(data["device"])),
        num_verifiers=_int(data, "verifiers"),
        num_drafters=_int(data, "drafters"),
        prefix_tokens=_int(data, "prefix_tokens"),
        num_prefixes=_int(data, "prefixes"),
        suffix_tokens=_int(data, "suffix_tokens"),
        compressed_ratio=float(data["compressed_ratio"]),
        compressed_token_share=float(data.get("compressed_token_share", 1.0)),
        store_bytes_per_s=float(data["store_gb_per_s"]) * 1e9,
        network_bytes_per_s=float(data["network_gb_per_s"]) * 1e9,
        network_latency_s=float(data.get("network_latency_ms", 0.0)) / 1e3,
        draft_len=_int(data, "draft_len"),
        arrivals=_arrivals(data),
        output_lengths=_output_lengths(data),
        acceptance=_acceptance(data, _int(data, "draft_len")),
        seed=int(data.get("seed", 0)),
        tensor_parallel=int(data.get("tensor_parallel", 1)),
        activation_reserve=float(data.get("activation_reserve", 0.1)),
        prefix_caching=_bool(data, "prefix_caching", True),
        concurrency=_concurrency(data),
        element_size=_element_size(data),
        verifier_prefix_cache_bytes=_gigabytes(data, "verifier_prefix_cache_gb"),
        drafter_prefix_cache_bytes=_gigabytes(data, "drafter_prefix_cache_gb"),
        prefixes_in_turn=_bool(data, "prefixes_in_turn", False),
        host_tier_bytes=_gigabytes(data, "host_tier_gb"),
        recompute_prefixes=_bool(data, "recompute_prefixes", False),
        shared_prefix_attention=_bool(data, "shared_prefix_attention", False),
        warm_nodes=_bool(data, "warm_nodes", False),
        turns_per_session=int(data.get("turns_per_session", 1)),
        steer_every=int(data.get("steer_every", 0)),
        compressed_groups=_bool(data, "compressed_groups", False),
    )


def _gigabytes(data: dict, name: str) -> int | None:
    return None if data.get(name) is None else int(float(data[name]) * 1e9)


ELEMENT_SIZES = {"bfloat16": 2, "float16": 2, "float32": 4, "fp8": 1}


def _element_size(data: dict, name: str = "dtype") -> int:
    dtype = data.get(name, "bfloat16")
    if dtype not in ELEMENT_SIZES:
        raise InvalidRequestError(f"{name} must be one of {sorted(ELEMENT_SIZES)}, got {dtype!r}")
    return ELEMENT_SIZES[dtype]


def _bool(data: dict, name: str, default: bool) -> bool:
    value = data.get(name, default)
    if not isinstance(value, bool):
        raise InvalidRequestError(f"the scenario's {name!r} must be true or false, got {value!r}")
    return value


def _concurrency(data: dict) -> int | None:
    requests = _mapping(data, "requests", {"count", "rate_per_s", "concurrency"})
    if "concurrency" not in requests:
        return None
    if "rate_per_s" in requests:
        raise InvalidRequestError("requests take a rate_per_s or a concurrency, not both")
    return _int(requests, "concurrency")


def _arrivals(data: dict) -> tuple[float, ...]:
    requests = _mapping(data, "requests", {"count", "rate_per_s", "concurrency"})
    if "concurrency" in requests and data.get("pipeline") == "long-context":
        raise InvalidRequestError("a closed loop (requests.concurrency) is for remote-prefix")
    count = _int(requests, "count")
    if "rate_per_s" in requests:
        return tuple(
            poisson_arrivals(float(requests["rate_per_s"]), count, int(data.get("seed", 0)))
        )
    return (0.0,) * count


def _output_lengths(data: dict) -> OutputLengths:
    lengths = data.get("output_tokens", [256])
    lengths = lengths if isinstance(lengths, list) else [lengths]
    return OutputLengths(tuple(int(n) for n in lengths))


def _acceptance(data: dict, draft_len: int) -> AcceptanceTrace:
    spec = _mapping(
        data,
        "acceptance",
        {"mean_accepted", "at_draft_len", "first_mismatch", "bench", "kind", "compressor"},
    )
    if "bench" in spec:  # a `bench acceptance` result: its rounds of one kind and compressor
        result = load_scenario(Path(spec["bench"]))
        return trace_from_bench(result, str(spec["kind"]), str(spec["compressor"]))
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


def report_summary(report: SimReport) -> dict:
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
        "peak_kv_bytes": report.peak_kv_bytes,
        "mean_accepted_per_round": sum(rounds) / len(rounds) if rounds else None,
        "timeline": _downsampled(report.timeline),
        **_remote_prefix_accounts(report),
    }


def _remote_prefix_accounts(report: SimReport) -> dict:
    """Pipeline 2's own accounts, where the run kept them: what binds, and how it served."""
    if not report.utilization:
        return {}
    return {
        "binds": report.binds,
        "utilization": report.utilization,
        "paths": dict(report.paths),
        "num_warm_switches": report.num_warm_switches,
        "num_local_verifications": report.num_local_verifications,
        "num_central_verifications": report.num_central_verifications,
        "prefix_sources": dict(report.prefix_sources),
    }


TIMELINE_POINTS = 200


def _downsampled(timeline: list[tuple[float, int, int, int]]) -> dict:
    """At most TIMELINE_POINTS samples, evenly spaced in the record, the last one kept: seconds,
    output tokens, link bytes (cumulative) and KV bytes held."""
    step = max(1, -(-len(timeline) // TIMELINE_POINTS))  # ceiling division
    kept = timeline[::step]
    if timeline and kept[-1] is not timeline[-1]:
        kept.append(timeline[-1])
    names = ("t_s", "output_tokens", "link_bytes", "kv_bytes")
    return {name: [sample[i] for sample in kept] for i, name in enumerate(names)}
