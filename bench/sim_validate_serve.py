"""bench serve-stagger's three policies simulated from the run's own record: per-request rounds by
the remote-prefix simulation, lock-step and staggered rounds by the scheduled one with the
scheduler the served run planned with (its settings included). The stream, the verifier's memory
(kept as the served verifier keeps it, sim/residency.py) and its loads come from the result; the
device from the profile. The drafter is across unthrottled loopback on the same machine: its link
moves bytes as fast as a host copy.
"""

from __future__ import annotations

import statistics

from vericache.bench.common import compressor_from_label
from vericache.bench.serve_stagger import POLICIES, Setup, coordinator_config
from vericache.bench.sim_validate_scenarios import (
    ELEMENT_SIZE,
    Prediction,
    mean_over_seeds,
    prompt_suffix_tokens,
    served_acceptance,
    store_bytes_per_s,
)
from vericache.serve.backends.scheduled import scheduler_for
from vericache.sim.profiles import DeviceProfile, ModelProfile
from vericache.sim.remote_prefix_scenario import RemotePrefixScenario
from vericache.sim.remote_prefix_scheduled import simulate_vericache_scheduled
from vericache.sim.scenario import vericache_simulation
from vericache.sim.workload import OutputLengths


def serve_stagger_predictions(
    result: dict, model: ModelProfile, device: DeviceProfile, tokenizer
) -> list[Prediction]:
    """Each policy of a `bench serve-stagger` result, simulated over the whole stream (all its
    requests in flight from the start, as the benchmark times them)."""
    scenario = serve_stagger_scenario(result, model, device, tokenizer)
    spec = Setup(**result["config"])
    predictions = []
    for policy in POLICIES:
        simulate = _simulation(spec, policy)
        predicted = mean_over_seeds(scenario, lambda s, run=simulate: run(s).tokens_per_s)
        measured = result["runs"][policy]["tokens_per_s"]
        predictions.append(Prediction("serve-stagger", policy, measured, predicted))
    return predictions


def _simulation(spec: Setup, policy: str):
    """Per-request rounds as the simulator runs them; scheduled ones planned by the scheduler
    the served coordinator made for the policy (lock-step's loads after the drafting, as served,
    not the overlapping baseline the scenario files name)."""
    if policy == "per-request":
        return vericache_simulation({"scheduling": policy}, spec.draft_len)
    make_scheduler = scheduler_for(coordinator_config(spec, policy))
    return lambda scenario: simulate_vericache_scheduled(scenario, make_scheduler)


def serve_stagger_scenario(
    result: dict, model: ModelProfile, device: DeviceProfile, tokenizer
) -> RemotePrefixScenario:
    config = result["config"]
    params = compressor_from_label(config["compressor"]).spec()["params"]
    token_share = 1 / params["ratio"] if params.get("ratio") else 1.0
    prefix_tokens, compressed_ratio = _prefixes(result, model, token_share)
    num_requests = config["num_requests"]
    return RemotePrefixScenario(
        model=model,
        device=device,
        num_verifiers=1,
        num_drafters=1,
        prefix_tokens=prefix_tokens,
        num_prefixes=config["num_prefixes"],
        suffix_tokens=prompt_suffix_tokens(tokenizer),
        compressed_ratio=compressed_ratio,
        store_bytes_per_s=_load_bytes_per_s(result, device),
        network_bytes_per_s=device.host_to_device_bytes_per_s,
        network_latency_s=0.0,
        draft_len=config["draft_len"],
        arrivals=(0.0,) * num_requests,
        output_lengths=OutputLengths((config["max_tokens"],)),
        # The outputs are the same under every policy: the per-request rounds, each drafting x
        # unless the budget cut it, tell each round's first mismatch (or its mean) for all.
        acceptance=served_acceptance(
            [result["runs"]["per-request"]],
            config["draft_len"],
            config["max_tokens"],
            "serve-stagger, per-request rounds",
        ),
        concurrency=num_requests,
        element_size=ELEMENT_SIZE,
        compressed_token_share=token_share,
        # The verifier keeps `resident_full_kvs` requests' full KV (VerifierConfig.resident_bytes),
        # its scheduler plans within them; its prefixes are the served default's, within the rest.
        verifier_resident_bytes=int(config["resident_full_kvs"] * result["request_full_kv_bytes"]),
        # The drafter's prefix cache (DrafterConfig.kv_cache_bytes; None: the served default,
        # what the device has left). Results without the key were served with 4 GiB.
        drafter_prefix_cache_bytes=result.get("drafter_kv_cache_bytes", 4 << 30),
        prefixes_in_turn=True,
        workers_share_memory=True,  # every worker on this CPU
    )


def _load_bytes_per_s(result: dict, device: DeviceProfile) -> float:
    """A load onto the verifier's device: the store's read, at the rate the unthrottled
    FULL_LOCAL stream measured, then the emulated path at the run's bandwidth, one after the
    other (the verifier's `_load`)."""
    read = store_bytes_per_s([result["full_local"]], device.host_to_device_bytes_per_s)
    path = result["summary"]["load_bandwidth_mb_s"] * 1e6
    return 1 / (1 / read + 1 / path)


def _prefixes(result: dict, model: ModelProfile, token_share: float) -> tuple[int, float]:
    """The prefixes' mean tokens and compressed / full KV bytes, as the run recorded them; a run
    that recorded only its largest prefix's full KV gives its tokens, and the compressor's share
    of the tokens (float32 kept as it is) its ratio."""
    prefixes = result.get("prefixes")
    if not prefixes:
        largest = result["prefix_full_kv_bytes"] // model.kv_bytes_per_token(ELEMENT_SIZE)
        return largest, token_share
    ratio = statistics.mean(p["compressed_kv_bytes"] / p["full_kv_bytes"] for p in prefixes)
    return round(statistics.mean(p["num_tokens"] for p in prefixes)), ratio
