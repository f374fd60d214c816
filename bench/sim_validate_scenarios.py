"""The simulator's scenarios for workloads a CPU benchmark has just served for real: every setting
read from the benchmark's own result (its stream, link, memory and acceptance), the device's from
the profile calibrated in the same run. No constant is fitted to the measured throughput."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial

from vericache.bench.common import compressor_from_label
from vericache.bench.remote_prefix_cells import FEW, MANY, Cell
from vericache.bench.workloads import CONTEXT_PROMPTS
from vericache.engine.prompt import build_chat_prompt
from vericache.scheduler import LockstepScheduler, SchedulerConfig, StaggeredScheduler
from vericache.sim import long_context as sim_long_context
from vericache.sim.batch_loop import ForwardCount
from vericache.sim.long_context import LongContextScenario, SimReport
from vericache.sim.profiles import DeviceProfile, ModelProfile
from vericache.sim.remote_prefix import FullPool, simulate_full
from vericache.sim.remote_prefix_auto import simulate_auto
from vericache.sim.remote_prefix_scenario import RemotePrefixScenario
from vericache.sim.scenario import vericache_simulation
from vericache.sim.workload import (
    AcceptanceTrace,
    OutputLengths,
    rate_for_mean_accepted,
    trace_from_rounds,
)

ELEMENT_SIZE = 4  # the CPU benchmarks run the model in float32
# A CPU's "host tier" is its one memory, which the served worker reads in place: no load.
IN_PLACE_BYTES_PER_S = 1e15
# A quick run has few rounds, so one simulation's acceptance draws scatter its tokens/s by tens of
# percent: a prediction is the mean over this many seeds.
NUM_SEEDS = 5


@dataclass(frozen=True)
class RoleForwards:
    """A role's forwards over a timed stream (the mean over serves, or over seeds) and the mean
    jobs each held: where a served and a simulated stream part, whether in how many forwards the
    workers ran or in what each cost."""

    forwards: float
    mean_batch: float


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


# --- Remote prefix ---------------------------------------------------------------------------


def remote_prefix_predictions(
    result: dict, model: ModelProfile, device: DeviceProfile, tokenizer
) -> list[Prediction]:
    """Each cell of a `bench remote-prefix` result, simulated, in both of its streams."""
    bases = {FEW: _remote_prefix_base(result, model, device, tokenizer, FEW)}
    if result.get("many_prefixes"):
        bases[MANY] = _remote_prefix_base(result, model, device, tokenizer, MANY)
    by_name = {cell["name"]: cell for cell in result["cells"]}
    config = result["config"]
    rates = {}
    predictions = []
    for cell in result["cells"]:  # FULL_LOCAL and FULL_REMOTE come before FULL_BOTH
        workload = cell.get("workload", FEW)
        scenario = replace(
            bases[workload],
            num_drafters=cell["num_drafters"],
            draft_len=cell["draft_len"] or 30,
            network_latency_s=cell["latency_s"],
            acceptance=_cell_acceptance(cell, by_name, config["max_tokens"]),
            accepted_by_session=_rounds_by_session(cell, by_name, config["concurrency"]),
        )
        simulate = _simulation(cell, rates)
        reports = [
            _timed_report(replace(scenario, seed=seed), simulate) for seed in range(NUM_SEEDS)
        ]
        predicted = statistics.mean(report.timed_tokens_per_s for report in reports)
        if cell["mode"] in ("full_local", "full_remote"):
            rates[(workload, cell["mode"], cell["num_drafters"])] = predicted
        predictions.append(
            Prediction(
                "remote-prefix",
                cell["name"],
                expected_tokens_per_s(cell),
                predicted,
                served_forwards(cell["samples"]),
                simulated_forwards(reports),
            )
        )
    return predictions


def served_forwards(samples: list[dict]) -> dict[str, RoleForwards]:
    """Per role, the mean over serves of the forwards its workers' batch loops ran in the timed
    stream, and the jobs each held (runs before the benchmark counted them: none)."""
    counted = {}
    for role in ("verifiers", "drafters"):
        if f"{role}_forwards" in samples[0]:
            total = sum(
                (ForwardCount(s[f"{role}_forwards"], s[f"{role}_forward_rows"]) for s in samples),
                ForwardCount(),
            )
            counted[role] = _per_run(total, len(samples))
    return counted


def simulated_forwards(reports: list[SimReport]) -> dict[str, RoleForwards]:
    """Per role, the mean over the simulations' seeds of their timed forwards and jobs held."""
    return {
        role: _per_run(
            sum((report.timed_forwards[role] for report in reports), ForwardCount()), len(reports)
        )
        for role in reports[0].timed_forwards
    }


def _per_run(total: ForwardCount, num_runs: int) -> RoleForwards:
    return RoleForwards(total.forwards / num_runs, total.mean_batch)


