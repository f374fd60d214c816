"""The cost of one forward on one device (or one tensor-parallel group), from first principles.

t = products + max(KV bytes / attention bandwidth, attention flops / attention compute)
  + overhead + communication, where
- the products read the weights once per forward, whatever the batch, and do 2 x parameters
  flops per new token. Where `vericache calibrate` measured them at 1 to 512 rows, their time is
  the weight bytes times the measured seconds per byte at the forward's row count (interpolated
  between the row counts timed, and growing with the rows past the last, where flops bind); else
  max(weight bytes / bandwidth, dense flops / compute), the roofline;
- KV bytes are every row's KV read and written, and attention flops 4 x heads x head size per
  (query, key) pair and layer (QK^T and PV, a multiply and an add each): attention. The two run
  one after the other in every layer, so their times add; each is bound by whichever of its
  bytes or flops takes longer. Attention's rates are the device's own where `vericache
  calibrate` measured them (a CPU's attention kernel streams KV slower than its products stream
  weights), else the products' rates;
- overhead is the device's fixed cost per forward, plus its cost per layer and per row and
  layer, more for a row on the batch-invariant kernels (`Row.is_full_kv`);
- rows over one shared prefix (`Row.shared_prefix`) in one forward read its KV once, as cascade
  (shared-prefix) attention does: the prefix's bytes count once per forward, its flops per row;
- with tensor parallelism over g devices, each holds 1/g of the weights and of the KV heads, and
  runs two all-reduces per layer of [new tokens, hidden] in the activations' dtype: a ring moves
  2 (g - 1) / g of that per device. The assumption stated: communication does not overlap
  compute, so it adds.
Approximations, stated: the embedding table counts among the weights read although a forward
looks up only its rows, and 2 x parameters per token counts the LM head for every new token.

So a verification of x+1 tokens costs about one decode step where a device has many flops per
byte (an H100 has about 300), and several where it has few (a CPU about 6).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, replace

from vericache.errors import InvalidRequestError
from vericache.sim.profiles import DeviceProfile, ModelProfile


@dataclass(frozen=True)
class Row:
    """One sequence's share of a forward."""

    num_new_tokens: int  # 1: a decode or draft step; x + 1: a verification; a chunk: prefill
    context_tokens: int  # tokens its cache holds before the forward (those it keeps, if dropped)
    kv_bytes_per_token: float  # of its cache, every layer: full, or quantized
    # Over full KV with the batch-invariant kernels (verifications, full-KV decoding, whose bits
    # must not depend on the batch), which cost more per row than the drafts' fast kernels.
    is_full_kv: bool = False
    # The prefix it reads in place from a copy other rows may share (None: none shared), and that
    # prefix's bytes within its cache: a forward reads them once for every row over that copy.
    shared_prefix: Hashable | None = None
    shared_kv_bytes: float = 0.0

    def __post_init__(self):
        if self.num_new_tokens < 1 or self.context_tokens < 0 or self.kv_bytes_per_token <= 0:
            raise InvalidRequestError(f"a row needs new tokens, context >= 0 and KV bytes: {self}")
        cache_bytes = self.context_tokens * self.kv_bytes_per_token
        if not 0 <= self.shared_kv_bytes <= cache_bytes * (1 + 1e-9):
            raise InvalidRequestError(f"a row's shared prefix lies within its cache: {self}")

    def unshared(self) -> Row:
        """The same row over a copy of its prefix that no other row reads."""
        return replace(self, shared_prefix=None, shared_kv_bytes=0.0)


@dataclass(frozen=True)
class ForwardCost:
    seconds: float
    bytes_read: float  # per device: weights and KV
    kv_bytes: float  # per device: the KV attention streams
    flops: float  # per device: products and attention
    memory_s: float  # the weights' and the KV's bytes at their rates
    compute_s: float  # the products' and attention's flops at their rates
    dense_s: float  # the products: the larger of their bytes' and their flops' time
    attention_s: float  # attention: likewise
    overhead_s: float
    communication_s: float

    @property
    def is_compute_bound(self) -> bool:
        return self.compute_s > self.memory_s


