"""`vericache calibrate`: a device profile measured on the device, for the simulator.

The one part of vericache/sim that needs torch (the simulator reads only the JSON it writes). It
builds random weights of the named architecture on the device (the whole model, or a slice of its
layers where the whole does not fit) and times:
- a layer's products through the engine's linear kernel at 1 to 512 rows: their seconds per
  weight byte at each row count is the products' curve the cost model follows; their weight
  bytes over the time at one row is the sustained bandwidth, their flops at their fastest the
  sustained compute;
- host-to-device copies (pinned on CUDA; a copy between buffers on CPU), alone and beside compute;
- whole forwards through the engine's forward loop: decode steps at several contexts and batches,
  and verifications of x+1 tokens. From them come attention's own rates, where they differ from
  the products' (a CPU's attention kernel streams KV slower): the KV bandwidth from how decode
  steps grow with the batch (each row adds its KV and nearly nothing else), the attention compute
  from what verifications leave unexplained. What the cost model then does not predict is
  overhead: its part that grows with the layer count is the overhead per layer, the rest the
  overhead per forward (fitted from forwards of two slices of different depth).
Every forward is then predicted with the fitted profile beside its measurement, so the JSON shows
how well the cost model fits the device it was measured on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from vericache.engine.forward_loop import ForwardLoop, Job
from vericache.errors import InvalidRequestError
from vericache.model.runner import ModelRunner
from vericache.sim.cost import Row, attention_flops, forward_cost
from vericache.sim.profiles import DeviceProfile, ModelProfile
from vericache.sim.random_weights import params_per_layer, random_layer, random_runner

log = logging.getLogger(__name__)

MAX_WEIGHT_COPIES = 256  # enough for any real model's layer to stream; tiny test shapes stay fast


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
        return cls(layers, contexts=(1024, 4096), batches=(1, 4), repeats=3)


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
    element_size = torch.finfo(dtype).bits // 8
    products = _products(model, device, dtype, plan)
    log.info("products timed at %s rows", ",".join(map(str, plan.product_rows)))
    copies = _copies(device, plan)
    log.info("host copies: %.1f GB/s", copies["alone_bytes_per_s"] / 1e9)
    deep, shallow = plan.num_layers, max(1, plan.num_layers // 2)
    forwards = _forwards(model, deep, device, dtype, plan)
    _release(device)  # the deeper slice's weights, before the shallower one's are built
    forwards += _forwards(model, shallow, device, dtype, plan)
    unmeasured = f"from {base.source}" if base else "taken as fast as a host copy"
    profile = DeviceProfile(
        name=f"{base.name}-measured" if base else device.type,
        source=f"measured by vericache calibrate on {_device_name(device)}; the interconnect and "
        f"all-reduce latency, which one device cannot measure: {unmeasured}",
        memory_bytes=_memory_bytes(device),
        hbm_bytes_per_s=max(p["weight_bytes"] / p["seconds"] for p in products if p["rows"] == 1),
        peak_flops=max(p["flops"] / p["seconds"] for p in products),
        host_to_device_bytes_per_s=copies["alone_bytes_per_s"],
        interconnect_bytes_per_s=(
            base.interconnect_bytes_per_s if base else copies["alone_bytes_per_s"]
        ),
        bandwidth_efficiency=1.0,  # measured rates are sustained ones
        compute_efficiency=1.0,
        forward_overhead_s=0.0,
        layer_overhead_s=0.0,
        allreduce_latency_s=base.allreduce_latency_s if base else 0.0,
        product_curve=tuple((p["rows"], p["seconds"] / p["weight_bytes"]) for p in products),
    )
    profile = _with_attention_bandwidth(profile, model, forwards, element_size)
    profile = _with_overhead(profile, model, forwards, element_size)
    profile = _with_exact_rows(profile, model, forwards, element_size)
    profile = _with_attention_compute(profile, model, forwards, element_size)
    for forward in forwards:
        forward["predicted_s"] = _predict(profile, model, forward, element_size)
    return {
        "profile": dataclasses.asdict(profile),
        "model": model.name,
        "dtype": str(dtype).removeprefix("torch."),
        "plan": dataclasses.asdict(plan),
        "products": products,
        "copies": copies,
        "forwards": forwards,
    }


# --- Measurements ---------------------------------------------------------------------------------


def _timed(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """The median seconds of `fn` over `repeats` runs, after one untimed run."""
    fn()
    samples = []
    for _ in range(repeats):
        _sync(device)
        started = time.perf_counter()
        fn()
        _sync(device)
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def _products(model: ModelProfile, device, dtype, plan: CalibrationPlan) -> list[dict]:
    """A layer's products (QKV, output, gate-up and down projections, as the engine runs them) at
    each row count, over enough distinct copies of the layer that they stream from memory, not
    from a cache, as a forward's weights do."""
    layer_bytes = params_per_layer(model) * torch.finfo(dtype).bits // 8
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

        seconds = _timed(run, device, plan.repeats)
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

    alone = _timed(copy, device, plan.repeats)
    square = torch.randn(2048, 2048, device=device)
    beside = _timed(lambda: (copy(), square @ square), device, plan.repeats)
    product = _timed(lambda: square @ square, device, plan.repeats)
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
        caches = [_filled_cache(runner, context, new_tokens) for _ in range(batch)]

        def step(caches=caches, new_tokens=new_tokens, context=context, exact=exact):
            jobs = [Job(c, [1] * new_tokens, num_logits=new_tokens, exact=exact) for c in caches]
            loop.step(jobs)
            for cache in caches:
                cache.truncate(context)

        seconds = _timed(step, device, plan.repeats)
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


