"""`bench remote-prefix`'s cells simulated for sim-validate: each stream as served (its prefixes,
link, budgets, host tiers and the serving work its machine's cores carried), each cell's requests
accepting what they accepted when served, and each role's forwards set beside the served ones."""

from __future__ import annotations

import statistics
from dataclasses import replace

from vericache.bench.common import compressor_from_label
from vericache.bench.remote_prefix_cells import FEW, MANY, Cell
from vericache.bench.sim_validate_scenarios import (
    ELEMENT_SIZE,
    NUM_SEEDS,
    Prediction,
    RoleForwards,
    prompt_suffix_tokens,
    served_acceptance,
    store_bytes_per_s,
)
from vericache.sim.batch_loop import ForwardCount
from vericache.sim.long_context import SimReport
from vericache.sim.profiles import DeviceProfile, ModelProfile
from vericache.sim.remote_prefix import FullPool, simulate_full
from vericache.sim.remote_prefix_auto import simulate_auto
from vericache.sim.remote_prefix_scenario import RemotePrefixScenario
from vericache.sim.scenario import vericache_simulation
from vericache.sim.workload import AcceptanceTrace, OutputLengths

# A CPU's "host tier" is its one memory, which the served worker reads in place: no load.
IN_PLACE_BYTES_PER_S = 1e15


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
                (
                    ForwardCount(
                        s[f"{role}_forwards"],
                        s[f"{role}_forward_rows"],
                        s.get(f"{role}_forward_cpu_s", 0.0),
                    )
                    for s in samples
                ),
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
    return RoleForwards(total.forwards / num_runs, total.mean_batch, total.mean_seconds)


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
        # One copy of a prefix per worker: rows over it read it one after another within a
        # layer, the second and later from the CPU's last-level cache, as cascade attention reads
        # it once (path_costs.py prices the served rows alike).
        shared_prefix_attention=True,
        machine_cores=result.get("environment", {}).get("cpu_count"),
        host_cpu_s_per_forward=host_cpu_s_per_forward(_stream(result, workload)[0]),
        **tier,
    )


def host_cpu_s_per_forward(cells: list[dict]) -> float:
    """The serving work outside forwards per forward, over a stream's serves: the CPU seconds of
    every process of a serve (workers, coordinator, client, the rest) less the workers' forwards',
    over their forwards (0 for runs that did not count them)."""
    serves = [s for c in cells for s in c["samples"] if "verifiers_forward_cpu_s" in s]
    forwards = sum(s["verifiers_forwards"] + s["drafters_forwards"] for s in serves)
    if not forwards:
        return 0.0
    cpu_s = sum(sum(s["cpu_s"].values()) for s in serves)
    forward_cpu_s = sum(s["verifiers_forward_cpu_s"] + s["drafters_forward_cpu_s"] for s in serves)
    return (cpu_s - forward_cpu_s) / forwards


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


def _timed_report(scenario: RemotePrefixScenario, simulate) -> SimReport:
    """The stream as the benchmark times it (the report's `timed_tokens_per_s`, its
    `timed_forwards`): after a first wave of `concurrency` requests served to its end untimed (the
    workers' caches warm, their pipeline empty), the whole stream from its start to its last
    token."""
    wave = scenario.concurrency or 1
    stream = len(scenario.arrivals)
    arrivals = (0.0,) * (wave + stream)
    return simulate(replace(scenario, arrivals=arrivals, warmup_sessions=wave))