def forward_cost(
    model: ModelProfile,
    device: DeviceProfile,
    rows: Sequence[Row],
    weight_element_size: int = 2,
    activation_element_size: int = 2,
    tensor_parallel: int = 1,
) -> ForwardCost:
    """The seconds of one batched forward over `rows` (see the module's formula)."""
    if not rows:
        raise InvalidRequestError("a forward needs at least one row")
    if tensor_parallel < 1 or model.num_kv_heads % tensor_parallel:
        raise InvalidRequestError(
            f"tensor parallelism {tensor_parallel} must divide {model.num_kv_heads} KV heads"
        )
    group = tensor_parallel
    new_tokens = sum(row.num_new_tokens for row in rows)
    kv_bytes = sum(
        (row.context_tokens + row.num_new_tokens) * row.kv_bytes_per_token for row in rows
    ) - _shared_bytes_reread(rows)
    weight_bytes = model.weights_bytes(weight_element_size) / group
    attention = attention_flops(model, rows)
    dense_flops = 2 * model.num_params * new_tokens / group
    weights_s, dense_compute_s = weight_bytes / device.bytes_per_s, dense_flops / device.flops
    kv_s = kv_bytes / group / device.attention_read_bytes_per_s
    attention_compute_s = attention / group / device.attention_flops_per_s
    dense_s = products_seconds(device, weight_bytes, dense_flops, new_tokens)
    attention_s = max(kv_s, attention_compute_s)
    overhead_s = device.forward_overhead_s + device.layer_overhead_s * model.num_layers
    num_exact = sum(row.is_full_kv for row in rows)
    row_s = device.row_overhead_s * len(rows) + device.exact_row_overhead_s * num_exact
    overhead_s += row_s * model.num_layers
    communication_s = _allreduce_s(model, device, new_tokens, activation_element_size, group)
    return ForwardCost(
        seconds=dense_s + attention_s + overhead_s + communication_s,
        bytes_read=weight_bytes + kv_bytes / group,
        kv_bytes=kv_bytes / group,
        flops=dense_flops + attention / group,
        memory_s=weights_s + kv_s,
        compute_s=dense_compute_s + attention_compute_s,
        dense_s=dense_s,
        attention_s=attention_s,
        overhead_s=overhead_s,
        communication_s=communication_s,
    )


def forward_seconds(
    model: ModelProfile,
    device: DeviceProfile,
    rows: Sequence[Row],
    element_size: int = 2,
    tensor_parallel: int = 1,
) -> float:
    """The seconds of a forward whose weights, activations and KV share one element size."""
    cost = forward_cost(model, device, rows, element_size, element_size, tensor_parallel)
    return cost.seconds


def products_seconds(
    device: DeviceProfile, weight_bytes: float, flops: float, num_rows: int
) -> float:
    """The products of a forward of `num_rows` new tokens: on the device's measured curve where
    it has one, else the roofline."""
    curve = device.product_curve
    if not curve:
        return max(weight_bytes / device.bytes_per_s, flops / device.flops)
    upper = next((i for i, (rows, _) in enumerate(curve) if rows >= num_rows), None)
    if upper is None:  # past the rows timed: flops bind, so the time grows with the rows
        last_rows, last_per_byte = curve[-1]
        return weight_bytes * last_per_byte * num_rows / last_rows
    rows_above, per_byte_above = curve[upper]
    if rows_above == num_rows or upper == 0:
        return weight_bytes * per_byte_above
    rows_below, per_byte_below = curve[upper - 1]
    share = (num_rows - rows_below) / (rows_above - rows_below)
    return weight_bytes * (per_byte_below + share * (per_byte_above - per_byte_below))


def weights_fit(
    model: ModelProfile, device: DeviceProfile, tensor_parallel: int, element_size: int = 2
) -> int:
    """Device memory left for KV per device once the weights' share is loaded (< 0: they don't
    fit)."""
    return device.memory_bytes - model.weights_bytes(element_size) // tensor_parallel


def _shared_bytes_reread(rows: Sequence[Row]) -> float:
    """The shared prefixes' bytes that rows after the first over each copy would read again
    without cascade attention: what one read per forward saves."""
    first_seen: set[Hashable] = set()
    saved = 0.0
    for row in rows:
        if row.shared_prefix is None:
            continue
        if row.shared_prefix in first_seen:
            saved += row.shared_kv_bytes
        else:
            first_seen.add(row.shared_prefix)
    return saved


def attention_flops(model: ModelProfile, rows: Sequence[Row]) -> float:
    """QK^T and PV over every (query, key) pair of every row, in every layer."""
    pairs = sum(_pairs(row) for row in rows)
    return 4 * model.num_layers * model.num_heads * model.head_dim * pairs


def _pairs(row: Row) -> int:
    """(query, key) pairs of a row: each new token attends to the context and, causally, to the
    new tokens up to itself."""
    n = row.num_new_tokens
    return n * row.context_tokens + n * (n + 1) // 2


def _allreduce_s(
    model: ModelProfile, device: DeviceProfile, new_tokens: int, element_size: int, group: int
) -> float:
    if group == 1:
        return 0.0
    payload = new_tokens * model.hidden_size * element_size
    per_allreduce = 2 * (group - 1) / group * payload / device.interconnect_bytes_per_s
    return 2 * model.num_layers * (per_allreduce + device.allreduce_latency_s)