def expected_tokens_per_s(cell: dict) -> float:
    """The tokens/s to expect of a cell: the mean of its serves. Serves can differ by a race, not
    by noise alone: in FULL_BOTH, whether the prefix a request brings to the remote drafter is the
    one its prefix cache holds (26 tokens/s) or one it fetches over the slow link (19), as the two
    pools finish in one order or the other. The cell's median reports one side of the race."""
    return statistics.mean(s["tokens_per_s"] for s in cell["samples"])


def _remote_prefix_base(
    result: dict, model, device, tokenizer, workload: str
) -> RemotePrefixScenario:
    """The stream `workload` as served. The many-prefix one had a host tier on every drafter,
    whose nodes turned warm; on a CPU the tier is the device's own memory, read in place, so its
    loads to the device cost nothing."""
    config = result["config"]
    full_local = next(c for c in _stream(result, workload)[0] if c["mode"] == "full_local")
    samples = full_local["samples"]
    params = compressor_from_label(config["compressor"]).spec()["params"]
    # The drafter's prefix cache as served (DrafterConfig.kv_cache_bytes); the verifier's was the
    # served default, what the device has left: its KV room.
    if workload == FEW:
        prefixes, num_requests = result["prefixes"], config["num_requests"]
        tier = {"drafter_prefix_cache_bytes": result["drafter_kv_cache_bytes"]}
    else:
        prefixes, num_requests = result["many_prefixes"], config["many_requests"]
        budgets = result["many_prefix_budgets"]
        tier = {
            "drafter_prefix_cache_bytes": budgets["drafter_kv_bytes"],
            "host_tier_bytes": budgets["host_tier_bytes"],
            "warm_nodes": True,
        }
        device = replace(device, host_to_device_bytes_per_s=IN_PLACE_BYTES_PER_S)
    num_tokens = statistics.mean(s["num_tokens"] for s in samples) / num_requests
    ratio = statistics.mean(p["compressed_wire_bytes"] / p["full_wire_bytes"] for p in prefixes)
    return RemotePrefixScenario(
        model=model,
        device=device,
        num_verifiers=1,
        num_drafters=1,
        prefix_tokens=round(statistics.mean(p["num_tokens"] for p in prefixes)),
        num_prefixes=len(prefixes),
        suffix_tokens=prompt_suffix_tokens(tokenizer),
        compressed_ratio=ratio,
        store_bytes_per_s=store_bytes_per_s(samples, device.host_to_device_bytes_per_s),
        network_bytes_per_s=network_bytes_per_s(result, workload),
        network_latency_s=0.0,
        draft_len=30,
        arrivals=(0.0,) * num_requests,
        output_lengths=OutputLengths((max(1, round(num_tokens)),)),
        acceptance=AcceptanceTrace("unset", (0,)),
        concurrency=config["concurrency"],
        element_size=ELEMENT_SIZE,
        compressed_token_share=1 / params["ratio"] if params.get("ratio") else 1.0,
        prefixes_in_turn=True,
        network_receive_bytes_per_s=receive_bytes_per_s(result),
        workers_share_memory=True,  # every worker on this CPU
        **tier,
    )


def store_bytes_per_s(records: list[dict], default: float) -> float:
    """The verifier's loads from its store, as served streams measured them (`default` where
    they waited for none)."""
    store_s = sum(r["store_wait_s"] for r in records)
    return sum(r["store_bytes"] for r in records) / store_s if store_s > 0 else default


def network_bytes_per_s(result: dict, workload: str) -> float:
    """The slow link as a fetch of full KV crosses it, in the simulator's bytes (the KV's): the
    wire carries the codec's bytes, and the sender encodes each piece before the link paces it
    (ThrottledLink books a piece once it is encoded), so a wire byte takes 1 / bandwidth + 1 / the
    sender's encoding rate: its CPU in FULL_REMOTE, where serving KV is all it does, per byte."""
    serves, kv_per_wire = _full_remote(result, workload)
    wire_s = 1 / result["bandwidth_bytes_per_s"]
    sent = sum(s["link_bytes"] for s in serves)
    if sent > 0:
        wire_s += sum(s["cpu_s"]["verifiers"] for s in serves) / sent
    return kv_per_wire / wire_s


def receive_bytes_per_s(result: dict) -> float | None:
    """How fast a drafter takes in a prefix whose last piece has arrived (the codec's last pieces
    decoded and checked, its cache built), in KV bytes/s: its FULL_REMOTE requests' waits for
    their fetches beyond the link's time for the bytes (`network_bytes_per_s`), per KV byte. A
    wait behind another fetch on the link only lengthens them, so each stream bounds the rate
    from below: the highest bound. None where no stream shows such a wait."""
    bounds = []
    for workload in (FEW, MANY):
        serves, kv_per_wire = _full_remote(result, workload)
        fetched = kv_per_wire * sum(s["link_bytes"] for s in serves)
        if fetched == 0:
            continue
        on_link_s = fetched / network_bytes_per_s(result, workload)
        tail_s = sum(s.get("link_wait_s", 0.0) for s in serves) - on_link_s
        if tail_s > 0:
            bounds.append(fetched / tail_s)
    return max(bounds, default=None)


