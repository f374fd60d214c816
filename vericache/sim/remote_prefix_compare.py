"""Pipeline 2 held to two baselines, on one scenario's workers and workload.

- The paper's baseline: full-KV decoding on the remote GPUs (FULL_REMOTE), every request (every
  turn of a session) moving its prefix's full KV over the slow network and prefilling all of its
  prompt after it: no prefix caching, no host tier, no recomputing, no shared-prefix attention.
- The strongest full-KV baseline: the best of FULL_LOCAL, FULL_REMOTE and FULL_BOTH given all a
  well-run full-KV deployment has: prefix caching with VeriCache's placement (warm nodes first),
  which keeps a finished turn's KV for its session's next turn as vLLM's and SGLang's do
  (remote_prefix_full.py), a host tier on every node (the scenario's `host_tier_bytes`),
  shared-prefix attention, and recomputing a prefix where its prefill beats its fetch; each pool
  also runs without recomputing, since a prefill's forwards slow the decodes they share the
  device with, which the rule does not weigh, and the better of the two stands. Beside the pools,
  FULL_ROUTED: the same deployment with `mode: auto`'s router limited to the full-KV paths, each
  request sent where the cost model and the workers' load say it finishes first (a KV-aware
  router's choice), so that `auto` is held to a full-KV deployment placed as well as itself.
Against them, with the same grants: VeriCache as served (per-request rounds, warm drafter nodes),
VeriCache without warm nodes (every verification central), and `mode: auto` (each request's path
chosen), whose verifiers keep a finished session's KV for its next turn, as its drafters do of
their full-KV turns (not their VeriCache sessions'), on their devices and spilled into the host
tier, loaded back over PCIe, as the baseline's are and as served with `--turn-host-bytes`
(turn_kv.py).
Each run says what binds it (remote_prefix_workers.binding).
"""

from __future__ import annotations

import dataclasses

from vericache.errors import InvalidRequestError
from vericache.sim.long_context import SimReport
from vericache.sim.remote_prefix import simulate_vericache
from vericache.sim.remote_prefix_auto import simulate_auto
from vericache.sim.remote_prefix_full import FullPool, simulate_full, simulate_pools
from vericache.sim.remote_prefix_scenario import RemotePrefixScenario
from vericache.sim.remote_prefix_workers import sessions

FULL_POOLS = tuple(pool.value for pool in FullPool)
FULL_ROUTED = "full_routed"  # `mode: auto`'s choice among the full-KV paths alone
NO_RECOMPUTE = "_without_recompute"  # a pool's run name with this suffix: it fetches every prefix


def paper_baseline_scenario(scenario: RemotePrefixScenario) -> RemotePrefixScenario:
    return dataclasses.replace(
        scenario, prefix_caching=False, host_tier_bytes=None, recompute_prefixes=False,
        shared_prefix_attention=False, warm_nodes=False,
    )  # fmt: skip


def strongest_scenario(scenario: RemotePrefixScenario) -> RemotePrefixScenario:
    """All a well-run deployment has; VeriCache as served adds its warm nodes to it."""
    if scenario.host_tier_bytes is None:
        raise InvalidRequestError("the strongest baseline needs the scenario's host_tier_bytes")
    return dataclasses.replace(
        scenario, prefix_caching=True, recompute_prefixes=True, shared_prefix_attention=True,
        warm_nodes=False,
    )  # fmt: skip


def compare_deployments(scenario: RemotePrefixScenario) -> dict[str, SimReport | str | float]:
    """Every run by name, the strongest full-KV pool's name, and the speedups of VeriCache (as
    served, with warm nodes) and of `auto` over each baseline."""
    strong = strongest_scenario(scenario)
    served = dataclasses.replace(strong, warm_nodes=True)
    runs: dict[str, SimReport] = {
        "paper_baseline": simulate_full(paper_baseline_scenario(scenario), FullPool.REMOTE),
    }
    fetching = dataclasses.replace(strong, recompute_prefixes=False)
    for suffix, deployment in (("", strong), (NO_RECOMPUTE, fetching)):
        for pool, report in simulate_pools(deployment).items():
            runs[f"{pool.value}{suffix}"] = report
    runs[FULL_ROUTED] = simulate_auto(strong, full_kv_only=True)
    runs["vericache_central"] = simulate_vericache(strong)
    runs["vericache"] = simulate_vericache(served)
    runs["auto"] = simulate_auto(served)
    candidates = [f"{pool}{suffix}" for pool in FULL_POOLS for suffix in ("", NO_RECOMPUTE)]
    candidates.append(FULL_ROUTED)
    strongest = max(candidates, key=lambda name: runs[name].tokens_per_s)
    paper_rate, strongest_rate = runs["paper_baseline"].tokens_per_s, runs[strongest].tokens_per_s
    return {
        "runs": runs,
        "strongest": strongest,
        "vericache_vs_paper_baseline": runs["vericache"].tokens_per_s / paper_rate,
        "vericache_vs_strongest": runs["vericache"].tokens_per_s / strongest_rate,
        "auto_vs_paper_baseline": runs["auto"].tokens_per_s / paper_rate,
        "auto_vs_strongest": runs["auto"].tokens_per_s / strongest_rate,
        "arrival_bound_tokens_per_s": arrival_bound_tokens_per_s(scenario),
    }


def arrival_bound_tokens_per_s(scenario: RemotePrefixScenario) -> float | None:
    """The most tokens/s any deployment serves where sessions arrive at set times: each session
    ends no sooner than its arrival and its tokens decoded alone, one step each at the shortest
    context, its KV in place. Where that last end decides the run, configurations within a few
    percent of it differ in their last sessions, not in their rate. None for a closed loop."""
    if scenario.concurrency is not None:
        return None
    step_s = scenario.forward_s([scenario.row(1, scenario.suffix_tokens, compressed=False)])
    drawn = sessions(scenario)
    end_s = max(arrival + sum(lengths) * step_s for arrival, _, lengths in drawn)
    return sum(sum(lengths) for _, _, lengths in drawn) / end_s
