"""How calibration times a piece of work on a device."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def median_seconds(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """The median seconds of `fn` over `repeats` runs, after one untimed run (first touches of
    its buffers, a CUDA kernel's first launch)."""
    fn()
    samples = []
    for _ in range(repeats):
        _sync(device)
        started = time.perf_counter()
        fn()
        _sync(device)
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