def _filled_cache(runner: ModelRunner, context: int, room: int):
    """A cache holding `context` tokens of random KV (attention costs the same whatever they
    hold)."""
    cache = runner.new_cache(capacity=context + room)
    config = runner.config
    shape = (context, config.num_kv_heads, config.head_dim)  # [T, H, D]
    positions = torch.arange(context, dtype=torch.int32, device=runner.device)
    for layer in cache.layers:
        keys = torch.randn(shape, device=runner.device).to(runner.dtype)
        layer.append(keys, keys.clone(), positions)
    cache.advance(context)
    return cache


# --- Fitting ----------------------------------------------------------------------------------


def _sliced(model: ModelProfile, forward: dict, element_size: int):
    """The slice a forward ran (its layers, and what it reads of the weights) and its rows."""
    sliced = dataclasses.replace(
        model,
        num_layers=forward["num_layers"],
        num_params=_params_read(model, forward["num_layers"], element_size),
    )
    kv = sliced.kv_bytes_per_token(element_size)
    row = Row(forward["new_tokens"], forward["context"], kv, exact=_is_exact(forward))
    return sliced, [row] * forward["batch"]


def _is_exact(forward: dict) -> bool:
    """On the batch-invariant kernels: verifications always, decode steps where recorded so."""
    return forward.get("exact", forward["new_tokens"] > 1)


def _is_fast_step(forward: dict) -> bool:
    return forward["new_tokens"] == 1 and not _is_exact(forward)


def _cost(profile: DeviceProfile, model: ModelProfile, forward: dict, element_size: int):
    sliced, rows = _sliced(model, forward, element_size)
    return forward_cost(sliced, profile, rows, weight_element_size=element_size)


def _predict(profile: DeviceProfile, model: ModelProfile, forward: dict, element_size: int):
    return _cost(profile, model, forward, element_size).seconds


def _with_attention_bandwidth(profile: DeviceProfile, model, forwards: list[dict], element_size):
    """Attention's KV bandwidth and the overhead of a row: between the smallest and the largest
    batch of decode steps at one depth and context, each added row costs its KV over the
    bandwidth plus the row's overhead in every layer (less what the products add). With rows of
    several KV sizes both are fitted (least squares); with one, or a fit that makes either
    negative, the bandwidth alone (the median), the rows' overhead then inside it."""
    groups: dict[tuple[int, int], list[dict]] = {}
    for forward in forwards:
        if _is_fast_step(forward):
            groups.setdefault((forward["num_layers"], forward["context"]), []).append(forward)
    points = []  # (KV bytes of a row, layers, seconds a row adds)
    for (layers, _), group in groups.items():
        small, large = min(group, key=_batch), max(group, key=_batch)
        if large["batch"] == small["batch"]:
            continue
        small_cost, large_cost = (_cost(profile, model, f, element_size) for f in (small, large))
        added_rows = large["batch"] - small["batch"]
        seconds_added = (
            large["seconds"] - small["seconds"] - (large_cost.dense_s - small_cost.dense_s)
        )
        kv_added = large_cost.kv_bytes - small_cost.kv_bytes
        if seconds_added > 0:
            points.append((kv_added / added_rows, layers, seconds_added / added_rows))
    if not points:
        return profile
    fitted = _bandwidth_and_row_overhead(points)
    if fitted is not None:
        rate, row_overhead_s = fitted
        return dataclasses.replace(
            profile, attention_bytes_per_s=rate, row_overhead_s=row_overhead_s
        )
    rates = [kv / seconds for kv, _, seconds in points]
    return dataclasses.replace(profile, attention_bytes_per_s=statistics.median(rates))


