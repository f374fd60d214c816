"""The device profile `vericache calibrate` fits to its measurements: pure Python, so that a
later fit can be tried on a calibration's stored measurements without torch (`bench sim-validate
--from-json`).

From the products timed at 1 to 512 rows come the sustained bandwidth (their weight bytes over the
time at one row), the sustained compute (their flops at their fastest) and the products' curve,
their seconds per weight byte at each row count, made never to fall as the rows grow (a kernel
that serves more rows faster than fewer serves the fewer in the same time, padded; single timings
that dip are a path's quirk, not a cost the engine's forwards show). From the whole forwards come
attention's own rates, where they differ from the products' (a CPU's attention kernel streams KV
slower): the KV bandwidth and a row's overhead from how decode steps grow with the batch, the
attention compute from what verifications leave unexplained, and what the batch-invariant kernels
add to a row. What the cost model then does not predict is overhead, fitted over every decode step
of two slices of different depth: its part that grows with the layer count is the overhead per
layer, the rest the overhead per forward.
"""

from __future__ import annotations

import dataclasses
import statistics

from vericache.errors import InvalidRequestError
from vericache.sim.cost import Row, attention_flops, forward_cost
from vericache.sim.profiles import DeviceProfile, ModelProfile

_ELEMENT_SIZES = {"float32": 4, "bfloat16": 2, "float16": 2}  # a calibration's dtype


def fit_profile(
    start: DeviceProfile,
    model: ModelProfile,
    products: list[dict],
    forwards: list[dict],
    element_size: int,
) -> DeviceProfile:
    """`start`'s memory, links and source, with every rate and overhead fitted to `products`
    ({rows, seconds, flops, weight_bytes}) and `forwards` ({num_layers, new_tokens, context,
    batch, exact, seconds}), timed in `element_size`-byte elements."""
    profile = dataclasses.replace(
        start,
        hbm_bytes_per_s=max(p["weight_bytes"] / p["seconds"] for p in products if p["rows"] == 1),
        peak_flops=max(p["flops"] / p["seconds"] for p in products),
        bandwidth_efficiency=1.0,  # measured rates are sustained ones
        compute_efficiency=1.0,
        forward_overhead_s=0.0,
        layer_overhead_s=0.0,
        attention_bytes_per_s=None,
        attention_flops=None,
        row_overhead_s=0.0,
        exact_row_overhead_s=0.0,
        product_curve=product_curve(products),
    )
    profile = _with_attention_bandwidth(profile, model, forwards, element_size)
    profile = _with_overhead(profile, model, forwards, element_size)
    profile = _with_exact_rows(profile, model, forwards, element_size)
    return _with_attention_compute(profile, model, forwards, element_size)


def refit(calibration: dict, model: ModelProfile) -> dict:
    """A `calibrate` result with its profile fitted again to its own measurements (by this fit,
    which may be newer than the one that ran) and each forward predicted by it."""
    element_size = _ELEMENT_SIZES[calibration["dtype"]]
    start = DeviceProfile(**calibration["profile"])
    products, forwards = calibration["products"], [dict(f) for f in calibration["forwards"]]
    profile = fit_profile(start, model, products, forwards, element_size)
    for forward in forwards:
        forward["predicted_s"] = predicted_seconds(profile, model, forward, element_size)
    return calibration | {"profile": dataclasses.asdict(profile), "forwards": forwards}


def averaged(first: dict, second: dict, model: ModelProfile) -> dict:
    """Two `calibrate` results of one plan on one device as one, each timing the mean of both (a
    shared machine's speed drifts between them), refitted."""
    if first["plan"] != second["plan"] or first["dtype"] != second["dtype"]:
        raise InvalidRequestError("only calibrations of one plan and dtype can be averaged")

    def mean_seconds(a: list[dict], b: list[dict]) -> list[dict]:
        return [x | {"seconds": (x["seconds"] + y["seconds"]) / 2} for x, y in zip(a, b)]

    merged = first | {
        "products": mean_seconds(first["products"], second["products"]),
        "forwards": mean_seconds(first["forwards"], second["forwards"]),
        "timings": "the mean of a calibration before the benchmarks and one after",
    }
    return refit(merged, model)