def _stream(result: dict, workload: str) -> tuple[list[dict], list[dict]]:
    """A stream's cells and prefixes."""
    cells = [c for c in result["cells"] if c.get("workload", FEW) == workload]
    return cells, result["prefixes"] if workload == FEW else result.get("many_prefixes", [])


def _full_remote(result: dict, workload: str) -> tuple[list[dict], float]:
    """A stream's FULL_REMOTE serves, and its prefixes' full KV bytes per byte on the wire (1
    where the run did not record their KV's bytes)."""
    cells, prefixes = _stream(result, workload)
    serves = [s for c in cells if c["mode"] == "full_remote" for s in c["samples"]]
    if not prefixes or any("full_kv_bytes" not in p for p in prefixes):
        return serves, 1.0
    return serves, statistics.mean(p["full_kv_bytes"] / p["full_wire_bytes"] for p in prefixes)


def prompt_suffix_tokens(tokenizer) -> int:
    """The prompt's tokens after its prefix: the chat template's turn and a question."""
    lengths = []
    for prompt in CONTEXT_PROMPTS:
        ids = build_chat_prompt(tokenizer, "context", prompt)
        lengths.append(len(ids.token_ids) - ids.num_prefix_tokens)
    return round(statistics.mean(lengths))


def _cell_acceptance(cell: dict, by_name: dict[str, dict], max_tokens: int) -> AcceptanceTrace:
    """A VERICACHE cell's own rounds; an AUTO cell's VERICACHE twin's."""
    cell = _vericache_twin(cell, by_name)
    if cell["mode"] != "vericache":
        return AcceptanceTrace("full-KV decoding drafts nothing", (0,))
    return served_acceptance(cell["samples"], cell["draft_len"], max_tokens, cell["name"])


def _rounds_by_session(cell: dict, by_name: dict[str, dict], wave: int) -> tuple:
    """The accepted drafts of each round of each request as a VERICACHE cell (an AUTO cell's
    twin) served them, most of its serves alike (greedy requests accept the same in each), the
    untimed first wave's (the stream's first `wave` requests, once more) before the stream's;
    none where it recorded none."""
    cell = _vericache_twin(cell, by_name)
    served = [s.get("accepted_per_round_by_request") for s in cell["samples"]]
    if cell["mode"] != "vericache" or not all(served):
        return ()
    by_request = max(served, key=served.count)
    return tuple(tuple(rounds) for rounds in by_request[:wave] + by_request)


def _vericache_twin(cell: dict, by_name: dict[str, dict]) -> dict:
    """An AUTO cell's VERICACHE twin (same stream, draft length and drafters), whose acceptance
    the requests it sends that way have; any other cell itself."""
    if cell["mode"] != "auto":
        return cell
    twin = Cell("vericache", cell["num_drafters"], cell["draft_len"], workload=cell["workload"])
    return by_name[twin.name]


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


def _simulation(cell: dict, rates: dict):
    """How the cell's configuration is simulated: its scheduling, AUTO's choice per request, or
    its full-KV pool (FULL_BOTH routed by the rates the pools' own simulations gave, as the
    benchmark routes by measured ones)."""
    if cell["mode"] == "vericache":
        return vericache_simulation({"scheduling": cell["scheduling"]}, cell["draft_len"])
    if cell["mode"] == "auto":
        return simulate_auto
    if cell["mode"] == "full_both":
        workload = cell.get("workload", FEW)
        pools = {
            FullPool.LOCAL: rates[(workload, "full_local", 1)],
            FullPool.REMOTE: rates[(workload, "full_remote", cell["num_drafters"])],
        }
        return lambda scenario: simulate_full(scenario, FullPool.BOTH, pools)
    pool = FullPool.LOCAL if cell["mode"] == "full_local" else FullPool.REMOTE
    return lambda scenario: simulate_full(scenario, pool)


def mean_over_seeds(scenario, tokens_per_s: Callable[[object], float]) -> float:
    """The mean of `tokens_per_s(scenario)` over NUM_SEEDS seeds of the scenario's draws."""
    return statistics.mean(tokens_per_s(replace(scenario, seed=seed)) for seed in range(NUM_SEEDS))


def _timed_report(scenario: RemotePrefixScenario, simulate) -> SimReport:
    """The stream as the benchmark times it (the report's `timed_tokens_per_s`, its
    `timed_forwards`): after a first wave of `concurrency` requests served to its end untimed (the
    workers' caches warm, their pipeline empty), the whole stream from its start to its last
    token."""
    wave = scenario.concurrency or 1
    stream = len(scenario.arrivals)
    arrivals = (0.0,) * (wave + stream)
    return simulate(replace(scenario, arrivals=arrivals, warmup_sessions=wave))


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
