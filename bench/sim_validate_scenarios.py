"""The simulator's scenarios for workloads a CPU benchmark has just served for real: every setting
read from the benchmark's own result (its stream, link, memory and acceptance), the device's from
the profile calibrated in the same run. No constant is fitted to the measured throughput."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial

from vericache.bench.common import compressor_from_label
from vericache.bench.workloads import CONTEXT_PROMPTS
from vericache.engine.prompt import build_chat_prompt
from vericache.scheduler import LockstepScheduler, SchedulerConfig, StaggeredScheduler
from vericache.sim import long_context as sim_long_context
from vericache.sim.long_context import LongContextScenario
from vericache.sim.profiles import DeviceProfile, ModelProfile
from vericache.sim.workload import (
    AcceptanceTrace,
    OutputLengths,
    rate_for_mean_accepted,
    trace_from_rounds,
)

ELEMENT_SIZE = 4  # the CPU benchmarks run the model in float32
# A quick run has few rounds, so one simulation's acceptance draws scatter its tokens/s by tens of
# percent: a prediction is the mean over this many seeds.
NUM_SEEDS = 5


@dataclass(frozen=True)
class RoleForwards:
    """A role's forwards over a timed stream (the mean over serves, or over seeds), the mean jobs
    each held and the mean seconds each took (served: the stepping thread's CPU seconds): where a
    served and a simulated stream part, whether in how many forwards the workers ran, in what
    each cost, or in the time between them."""

    forwards: float
    mean_batch: float
    mean_seconds: float = 0.0


@dataclass(frozen=True)
class Prediction:
    benchmark: str
    configuration: str
    measured_tokens_per_s: float
    predicted_tokens_per_s: float
    # Per role (verifiers, drafters), where the run counted them (remote-prefix).
    measured_forwards: dict[str, RoleForwards] = field(default_factory=dict)
    predicted_forwards: dict[str, RoleForwards] = field(default_factory=dict)

    @property
    def relative_error(self) -> float:
        return self.predicted_tokens_per_s / self.measured_tokens_per_s - 1


def measured_acceptance(run: dict, draft_len: int, what: str) -> AcceptanceTrace:
    """The run's own rounds where it recorded them (`rounds`: drafts made and kept, each a first
    mismatch or, where it kept all, a lower bound); for runs before that, the first mismatches
    they recorded (rounds that kept all their drafts left out); else rounds drawn at the
    per-draft rate that gives its mean accepted."""
    source = f"measured in this run: {what}"
    rounds = run.get("rounds") or []
    if any(drafted > 0 for drafted, _ in rounds):
        drafted, accepted = zip(*rounds)
        return trace_from_rounds(source, list(drafted), list(accepted))
    if run.get("first_mismatch"):
        return AcceptanceTrace(source, tuple(run["first_mismatch"]))
    mean = min(run["mean_accepted_per_round"] or 0.0, draft_len - 1e-6)
    by_rate = AcceptanceTrace.from_rate(rate_for_mean_accepted(mean, draft_len), what)
    return AcceptanceTrace(source, by_rate.first_mismatch)


def served_rounds(
    accepted_by_request: list[list[int]], draft_len: int, max_tokens: int
) -> list[list[int]]:
    """[drafts made, drafts kept] of each round of served requests, whose stats give each
    round's accepted drafts but not how many it drafted: a round drafts what the budget leaves
    (x, or fewer near the end)."""
    rounds = []
    for by_round in accepted_by_request:
        emitted = 1  # the prefill's token
        for num_accepted in by_round:
            rounds.append([max(0, min(draft_len, max_tokens - emitted - 1)), num_accepted])
            emitted += num_accepted + 1
    return rounds


def store_bytes_per_s(records: list[dict], default: float) -> float:
    """The verifier's loads from its store, as served streams measured them (`default` where
    they waited for none)."""
    store_s = sum(r["store_wait_s"] for r in records)
    return sum(r["store_bytes"] for r in records) / store_s if store_s > 0 else default


def prompt_suffix_tokens(tokenizer) -> int:
    """The prompt's tokens after its prefix: the chat template's turn and a question."""
    lengths = []
    for prompt in CONTEXT_PROMPTS:
        ids = build_chat_prompt(tokenizer, "context", prompt)
        lengths.append(len(ids.token_ids) - ids.num_prefix_tokens)
    return round(statistics.mean(lengths))


def served_acceptance(
    records: list[dict], draft_len: int, max_tokens: int, what: str
) -> AcceptanceTrace:
    """The rounds of served streams (`serving.stream_record`s), each of whose rounds drafted
    `draft_len` unless the budget cut it: rebuilt from their accepted drafts where recorded, else
    rounds at their mean accepted."""
    record = {"mean_accepted_per_round": statistics.mean(
        r["mean_accepted_per_round"] for r in records
    )}  # fmt: skip
    if all("accepted_per_round_by_request" in r for r in records):
        by_request = [a for r in records for a in r["accepted_per_round_by_request"]]
        record["rounds"] = served_rounds(by_request, draft_len, max_tokens)
    return measured_acceptance(record, draft_len, what)


def mean_over_seeds(scenario, tokens_per_s: Callable[[object], float]) -> float:
    """The mean of `tokens_per_s(scenario)` over NUM_SEEDS seeds of the scenario's draws."""
    return statistics.mean(tokens_per_s(replace(scenario, seed=seed)) for seed in range(NUM_SEEDS))