def product_curve(products: list[dict]) -> tuple[tuple[int, float], ...]:
    """(rows, seconds per weight byte) at each row count timed, the least time of that count or
    any larger one."""
    ordered = sorted(products, key=lambda p: p["rows"])
    curve, least = [], float("inf")
    for product in reversed(ordered):
        least = min(least, product["seconds"] / product["weight_bytes"])
        curve.append((product["rows"], least))
    return tuple(reversed(curve))


def _sliced(model: ModelProfile, forward: dict, element_size: int):
    """The slice a forward ran (its layers, and what it reads of the weights) and its rows."""
    sliced = dataclasses.replace(
        model,
        num_layers=forward["num_layers"],
        num_params=_params_read(model, forward["num_layers"], element_size),
    )
    kv = sliced.kv_bytes_per_token(element_size)
    row = Row(forward["new_tokens"], forward["context"], kv, is_full_kv=_is_full_kv(forward))
    return sliced, [row] * forward["batch"]


def _is_full_kv(forward: dict) -> bool:
    """On the batch-invariant kernels: verifications always, decode steps where recorded so."""
    return forward.get("exact", forward["new_tokens"] > 1)


def _is_fast_step(forward: dict) -> bool:
    return forward["new_tokens"] == 1 and not _is_full_kv(forward)


def _cost(profile: DeviceProfile, model: ModelProfile, forward: dict, element_size: int):
    sliced, rows = _sliced(model, forward, element_size)
    return forward_cost(sliced, profile, rows, weight_element_size=element_size)


def predicted_seconds(
    profile: DeviceProfile, model: ModelProfile, forward: dict, element_size: int
):
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
        if f["new_tokens"] == 1 and _is_full_kv(f) and _shape(f) in fast
    ]
    if not extras:
        return profile
    return dataclasses.replace(profile, exact_row_overhead_s=max(0.0, statistics.median(extras)))


def _shape(forward: dict) -> tuple[int, int, int]:
    return forward["num_layers"], forward["context"], forward["batch"]


def _batch(forward: dict) -> int:
    return forward["batch"]


def _with_overhead(profile: DeviceProfile, model, forwards: list[dict], element_size: int):
    """Overhead per forward and per layer: the least-squares fit of fixed + per_layer x layers to
    what bandwidth and compute leave unexplained in every decode step of the two slices (both
    kept >= 0: where one would fall below, the other alone takes the whole of it)."""
    points = [
        (f["num_layers"], f["seconds"] - predicted_seconds(profile, model, f, element_size))
        for f in forwards
        if _is_fast_step(f)
    ]
    if not points:  # no decode step fitted beside the weights
        return profile
    fixed, per_layer = _line(points)
    if per_layer < 0:
        fixed, per_layer = statistics.mean(r for _, r in points), 0.0
    if fixed < 0:
        layers_squared = sum(layers * layers for layers, _ in points)
        fixed, per_layer = 0.0, sum(layers * r for layers, r in points) / layers_squared
    fixed, per_layer = max(0.0, fixed), max(0.0, per_layer)
    return dataclasses.replace(profile, forward_overhead_s=fixed, layer_overhead_s=per_layer)


def _line(points: list[tuple[int, float]]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through (x, y) points; a flat line where
    every x is the same."""
    xs, ys = [x for x, _ in points], [y for _, y in points]
    mean_x, mean_y = statistics.mean(xs), statistics.mean(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    if spread == 0:
        return mean_y, 0.0
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / spread
    return mean_y - slope * mean_x, slope


def _params_read(model: ModelProfile, num_layers: int, element_size: int) -> int:
    """What a forward of the random runner reads, counted in parameters of `element_size`: its
    layers and its LM head, which the engine keeps in float32 (a forward looks up only its own
    rows of the embedding table)."""
    head = model.vocab_size * model.hidden_size * 4 // element_size
    return model.params_per_layer() * num_layers + head