def _bandwidth_and_row_overhead(points: list[tuple[float, int, float]]):
    """Least squares of seconds = kv / rate + row_overhead x layers over the points; (rate,
    row_overhead) if both come out positive (the KV sizes must differ), else None."""
    sxx = sum(kv * kv for kv, _, _ in points)
    sxl = sum(kv * layers for kv, layers, _ in points)
    sll = sum(layers * layers for _, layers, _ in points)
    sxy = sum(kv * s for kv, _, s in points)
    sly = sum(layers * s for _, layers, s in points)
    determinant = sxx * sll - sxl * sxl
    if determinant <= 1e-9 * sxx * sll:  # every row the same size over its layers
        return None
    per_byte = (sxy * sll - sly * sxl) / determinant
    row_overhead_s = (sxx * sly - sxl * sxy) / determinant
    if per_byte <= 0 or row_overhead_s < 0:
        return None
    return 1 / per_byte, row_overhead_s


def _with_attention_compute(profile: DeviceProfile, model, forwards: list[dict], element_size):
    """Attention's compute: in each verification, its attention flops over the seconds the
    products, the overhead and its KV's streaming leave (the median; unchanged where they leave
    none, attention then bound by its bytes)."""
    rates = []
    for forward in forwards:
        if forward["new_tokens"] == 1:
            continue
        cost = _cost(profile, model, forward, element_size)
        left = forward["seconds"] - cost.dense_s - cost.overhead_s - cost.communication_s
        kv_s = cost.kv_bytes / profile.attention_read_bytes_per_s
        if left > kv_s:
            rates.append(attention_flops(*_sliced(model, forward, element_size)) / left)
    if not rates:
        return profile
    return dataclasses.replace(profile, attention_flops=statistics.median(rates))


def _with_exact_rows(profile: DeviceProfile, model, forwards: list[dict], element_size: int):
    """What a row on the batch-invariant kernels adds per layer: each exact decode step over the
    fast one of its shape, per row and layer (the median; never below zero)."""
    fast = {_shape(f): f["seconds"] for f in forwards if _is_fast_step(f)}
    extras = [
        (f["seconds"] - fast[_shape(f)]) / (f["batch"] * f["num_layers"])
        for f in forwards
        if f["new_tokens"] == 1 and _is_exact(f) and _shape(f) in fast
    ]
    if not extras:
        return profile
    return dataclasses.replace(profile, exact_row_overhead_s=max(0.0, statistics.median(extras)))


def _shape(forward: dict) -> tuple[int, int, int]:
    return forward["num_layers"], forward["context"], forward["batch"]


def _batch(forward: dict) -> int:
    return forward["batch"]


def _with_overhead(profile: DeviceProfile, model, forwards: list[dict], element_size: int):
    """Overhead per layer and per forward, from what bandwidth and compute leave unexplained in
    the decode steps of the two slices (never below zero)."""
    residual: dict[int, list[float]] = {}
    for forward in forwards:
        if _is_fast_step(forward):
            unexplained = forward["seconds"] - _predict(profile, model, forward, element_size)
            residual.setdefault(forward["num_layers"], []).append(unexplained)
    if not residual:  # no decode step fitted beside the weights
        return profile
    depths = sorted(residual)
    median = {depth: statistics.median(values) for depth, values in residual.items()}
    per_layer = 0.0
    if len(depths) > 1 and depths[-1] > depths[0]:
        per_layer = (median[depths[-1]] - median[depths[0]]) / (depths[-1] - depths[0])
    per_layer = max(0.0, per_layer)
    fixed = max(0.0, median[depths[-1]] - per_layer * depths[-1])
    return dataclasses.replace(profile, forward_overhead_s=fixed, layer_overhead_s=per_layer)


def _params_read(model: ModelProfile, num_layers: int, element_size: int) -> int:
    """What a forward of the random runner reads, counted in parameters of `element_size`: its
    layers and its LM head, which the engine keeps in float32 (a forward looks up only its own
    rows of the embedding table)."""
    head = model.vocab_size * model.hidden_size * 4 // element_size
    return params_per_layer(model) * num_layers + head


def _layers_that_fit(model: ModelProfile, free_bytes: float, bytes_per_param: int) -> int:
    """The deepest slice whose weights take at most `free_bytes` (at least 2 layers)."""
    per_layer = bytes_per_param * params_per_layer(model)
    head = (bytes_per_param + 4) * model.vocab_size * model.hidden_size  # embedding, float32 head
    return max(2, min(model.num_layers, int((free_bytes - head) // per_layer)))


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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
