"""`vericache calibrate`: a device profile measured on the device, for the simulator.

It needs torch, which the simulator does not: vericache/sim reads only the JSON it writes. It
builds random weights of the named architecture on the device (the whole model, or a slice of its
layers where the whole does not fit) and times:
- a layer's products through the engine's linear kernel at 1 to 512 rows;
- host-to-device copies (pinned on CUDA; a copy between buffers on CPU), alone and beside compute;
- whole forwards through the engine's forward loop, in two slices of different depth: decode
  steps at several contexts and batches, on both kernel sets, and verifications of x+1 tokens;
- on a CPU, a decode step beside a second process running the same (co_runner.py).
calibration_fit.py fits the profile to them. Every forward is then predicted with the fitted
profile beside its measurement, so the JSON shows how well the cost model fits the device it was
measured on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import os
from dataclasses import dataclass

import torch

from vericache.calibration.co_runner import co_runner_slowdown
from vericache.calibration.random_weights import filled_cache, random_layer, random_runner
from vericache.calibration.timing import median_seconds
from vericache.engine.forward_loop import ForwardLoop, Job
from vericache.errors import InvalidRequestError
from vericache.sim.calibration_fit import refit
from vericache.sim.profiles import DeviceProfile, ModelProfile

log = logging.getLogger(__name__)

MAX_WEIGHT_COPIES = 64  # of a layer: enough for a real model's to stream; tiny ones stay fast


@dataclass(frozen=True)
class CalibrationPlan:
    """What to time. `for_device` gives the defaults (minutes); tests use tiny plans."""

    num_layers: int  # the deeper slice's layers (the whole model where it fits)
    product_rows: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
    contexts: tuple[int, ...] = (4096, 16384)
    batches: tuple[int, ...] = (1, 8)
    verify_tokens: tuple[int, ...] = (26, 31, 41)  # x + 1
    copy_bytes: int = 256 << 20
    stream_bytes: int = 512 << 20  # weights the products read: well past any cache
    repeats: int = 5

    def __post_init__(self):
        if 1 not in self.product_rows or min(self.product_rows) < 1:
            raise InvalidRequestError("products are timed at 1 row (bandwidth) and more")
        counts = (self.num_layers, self.repeats, self.copy_bytes, *self.contexts, *self.batches)
        if min(counts) < 1 or not self.contexts or not self.batches:
            raise InvalidRequestError(f"a calibration plan needs positive sizes: {self}")
        if self.num_layers < 2:
            raise InvalidRequestError("overhead per layer is fitted from slices of 2+ layers")

    @classmethod
    def for_device(cls, device: torch.device, model: ModelProfile) -> CalibrationPlan:
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            layers = _layers_that_fit(model, free * 0.6, bytes_per_param=2)
            return cls(
                layers, contexts=(4096, 16384, 65536), batches=(1, 8, 32), copy_bytes=1 << 30
            )
        # float32, and the CPU linear kernel keeps a second, packed copy of every weight.
        layers = _layers_that_fit(model, _memory_bytes(device) * 0.25, bytes_per_param=8)
        # A shared CPU's timings scatter: the median of nine.
        return cls(layers, contexts=(1024, 4096), batches=(1, 4), repeats=9)


def calibrate(
    model: ModelProfile,
    device: torch.device,
    plan: CalibrationPlan,
    base: DeviceProfile | None = None,
) -> dict:
    """The measured profile, its measurements, and each measured forward beside the profile's
    prediction. What one device cannot measure (the interconnect of a tensor-parallel group and
    its all-reduce latency) comes from `base` (a datasheet profile) and the source says so;
    without one, the interconnect is taken to be as fast as a host copy."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    products = _products(model, device, dtype, plan)
    log.info("products timed at %s rows", ",".join(map(str, plan.product_rows)))
    copies = _copies(device, plan)
    log.info("host copies: %.1f GB/s", copies["alone_bytes_per_s"] / 1e9)
    deep, shallow = plan.num_layers, max(1, plan.num_layers // 2)
    forwards = _forwards(model, deep, device, dtype, plan)
    _release(device)  # the deeper slice's weights, before the shallower one's are built
    forwards += _forwards(model, shallow, device, dtype, plan)
    _release(device)
    co_runner = None
    if device.type == "cpu":  # each GPU has its memory of its own: nothing to share
        co_runner = co_runner_slowdown(model, deep, plan.contexts[0], plan.repeats, dtype)
        log.info("beside a co-runner: %.2fx slower", co_runner["slowdown"])
    unmeasured = f"from {base.source}" if base else "taken as fast as a host copy"
    start = DeviceProfile(
        name=f"{base.name}-measured" if base else device.type,
        source=f"measured by vericache calibrate on {_device_name(device)}; the interconnect and "
        f"all-reduce latency, which one device cannot measure: {unmeasured}",
        memory_bytes=_memory_bytes(device),
        hbm_bytes_per_s=1.0,  # fitted by refit below, as every rate and overhead
        peak_flops=1.0,
        host_to_device_bytes_per_s=copies["alone_bytes_per_s"],
        interconnect_bytes_per_s=(
            base.interconnect_bytes_per_s if base else copies["alone_bytes_per_s"]
        ),
        bandwidth_efficiency=1.0,
        compute_efficiency=1.0,
        forward_overhead_s=0.0,
        layer_overhead_s=0.0,
        allreduce_latency_s=base.allreduce_latency_s if base else 0.0,
        co_runner_slowdown=co_runner["slowdown"] if co_runner else 1.0,
    )
    measured = {
        "profile": dataclasses.asdict(start),
        "model": model.name,
        "dtype": str(dtype).removeprefix("torch."),
        "plan": dataclasses.asdict(plan),
        "products": products,
        "copies": copies,
        "forwards": forwards,
        "co_runner": co_runner,
    }
    return refit(measured, model)  # every rate and overhead fitted, every forward predicted


# --- Measurements ---------------------------------------------------------------------------------


def _products(model: ModelProfile, device, dtype, plan: CalibrationPlan) -> list[dict]:
    """A layer's products (QKV, output, gate-up and down projections, as the engine runs them) at
    each row count, over enough distinct copies of the layer that they stream from memory, not
    from a cache, as a forward's weights do."""
    layer_bytes = model.params_per_layer() * torch.finfo(dtype).bits // 8
    copies = min(MAX_WEIGHT_COPIES, max(1, -(-plan.stream_bytes // layer_bytes)))
    layers = [random_layer(model, device, dtype) for _ in range(copies)]
    products = [(layer.qkv, layer.o_proj, layer.gate_up, layer.down) for layer in layers]
    weights = [linear.weight for linear in products[0]]
    out = []
    for rows in plan.product_rows:
        # One input per product's input width: [rows, in]
        inputs = [torch.randn(rows, w.shape[1], device=device).to(dtype) for w in weights]

        def run(inputs=inputs):
            for layer in products:
                for linear, x in zip(layer, inputs):
                    linear(x)

        seconds = median_seconds(run, device, plan.repeats)
        out.append(
            {
                "rows": rows,
                "seconds": seconds,
                "flops": 2 * rows * sum(w.numel() for w in weights) * copies,
                "weight_bytes": sum(w.nbytes for w in weights) * copies,
            }
        )
    return out


def _copies(device: torch.device, plan: CalibrationPlan) -> dict:
    """Host-to-device bytes/s, alone and while a product runs on the device."""
    is_cuda = device.type == "cuda"
    host = torch.empty(plan.copy_bytes, dtype=torch.uint8, pin_memory=is_cuda)
    target = torch.empty(plan.copy_bytes, dtype=torch.uint8, device=device)
    # On CUDA the copy runs on a stream of its own, so that it can overlap the product.
    stream = torch.cuda.Stream(device) if is_cuda else None

    def copy():
        with torch.cuda.stream(stream) if is_cuda else contextlib.nullcontext():
            target.copy_(host, non_blocking=True)

    alone = median_seconds(copy, device, plan.repeats)
    square = torch.randn(2048, 2048, device=device)
    beside = median_seconds(lambda: (copy(), square @ square), device, plan.repeats)
    product = median_seconds(lambda: square @ square, device, plan.repeats)
    return {
        "bytes": plan.copy_bytes,
        "alone_bytes_per_s": plan.copy_bytes / alone,
        # The copy's share of the time both take together, beyond the product alone.
        "beside_compute_bytes_per_s": plan.copy_bytes / max(beside - product, 1e-9),
    }


def _forwards(model: ModelProfile, num_layers: int, device, dtype, plan) -> list[dict]:
    """Decode steps (the fast kernels, as a draft) and verifications (the batch-invariant ones),
    each shape whose KV fits beside the weights."""
    runner = random_runner(model, num_layers, device, dtype)
    loop, out = ForwardLoop(runner), []
    shapes = [(1, c, batch, False) for c in plan.contexts for batch in plan.batches]
    # Full-KV decode steps on the batch-invariant kernels too, at the first context: what an
    # exact row costs over a fast one.
    shapes += [(1, plan.contexts[0], batch, True) for batch in plan.batches]
    shapes += [(tokens, plan.contexts[0], 1, True) for tokens in plan.verify_tokens]
    kv_per_token = runner.config.kv_bytes_per_token(torch.finfo(dtype).bits // 8)
    for new_tokens, context, batch, exact in shapes:
        if batch * (context + new_tokens) * kv_per_token > _free_bytes(device) * 0.8:
            continue
        caches = [filled_cache(runner, context, new_tokens) for _ in range(batch)]

        def step(caches=caches, new_tokens=new_tokens, context=context, exact=exact):
            jobs = [
                Job(c, [1] * new_tokens, num_logits=new_tokens, is_full_kv=exact) for c in caches
            ]
            loop.step(jobs)
            for cache in caches:
                cache.truncate(context)

        seconds = median_seconds(step, device, plan.repeats)
        log.info(
            "%d layers, %d new tokens x %d at %d context%s: %.2f ms",
            num_layers, new_tokens, batch, context, " (exact)" if exact else "", seconds * 1e3,
        )  # fmt: skip
        out.append(
            {"num_layers": num_layers, "new_tokens": new_tokens, "context": context,
             "batch": batch, "exact": exact, "seconds": seconds}
        )  # fmt: skip
        del caches
    return out


def _layers_that_fit(model: ModelProfile, free_bytes: float, bytes_per_param: int) -> int:
    """The deepest slice whose weights take at most `free_bytes` (at least 2 layers)."""
    per_layer = bytes_per_param * model.params_per_layer()
    head = (bytes_per_param + 4) * model.vocab_size * model.hidden_size  # embedding, float32 head
    return max(2, min(model.num_layers, int((free_bytes - head) // per_layer)))


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads"


def _free_bytes(device: torch.device) -> int:
    """What the next shape may allocate: on CUDA the device's free memory plus the blocks torch's
    allocator holds but no tensor uses (the shapes timed before left them there)."""
    if device.type == "cuda":
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return torch.cuda.mem_get_info(device)[0] + cached
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def _memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
