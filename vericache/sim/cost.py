"""The cost of one forward on one device (or one tensor-parallel group), from first principles.

t = max(bytes / sustained bandwidth, flops / sustained compute) + overhead + communication, where
- bytes are the weights (read once per forward, whatever the batch) plus every row's KV read;
- flops are 2 x parameters per new token, plus attention: 4 x heads x head size per (query, key)
  pair and layer (QK^T and PV, a multiply and an add each);
- overhead is the device's fixed cost per forward plus its cost per layer;
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

from collections.abc import Sequence
from dataclasses import dataclass

from vericache.errors import InvalidRequestError
from vericache.sim.profiles import DeviceProfile, ModelProfile


@dataclass(frozen=True)
class Row:
    """One sequence's share of a forward."""

    num_new_tokens: int  # 1: a decode or draft step; x + 1: a verification; a chunk: prefill
    context_tokens: int  # tokens its cache holds before the forward (those it keeps, if dropped)
    kv_bytes_per_token: float  # of its cache, every layer: full, or quantized

    def __post_init__(self):
        if self.num_new_tokens < 1 or self.context_tokens < 0 or self.kv_bytes_per_token <= 0:
            raise InvalidRequestError(f"a row needs new tokens, context >= 0 and KV bytes: {self}")


@dataclass(frozen=True)
class ForwardCost:
    seconds: float
    bytes_read: float  # per device
    flops: float  # per device
    memory_s: float  # bytes_read / sustained bandwidth
    compute_s: float  # flops / sustained compute
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
    kv_read = sum(row.context_tokens * row.kv_bytes_per_token for row in rows)
    kv_written = sum(row.num_new_tokens * row.kv_bytes_per_token for row in rows)
    bytes_read = (model.weights_bytes(weight_element_size) + kv_read + kv_written) / group
    attention_pairs = sum(_pairs(row) for row in rows)  # (query, key) pairs in one layer
    attention_flops = 4 * model.num_layers * model.num_heads * model.head_dim * attention_pairs
    flops = (2 * model.num_params * new_tokens + attention_flops) / group
    memory_s, compute_s = bytes_read / device.bytes_per_s, flops / device.flops
    overhead_s = device.forward_overhead_s + device.layer_overhead_s * model.num_layers
    communication_s = _allreduce_s(model, device, new_tokens, activation_element_size, group)
    seconds = max(memory_s, compute_s) + overhead_s + communication_s
    return ForwardCost(seconds, bytes_read, flops, memory_s, compute_s, overhead_s, communication_s)


def weights_fit(
    model: ModelProfile, device: DeviceProfile, tensor_parallel: int, element_size: int = 2
) -> int:
    """Device memory left for KV per device once the weights' share is loaded (< 0: they don't
    fit)."""
    return device.memory_bytes - model.weights_bytes(element_size) // tensor_parallel


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
