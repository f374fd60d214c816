"""The long-context and stagger benchmarks' plumbing on the tiny model: one engine run per mode or
policy with its statistics and per-iteration metrics, identical outputs, and the plots."""

from __future__ import annotations

import torch

from vericache.bench import long_context, stagger
from vericache.compress import StreamingLLM
from vericache.engine.device_memory import full_kv_bytes
from vericache.engine.long_context_config import LongContextConfig
from vericache.engine.request import DecodeMode, Request, SamplingParams
from vericache.scheduler import SchedulerConfig


def _requests(num: int = 4) -> list[Request]:
    generator = torch.Generator().manual_seed(3)
    requests = []
    for index in range(num):
        ids = torch.randint(3, 512, (400 + 50 * index,), generator=generator).tolist()
        params = SamplingParams(max_new_tokens=20)
        requests.append(
            Request(ids, 390, params, DecodeMode.VERICACHE, StreamingLLM(ratio=4), 6, str(index))
        )
    return requests


def _runs(tiny_engine) -> dict:
    runner = tiny_engine().runner
    requests = _requests()
    common = {"link_bytes_per_s": 50e6, "scheduler": SchedulerConfig(window=96), "max_parked": 4}
    configs = {
        "lockstep": LongContextConfig(lockstep_draft_len=6, **common),
        "staggered": LongContextConfig(**common),
    }
    runs = {name: long_context.run_engine(runner, None, requests, c) for name, c in configs.items()}
    full = LongContextConfig(link_bytes_per_s=50e6)
    full_requests = long_context.with_mode(requests, DecodeMode.FULL)
    runs["full"] = long_context.run_engine(runner, None, full_requests, full)
    return runs


def test_runs_record_statistics_and_decode_the_same_tokens(tiny_engine):
    runs = _runs(tiny_engine)
    assert (
        runs["lockstep"]["token_ids"] == runs["staggered"]["token_ids"] == runs["full"]["token_ids"]
    )
    for name in ("lockstep", "staggered"):
        run = runs[name]
        assert run["stats"]["num_loads"] > 0 and run["stats"]["decode_tokens_per_s"] > 0
        assert run["iterations"]["count"] > 0 and run["iterations"]["mean_draft_batch"] >= 1
        assert run["mean_accepted_per_round"] >= 0
        assert "token_ids" not in long_context.without_tokens(run)
    # Lock-step verifies every request of a round together: all four full KVs at once.
    full_bytes = full_kv_bytes(_requests()[0], tiny_engine().runner.config, 4)
    peaks = {name: runs[name]["stats"]["peak_full_kv_bytes"] for name in ("lockstep", "staggered")}
    assert peaks["lockstep"] == 4 * full_bytes >= peaks["staggered"]
    assert runs["full"]["stats"]["num_loads"] == 0


def test_plots_are_written(tmp_path):
    stats = {"decode_tokens_per_s": 10.0, "max_running": 2, "peak_device_bytes": 2e9}
    config = {
        "num_requests": 4,
        "prompt_tokens": [7000],
        "compressor": "snapkv-4x",
        "draft_len": 30,
        "budget_full_kvs": 4.0,
        "budget_bytes": 2e9,
        "pcie_bandwidth_bytes_per_s": 2e9,
        "weights_bytes": 5e8,
        "load_draft_steps": 3.0,
        "link_bytes_per_s": 9e8,
    }
    long_context.plot(
        {
            "runs": {"full": {"stats": stats}, "vericache": {"stats": stats}},
            "summary": {"vericache_over_full": 1.0},
            "config": config,
        },
        tmp_path / "long_context.png",
    )
    stagger.plot(
        {
            "runs": {"lockstep": {"stats": stats}, "staggered": {"stats": stats}},
            "summary": {"staggered_over_lockstep": 1.0, "peak_memory_ratio": 1.0},
            "config": config,
        },
        tmp_path / "stagger.png",
    )
    assert (tmp_path / "long_context.png").stat().st_size > 0
    assert (tmp_path / "stagger.png").stat().st_size > 0
