"""Small simulator scenarios that several suites share."""

from __future__ import annotations

import dataclasses

from vericache.sim.profiles import device_profile, model_profile
from vericache.sim.remote_prefix_scenario import RemotePrefixScenario
from vericache.sim.workload import AcceptanceTrace, OutputLengths, rate_for_mean_accepted

TRACE_19_OF_30 = AcceptanceTrace.from_rate(
    rate_for_mean_accepted(19.0, 30), "test: 19 of 30", seed=2
)


def remote_prefix_scenario(**changes) -> RemotePrefixScenario:
    """Qwen2.5-32B on H200s: 1 verifier, 4 drafters, 8 prefixes of 16k tokens, x = 40 (each
    worker holds about 14 of the prefixes' full KVs beside the weights)."""
    scenario = RemotePrefixScenario(
        model=model_profile("qwen2.5-32b"), device=device_profile("h200"),
        num_verifiers=1, num_drafters=4, prefix_tokens=16384, num_prefixes=8, suffix_tokens=64,
        compressed_ratio=0.27, store_bytes_per_s=40e9, network_bytes_per_s=1.2e9,
        network_latency_s=0.01, draft_len=40, arrivals=(0.0,) * 32,
        output_lengths=OutputLengths((64, 256)), acceptance=TRACE_19_OF_30, seed=3,
    )  # fmt: skip
    return dataclasses.replace(scenario, **changes)
