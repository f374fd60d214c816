"""A `bench remote-prefix` result and a CPU profile, as the sim-validate tests simulate them."""

from __future__ import annotations

from vericache.sim.profiles import DeviceProfile, model_profile

MODEL = model_profile("smollm2-135m")
CPU = DeviceProfile(
    name="cpu", source="a 2-core CPU, as calibrated", memory_bytes=24 << 30,
    hbm_bytes_per_s=20e9, peak_flops=1.6e11, host_to_device_bytes_per_s=18e9,
    interconnect_bytes_per_s=18e9, bandwidth_efficiency=1.0, compute_efficiency=1.0,
    forward_overhead_s=6e-4, layer_overhead_s=6e-4, allreduce_latency_s=0.0,
    attention_bytes_per_s=9e9, attention_flops=7e10,
)  # fmt: skip


def served_sample(mode: str, tokens_per_s: float, accepted: float | None = None) -> dict:
    # FULL_REMOTE fetches 120 MB over the 30 MB/s link, which the verifier encodes at 240 MB/s:
    # 4.5 s on the wire, and its requests waited 0.5 s more for the drafter to take it in.
    cpu = {"full_local": (0.0, 3.0), "full_remote": (5.0, 0.5)}.get(mode, (3.0, 2.0))
    return {
        "tokens_per_s": tokens_per_s, "num_tokens": 4 * 32, "mean_accepted_per_round": accepted,
        "store_bytes": 40_000_000 if mode == "full_local" else 0,
        "store_wait_s": 0.04 if mode == "full_local" else 0.0,
        "link_bytes": 120_000_000 if mode == "full_remote" else 0,
        "link_wait_s": 5.0 if mode == "full_remote" else 0.0,
        "cpu_s": {"drafters": cpu[0], "verifiers": cpu[1]},
    }  # fmt: skip


def served_cell(
    mode: str, tokens_per_s: float, draft_len=None, accepted=None, latency_s=0.0
) -> dict:
    name = mode if draft_len is None else f"{mode} x={draft_len} rtt={latency_s}"
    return {
        "mode": mode, "num_drafters": 1, "draft_len": draft_len, "scheduling": "per-request",
        "latency_s": latency_s, "name": name, "tokens_per_s": tokens_per_s,
        "samples": [served_sample(mode, tokens_per_s, accepted)],
    }  # fmt: skip


REMOTE_PREFIX = {
    "config": {"compressor": "snapkv-4x-bf16", "num_prefixes": 2, "num_requests": 4,
               "max_tokens": 32, "concurrency": 2},
    "prefixes": [
        {"num_tokens": 1200, "compressed_wire_bytes": 7_000_000, "full_wire_bytes": 55_000_000,
         "full_kv_bytes": 55_296_000},
        {"num_tokens": 1400, "compressed_wire_bytes": 8_000_000, "full_wire_bytes": 64_000_000,
         "full_kv_bytes": 64_512_000},
    ],
    "bandwidth_bytes_per_s": 30e6,
    "drafter_kv_cache_bytes": 90_000_000,
    "cells": [
        served_cell("full_local", 40.0), served_cell("full_remote", 30.0),
        served_cell("full_both", 45.0),
        served_cell("vericache", 50.0, 8, 5.0), served_cell("vericache", 40.0, 30, 12.0),
        served_cell("vericache", 38.0, 30, 12.0, latency_s=0.02),
    ],
}  # fmt: skip