# --- Long context ----------------------------------------------------------------------------


def long_context_predictions(
    result: dict, model: ModelProfile, device: DeviceProfile
) -> list[Prediction]:
    """Both modes of a `bench long-context` result, simulated at its memory budget and link."""
    config, runs = result["config"], result["runs"]
    # The budget's room for KV as the engine had it: the budget less the weights it measured.
    kv_room = config["budget_bytes"] - config["weights_bytes"]
    device = replace(
        device,
        memory_bytes=kv_room + model.weights_bytes(ELEMENT_SIZE),
        host_to_device_bytes_per_s=config["pcie_bandwidth_bytes_per_s"],
    )
    # The budget is the engine's, weights and KV: no reserve beside it.
    scenario = _long_context_scenario(config, runs["vericache"], model, device, reserve=0.0)
    vericache = mean_over_seeds(scenario, partial(_vericache_tokens_per_s, make=StaggeredScheduler))
    full = sim_long_context.simulate_full_kv(scenario).tokens_per_s  # draws no acceptance
    return [
        _long_context_prediction("long-context", "full", runs["full"], full),
        _long_context_prediction("long-context", "vericache", runs["vericache"], vericache),
    ]


def stagger_predictions(
    result: dict, model: ModelProfile, device: DeviceProfile
) -> list[Prediction]:
    """Both schedulings of a `bench stagger` result, simulated over its link (no memory limit),
    each by the scheduler the engine ran with its settings."""
    config, runs = result["config"], result["runs"]
    device = replace(device, host_to_device_bytes_per_s=config["link_bytes_per_s"])
    settings = SchedulerConfig(window=config["window"], load_slack=config["load_slack"])
    schedulers = {
        "lockstep": lambda costs: LockstepScheduler(costs, config["draft_len"], settings),
        "staggered": lambda costs: StaggeredScheduler(costs, settings),
    }
    predictions = []
    for name, make_scheduler in schedulers.items():
        scenario = _long_context_scenario(config, runs[name], model, device)
        predicted = mean_over_seeds(scenario, partial(_vericache_tokens_per_s, make=make_scheduler))
        predictions.append(_long_context_prediction("stagger", name, runs[name], predicted))
    return predictions


def _vericache_tokens_per_s(scenario: LongContextScenario, make) -> float:
    return sim_long_context.simulate_vericache(scenario, make).tokens_per_s


def _long_context_scenario(
    config: dict, run: dict, model: ModelProfile, device: DeviceProfile, reserve: float = 0.1
) -> LongContextScenario:
    label = config["compressor"]
    params = compressor_from_label(label).spec()["params"]
    return LongContextScenario(
        model=model,
        device=device,
        prompt_tokens=round(statistics.mean(config["prompt_tokens"])),
        kv_budget=1 / params["ratio"],
        draft_len=config["draft_len"],
        arrivals=(0.0,) * config["num_requests"],
        output_lengths=OutputLengths((config["max_tokens"],)),
        acceptance=measured_acceptance(run, config["draft_len"], label),
        activation_reserve=reserve,
        element_size=ELEMENT_SIZE,
        compressed_element_size=2 if label.endswith("-bf16") else None,
    )


def _long_context_prediction(benchmark: str, mode: str, run: dict, predicted: float):
    return Prediction(benchmark, mode, run["stats"]["decode_tokens_per_s"], predicted)


# --- The committed H200 runs -----------------------------------------------------------------


def gpu_profile(decode_speed: dict, datasheet: DeviceProfile, model: ModelProfile) -> DeviceProfile:
    """A 135M profile of the H200 from the committed `bench decode-speed` run on it: the
    datasheet's rates, and the overheads that run's steps leave: a forward alone at batch 1 and
    what each row of batch 8 adds, with the fast kernels, and what the batch-invariant kernels
    add to a row. The 135M engine on an H200 is bound by them, not by bandwidth."""
    steps = decode_speed["step_ms"]
    context = decode_speed["context"]["tokens"]
    kv_row = (context + 1) * model.kv_bytes_per_token(ELEMENT_SIZE)
    weights_s = model.weights_bytes(ELEMENT_SIZE) / datasheet.bytes_per_s
    row_s = (steps["full_fast_batch8"] - steps["full_fast"]) / 7 / 1e3
    row_s -= kv_row / datasheet.attention_read_bytes_per_s
    fixed_s = steps["full_fast"] / 1e3 - weights_s - row_s - kv_row / datasheet.bytes_per_s
    return replace(
        datasheet,
        name=f"{datasheet.name}-135m",
        source=f"{datasheet.source}; overheads from the committed decode-speed run on it",
        forward_overhead_s=max(0.0, fixed_s),
        layer_overhead_s=0.0,
        row_overhead_s=max(0.0, row_s) / model.num_layers,
        exact_row_overhead_s=max(0.0, steps["full_invariant"] - steps["full_fast"])
        / 1e3
        / model.num_layers,
    )


def gpu_predictions(results: dict, model: ModelProfile, datasheet: DeviceProfile):
    """The committed long-context and stagger runs on the H200, simulated with `gpu_profile`."""
    device = gpu_profile(results["decode_speed_cuda"], datasheet, model)
    predictions = long_context_predictions(results["long_context_cuda"], model, device)
    predictions += stagger_predictions(results["stagger_cuda"], model, device)
    return [replace(p, benchmark=f"{p.benchmark} (H200)") for p in predictions], device
