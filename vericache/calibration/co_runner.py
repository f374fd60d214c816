"""How much slower a forward runs while another worker's forwards run on the same machine: the
part of `vericache calibrate` that a profile's `co_runner_slowdown` comes from.

Workers on one CPU machine share its memory system (DRAM bandwidth, last-level cache), and a
decode step streams every weight from it: two workers side by side each run slower than one
alone, however many cores they have. The cost model prices a worker's forwards at this slowdown
per busy worker beside it (path_costs.py), so that `mode: auto` sees that a second CPU worker on
the same machine adds less than a second device. Each GPU has its memory of its own: there the
slowdown is 1, and it is not measured.

The measurement: a decode step of the model's slice (batch 1, over `context` tokens of KV) timed
alone, then again while a second process (spawned, its own random weights of the same shapes, on
as many torch threads) runs the same steps without pause; the ratio of the two medians.
"""

from __future__ import annotations

import multiprocessing

import torch

from vericache.calibration.random_weights import filled_cache, random_runner
from vericache.calibration.timing import median_seconds
from vericache.engine.forward_loop import ForwardLoop, Job
from vericache.sim.profiles import ModelProfile

CPU = torch.device("cpu")
READY_TIMEOUT_S = 600.0  # the co-runner builds a model's slice of random weights first


def co_runner_slowdown(
    model: ModelProfile, num_layers: int, context: int, repeats: int, dtype=torch.float32
) -> dict:
    """A CPU decode step's median seconds alone and beside a co-runner, and their ratio (at
    least 1: a co-runner that costs nothing measures as 1)."""
    step = _decode_step(model, num_layers, context, dtype)
    alone = median_seconds(step, CPU, repeats)
    spawn = multiprocessing.get_context("spawn")
    ready, stop = spawn.Event(), spawn.Event()
    args = (model, num_layers, context, dtype, torch.get_num_threads(), ready, stop)
    co_runner = spawn.Process(target=_run_until_stopped, args=args, daemon=True)
    co_runner.start()
    try:
        if not ready.wait(READY_TIMEOUT_S):
            raise TimeoutError("the co-runner process did not start its forwards")
        beside = median_seconds(step, CPU, repeats)
    finally:
        stop.set()
        co_runner.join(timeout=60)
        if co_runner.is_alive():
            co_runner.kill()
    return {
        "context": context,
        "num_layers": num_layers,
        "alone_s": alone,
        "beside_s": beside,
        "slowdown": max(1.0, beside / alone),
    }


def _decode_step(model: ModelProfile, num_layers: int, context: int, dtype):
    """One decode step over a filled cache, on the fast kernels (as a draft or a plain decode)."""
    runner = random_runner(model, num_layers, CPU, dtype)
    loop, cache = ForwardLoop(runner), filled_cache(runner, context, room=1)

    def step() -> None:
        loop.step([Job(cache, [1], num_logits=1)])
        cache.truncate(context)

    return step


def _run_until_stopped(model, num_layers, context, dtype, num_threads, ready, stop) -> None:
    torch.set_num_threads(num_threads)
    step = _decode_step(model, num_layers, context, dtype)
    step()
    ready.set()
    while not stop.is_set():
        step()
