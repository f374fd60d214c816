"""Start-up measurements behind the long-context scheduler's cost model: one iteration's time and
the host-to-device bandwidth, each a first estimate that the scheduler refines as it runs."""

from __future__ import annotations

import statistics
import time

import torch

from vericache.engine.device_memory import DeviceMemory
from vericache.engine.forward_loop import greedy
from vericache.engine.long_context_config import LongContextConfig
from vericache.model.runner import ModelRunner, SequenceInput
from vericache.scheduler import CostModel


def calibrated_costs(
    runner: ModelRunner, memory: DeviceMemory, long_context: LongContextConfig
) -> CostModel:
    """The configured estimates, with what is not configured measured now."""
    return CostModel(
        iteration_s=long_context.iteration_s or time_draft_step(runner),
        link_bytes_per_s=long_context.link_bytes_per_s or measure_link_bandwidth(runner.device),
        memory_budget_bytes=memory.budget_bytes,
        weights_bytes=memory.weights_bytes,
    )


def time_draft_step(runner: ModelRunner) -> float:
    """A one-token forward over a short cache: a floor for the iteration time."""
    cache = runner.new_cache(capacity=4)
    token = torch.tensor([0], dtype=torch.long)
    samples = []
    for _ in range(3):
        start = time.perf_counter()
        greedy(runner.forward([SequenceInput(token, cache)]))
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def measure_link_bandwidth(device: torch.device | str, num_bytes: int = 32 << 20) -> float:
    """Bytes per second of one host -> device copy of `num_bytes` (pinned on CUDA)."""
    device = torch.device(device)
    is_cuda = device.type == "cuda"
    source = torch.ones(num_bytes, dtype=torch.uint8, pin_memory=is_cuda)
    target = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    target.copy_(source)  # warm-up
    start = time.perf_counter()
    target.copy_(source)
    if is_cuda:
        torch.cuda.synchronize(device)
    return num_bytes / max(time.perf_counter() - start, 1e-9)
