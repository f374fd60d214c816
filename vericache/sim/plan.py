"""Deployment planners: for remote prefix caching (Pipeline 2, `vericache plan`), and for
long-context decoding (Pipeline 1, `plan_long_context`: the draft length and scheduler).

Given a model, the GPUs beside the full-KV store (local) and across the slow network (remote),
the links, and a workload (prefixes, prompts, output lengths, arrivals, and the compressors worth
trying with their bytes and acceptance), it simulates every configuration of VeriCache it can
choose and the full-KV ones on the same GPUs, and recommends the fastest that meets a latency
bound:
- the compressor, from the workload's list;
- the draft length x, from `draft_lens`;
- how many local workers verify (every remote worker drafts: drafters per verifier follow);
- per-request rounds, or each verifier's rounds planned by the staggered scheduler.
The full-KV baseline is the best of FULL_LOCAL (every local worker), FULL_REMOTE (every remote
worker) and FULL_BOTH (all of them, routed), so a plan that loses to it says so.

Workload file (YAML):

    prefix_tokens: 16384
    prefixes: 8
    suffix_tokens: 64
    output_tokens: [256, 512]
    requests: {count: 64, rate_per_s: 4}
    compressors:
      kivi-4bit: {compressed_ratio: 0.27, acceptance: {mean_accepted: 19, at_draft_len: 30}}
      snapkv-4x: {compressed_ratio: 0.25, compressed_token_share: 0.25, acceptance: {...}}
    seed: 0
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from vericache.errors import InvalidRequestError
from vericache.sim.remote_prefix import simulate_pools
from vericache.sim.scenario import (
    build_remote_prefix,
    report_summary,
    run_scenario,
    vericache_simulation,
)

_WORKLOAD_FIELDS = {
    "prefix_tokens", "prefixes", "suffix_tokens", "output_tokens", "requests", "compressors",
    "seed",
}  # fmt: skip
SCHEDULINGS = ("per-request", "staggered")


@dataclass(frozen=True)
class Hardware:
    device: str  # a device profile: bundled name or a calibration's JSON
    local_gpus: int  # beside the full-KV store
    remote_gpus: int  # across the slow network
    store_gb_per_s: float  # the store to each local GPU
    network_gb_per_s: float  # the store side to each remote GPU
    network_latency_ms: float = 0.0
    tensor_parallel: int = 1  # GPUs per worker

    def __post_init__(self):
        tp = self.tensor_parallel
        if tp < 1 or self.local_gpus < tp or self.remote_gpus < tp:
            raise InvalidRequestError(
                "a plan needs at least one worker of tensor_parallel GPUs on each side"
            )
        if self.local_gpus % tp or self.remote_gpus % tp:
            raise InvalidRequestError("local and remote GPUs must be multiples of tensor_parallel")

    @property
    def local_workers(self) -> int:
        return self.local_gpus // self.tensor_parallel

    @property
    def remote_workers(self) -> int:
        return self.remote_gpus // self.tensor_parallel


@dataclass(frozen=True)
class Candidate:
    compressor: str
    draft_len: int
    num_verifiers: int  # local workers that verify; every remote worker drafts
    num_drafters: int
    scheduling: str


def plan(
    model: str,
    hardware: Hardware,
    workload: dict,
    draft_lens: tuple[int, ...] = (4, 8, 16, 32),
    max_p99_latency_s: float | None = None,
) -> dict:
    """Every candidate simulated, the full-KV baselines, and the recommendation."""
    compressors = _compressors(workload)
    every_worker = _scenario(model, hardware, workload, next(iter(compressors.values())), None)
    full_scenario = build_remote_prefix(every_worker)
    baselines = _baselines(full_scenario)
    best_full = max(summary["tokens_per_s"] for summary in baselines.values())
    results = []
    for candidate in _candidates(hardware, compressors, draft_lens):
        data = _scenario(model, hardware, workload, compressors[candidate.compressor], candidate)
        report = vericache_simulation(data, candidate.draft_len)(build_remote_prefix(data))
        summary = report_summary(report)
        summary["speedup"] = summary["tokens_per_s"] / best_full
        results.append({**asdict(candidate), **summary})
    results.sort(key=lambda r: r["tokens_per_s"], reverse=True)
    eligible = [r for r in results if _meets(r, max_p99_latency_s)]
    return {
        "model": model,
        "hardware": asdict(hardware),
        "recommended": eligible[0] if eligible else None,
        "candidates": results,
        "baselines": baselines,
        "best_full_kv_tokens_per_s": best_full,
        "max_p99_latency_s": max_p99_latency_s,
        "sources": {
            "device": full_scenario.device.source,
            "acceptance": {name: spec["acceptance"] for name, spec in compressors.items()},
        },
    }


def _meets(result: dict, max_p99_latency_s: float | None) -> bool:
    return max_p99_latency_s is None or result["p99_latency_s"] <= max_p99_latency_s


def _candidates(hardware: Hardware, compressors: dict, draft_lens: tuple[int, ...]):
    if not draft_lens or min(draft_lens) < 1:
        raise InvalidRequestError("draft lengths must be >= 1")
    for compressor in compressors:
        for num_verifiers in range(1, hardware.local_workers + 1):
            for draft_len in draft_lens:
                for scheduling in SCHEDULINGS:
                    yield Candidate(
                        compressor, draft_len, num_verifiers, hardware.remote_workers, scheduling
                    )


def _baselines(scenario) -> dict:
    """FULL_LOCAL, FULL_REMOTE and FULL_BOTH over every GPU of the hardware."""
    reports = simulate_pools(scenario)
    return {pool.value: report_summary(report) for pool, report in reports.items()}


def _scenario(model, hardware: Hardware, workload: dict, compressor: dict, candidate) -> dict:
    """A remote-prefix scenario file's fields for one candidate (None: every worker, for the
    full-KV baselines, whose compressor and draft length play no part)."""
    return {
        "pipeline": "remote-prefix",
        "model": model,
        "device": hardware.device,
        "tensor_parallel": hardware.tensor_parallel,
        "verifiers": candidate.num_verifiers if candidate else hardware.local_workers,
        "drafters": hardware.remote_workers,
        "store_gb_per_s": hardware.store_gb_per_s,
        "network_gb_per_s": hardware.network_gb_per_s,
        "network_latency_ms": hardware.network_latency_ms,
        "draft_len": candidate.draft_len if candidate else 1,
        "scheduling": candidate.scheduling if candidate else "per-request",
        "compressed_ratio": compressor["compressed_ratio"],
        "compressed_token_share": compressor.get("compressed_token_share", 1.0),
        "acceptance": compressor["acceptance"],
        **{k: v for k, v in workload.items() if k != "compressors"},
    }


def _compressors(workload: dict) -> dict:
    unknown = sorted(set(workload) - _WORKLOAD_FIELDS)
    if unknown:
        raise InvalidRequestError(f"unknown workload fields: {unknown}")
    compressors = workload.get("compressors")
    if not isinstance(compressors, dict) or not compressors:
        raise InvalidRequestError("the workload names its compressors: {name: {...}}")
    for name, spec in compressors.items():
        required, optional = {"compressed_ratio", "acceptance"}, {"compressed_token_share"}
        if not isinstance(spec, dict) or not required <= set(spec) <= required | optional:
            raise InvalidRequestError(
                f"compressor {name!r} needs compressed_ratio and acceptance (and may give "
                "compressed_token_share), nothing else"
            )
    return compressors


def plan_long_context(
    data: dict, draft_lens: tuple[int, ...], schedulers: tuple[str, ...] = ("staggered", "lockstep")
) -> dict:
    """Pipeline 1: every draft length and scheduler simulated over a long-context scenario's
    fields (whose acceptance names the draft length it was measured at), and the staggered
    scheduler with adaptive draft lengths bounded by each; the fastest first."""
    acceptance = data.get("acceptance")
    if not isinstance(acceptance, dict) or not (
        {"first_mismatch", "at_draft_len", "bench"} & set(acceptance)
    ):
        raise InvalidRequestError("a plan over draft lengths needs acceptance.at_draft_len")
    candidates = []
    choices = [(x, scheduler, False) for x in draft_lens for scheduler in schedulers]
    choices += [(x, "staggered", True) for x in draft_lens if "staggered" in schedulers]
    for draft_len, scheduler, adaptive in choices:
        fields = {"draft_len": draft_len, "scheduler": scheduler, "adaptive_draft_len": adaptive}
        result = run_scenario(data | fields)
        candidates.append(fields | result["vericache"] | {"speedup": result["speedup"]})
    candidates.sort(key=lambda c: c["tokens_per_s"], reverse=True)
    return {"recommended": candidates[0], "candidates": candidates, "full_kv": result["full_kv"]}
