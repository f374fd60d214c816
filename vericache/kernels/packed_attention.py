"""Attention of new tokens over a KIVI packed cache, dequantizing block by block.

A KIVI layer holds a quantized part (packed codes, `PackedKV`) followed by a full-precision residual
of the newest slots. The n new tokens are the last n slots of the whole layer (normally the end of
the residual): new token m sees every older slot and new slots 0..m, as in
vericache.model.kernels.attention.

`packed_attention_reference` never materialises the dequantized layer: it dequantizes `block_size`
slots at a time and folds each block into a running softmax (running max, running sum, weighted
value sum, as in FlashAttention), all in float32. `packed_attention` is the one public entry: it
runs the fused Triton kernel (triton_ops.py) on CUDA when Triton is installed; on CPU the
C++ kernel (kernels/cpu_packed_attention.cpp) attends over the packed codes and the residual
where every packed slot is older than every new token and no window hides any; the reference
serves everything else.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

from vericache.kernels import cpu_attention, triton_attention, triton_ops
from vericache.kernels.quant import codes_per_byte, dequantize_packed

DEFAULT_BLOCK_SIZE = 1024  # slots dequantized at a time by the reference (fastest on CPU)
# A packed layer's tensors, in the order the C++ and Triton kernels take them.
KERNEL_TENSORS = ("key_codes", "key_scale", "key_zero", "value_codes", "value_scale", "value_zero")


@dataclass(frozen=True)
class PackedKV:
    """The quantized part of a KIVI layer, as vericache.kv.quantized.QuantizedLayerKV stores it.

    Keys are quantized per channel over groups of `group_size` slots, values per slot over the head
    dimension; codes are packed lowest bits first (quant.py)."""

    key_codes: torch.Tensor  # [Tq, H, D*bits/8] uint8, Tq a multiple of group_size
    key_scale: torch.Tensor  # [Tq / group_size, H, D] fp16
    key_zero: torch.Tensor  # [Tq / group_size, H, D] fp16
    value_codes: torch.Tensor  # [Tq, H, D*bits/8] uint8
    value_scale: torch.Tensor  # [Tq, H, 1] fp16
    value_zero: torch.Tensor  # [Tq, H, 1] fp16
    bits: int
    group_size: int

    def __post_init__(self):
        codes_per_byte(self.bits)  # raises on unsupported widths
        if self.group_size < 1:
            raise ValueError(f"group_size must be positive, got {self.group_size}")
        num_slots, num_heads, packed_dim = self.key_codes.shape
        if num_slots % self.group_size:
            raise ValueError(
                f"{num_slots} quantized slots are not whole groups of {self.group_size}"
            )
        head_dim = packed_dim * codes_per_byte(self.bits)
        expected = {
            "value_codes": (num_slots, num_heads, packed_dim),
            "key_scale": (num_slots // self.group_size, num_heads, head_dim),
            "key_zero": (num_slots // self.group_size, num_heads, head_dim),
            "value_scale": (num_slots, num_heads, 1),
            "value_zero": (num_slots, num_heads, 1),
        }
        for name, shape in expected.items():
            if tuple(getattr(self, name).shape) != shape:
                raise ValueError(f"{name} is {tuple(getattr(self, name).shape)}, expected {shape}")

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, torch.Tensor], bits: int, group_size: int):
        """From a mapping that holds (at least) the six tensors by name, e.g. a LayerState's."""
        return cls(
            **{name: tensors[name] for name in KERNEL_TENSORS}, bits=bits, group_size=group_size
        )

    def kernel_tensors(self) -> tuple[torch.Tensor, ...]:
        """The six tensors as they are, in KERNEL_TENSORS' order."""
        return tuple(getattr(self, name) for name in KERNEL_TENSORS)

    def kernel_arguments(self) -> tuple[torch.Tensor, ...]:
        """`kernel_tensors`, contiguous (the kernels' layout)."""
        return tuple(t.contiguous() for t in self.kernel_tensors())

    @property
    def num_slots(self) -> int:
        return self.key_codes.shape[0]

    @property
    def head_dim(self) -> int:
        return self.key_codes.shape[2] * codes_per_byte(self.bits)

    def dequantize(self, start: int, end: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [end - start, H, D] of slots start..end-1 (whole groups), rounded to
        `dtype` as the full-layer path rounds them."""
        first_group, end_group = start // self.group_size, end // self.group_size
        key_codes = self.key_codes[start:end].unflatten(0, (-1, self.group_size))  # [G, S, H, Bp]
        key_scale = self.key_scale[first_group:end_group].unsqueeze(1)  # [G, 1, H, D]
        key_zero = self.key_zero[first_group:end_group].unsqueeze(1)
        keys = dequantize_packed(key_codes, self.bits, key_scale, key_zero, dtype)
        values = dequantize_packed(
            self.value_codes[start:end],
            self.bits,
            self.value_scale[start:end],
            self.value_zero[start:end],
            dtype,
        )
        return keys.flatten(0, 1), values


def packed_attention(
    q: torch.Tensor,
    packed: PackedKV,
    residual_keys: torch.Tensor,
    residual_values: torch.Tensor,
    window_mask: torch.Tensor | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> torch.Tensor:
    """Causal attention of n new tokens over a packed KIVI layer; the Triton kernel on CUDA.

    q: [n, Hq, D] in the cache dtype, Hq a multiple of H; residual_keys, residual_values:
    [R, H, D], the newest slots (the n new tokens are the last n of the Tq + R slots);
    window_mask: optional [H, n, Tq + R] bool, False where a sliding window hides a slot.
    Returns [n, Hq * D] in q's dtype. `block_size` only shapes the reference's loop."""
    _check(q, packed, residual_keys, residual_values, window_mask)
    if q.is_cuda and triton_ops.available():
        return triton_attention.packed_attention(
            q, packed, residual_keys, residual_values, window_mask
        )
    # The kernel takes no mask: every packed slot must be older than the first new token.
    if (
        window_mask is None
        and packed.num_slots > 0
        and 1 <= q.shape[0] <= residual_keys.shape[0] + 1
        and cpu_attention.accepts(q.device, residual_keys.dtype, q.shape[-1])
    ):
        rows = cpu_attention.packed_attention(
            _rows(q, residual_keys.shape[1]), packed, residual_keys, residual_values, q.shape[0]
        )
        return _output(rows, q)
    return _attend_blocks(q, packed, residual_keys, residual_values, window_mask, block_size)


def packed_attention_reference(
    q: torch.Tensor,
    packed: PackedKV,
    residual_keys: torch.Tensor,
    residual_values: torch.Tensor,
    window_mask: torch.Tensor | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> torch.Tensor:
    """Pure-torch `packed_attention` (any device): same arguments, same result."""
    _check(q, packed, residual_keys, residual_values, window_mask)
    return _attend_blocks(q, packed, residual_keys, residual_values, window_mask, block_size)


def _attend_blocks(
    q, packed: PackedKV, residual_keys, residual_values, window_mask, block_size
) -> torch.Tensor:
    """The running softmax over every block: the packed part dequantized, then the residual."""
    if block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}")
    num_new, num_heads, head_dim = q.shape
    num_kv_heads = residual_keys.shape[1]
    group = num_heads // num_kv_heads
    num_slots = packed.num_slots + residual_keys.shape[0]
    rows = _rows(q, num_kv_heads)
    softmax = _OnlineSoftmax(num_kv_heads, group * num_new, head_dim, q.device)
    blocks = itertools.chain(
        _packed_blocks(packed, residual_keys.dtype, block_size),
        _residual_blocks(packed.num_slots, residual_keys, residual_values, block_size),
    )
    for start, keys, values in blocks:
        visible = _visible(start, keys.shape[0], num_new, num_slots, group, window_mask, q.device)
        softmax.update(rows, keys.float(), values.float(), visible)
    return _output(softmax.result(), q)


def _rows(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """q [n, Hq, D] as each KV head's rows, ordered (group member, token), pre-scaled by
    1/sqrt(D), in float32: [H, g * n, D]."""
    num_new, num_heads, head_dim = q.shape
    group = num_heads // num_kv_heads
    rows = (q.float() * head_dim**-0.5).view(num_new, num_kv_heads, group, head_dim)
    return rows.permute(1, 2, 0, 3).reshape(num_kv_heads, group * num_new, head_dim)


def _output(rows: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """`_rows`' layout [H, g * n, D] back to [n, Hq * D] in q's dtype."""
    num_new, num_heads, head_dim = q.shape
    out = rows.view(rows.shape[0], num_heads // rows.shape[0], num_new, head_dim)
    return out.permute(2, 0, 1, 3).reshape(num_new, num_heads * head_dim).to(q.dtype)


def _packed_blocks(
    packed: PackedKV, dtype, block_size: int
) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """(first slot, keys [B, H, D], values [B, H, D]) of the packed part, dequantized to dtype."""
    # Whole key groups per quantized block, so each block's scales are a plain slice.
    step = max(packed.group_size, block_size // packed.group_size * packed.group_size)
    for start in range(0, packed.num_slots, step):
        end = min(start + step, packed.num_slots)
        yield (start, *packed.dequantize(start, end, dtype))


def _residual_blocks(
    first_slot: int, residual_keys, residual_values, block_size: int
) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """(first slot, keys, values) of the full-precision residual, `block_size` slots at a time."""
    for start in range(0, residual_keys.shape[0], block_size):
        end = start + block_size
        yield first_slot + start, residual_keys[start:end], residual_values[start:end]


def _visible(start, num_block_slots, num_new, num_slots, group, window_mask, device):
    """[H or 1, g * n, B] bool for slots start..start+B-1, or None when every row sees all."""
    end = start + num_block_slots
    if window_mask is None and end <= num_slots - num_new + 1:
        return None  # older than every new token: no causal mask needed
    slots = torch.arange(start, end, device=device)
    last_visible = num_slots - num_new + torch.arange(num_new, device=device)
    visible = (slots.unsqueeze(0) <= last_visible.unsqueeze(1)).unsqueeze(0)  # [1, n, B]
    if window_mask is not None:
        visible = visible & window_mask[:, :, start:end]  # [H, n, B]
    heads = visible.shape[0]
    return visible.unsqueeze(1).expand(heads, group, num_new, num_block_slots).flatten(1, 2)


class _OnlineSoftmax:
    """Running max, running sum and weighted value sum of each row over the blocks seen so far."""

    def __init__(self, num_kv_heads: int, num_rows: int, head_dim: int, device):
        self.max = torch.full((num_kv_heads, num_rows), float("-inf"), device=device)
        self.sum = torch.zeros(num_kv_heads, num_rows, device=device)
        self.acc = torch.zeros(num_kv_heads, num_rows, head_dim, device=device)

    def update(self, rows, keys, values, visible) -> None:
        """rows [H, R, D]; keys, values [B, H, D] float32; visible [H or 1, R, B] or None."""
        scores = torch.matmul(rows, keys.permute(1, 2, 0))  # [H, R, B]
        if visible is not None:
            scores = scores.masked_fill(~visible, float("-inf"))
        new_max = torch.maximum(self.max, scores.amax(-1))
        # A row that has seen no visible slot yet keeps max -inf; shifting by 0 keeps exp finite.
        shift = torch.where(new_max == float("-inf"), 0.0, new_max)
        correction = torch.exp(self.max - shift)  # [H, R]
        probs = torch.exp(scores - shift.unsqueeze(-1))
        self.sum = self.sum * correction + probs.sum(-1)
        self.acc = self.acc * correction.unsqueeze(-1) + torch.matmul(probs, values.transpose(0, 1))
        self.max = new_max

    def result(self) -> torch.Tensor:
        return self.acc / self.sum.unsqueeze(-1)  # [H, R, D]


def _check(q, packed: PackedKV, residual_keys, residual_values, window_mask) -> None:
    num_new, num_heads, head_dim = q.shape
    num_residual, num_kv_heads, residual_dim = residual_keys.shape
    if residual_values.shape != residual_keys.shape:
        raise ValueError("residual keys and values differ in shape")
    if packed.key_codes.shape[1] != num_kv_heads or packed.head_dim != head_dim:
        raise ValueError("packed part and residual disagree on heads or head_dim")
    if residual_dim != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"q {tuple(q.shape)} does not fit KV [*, {num_kv_heads}, {residual_dim}]")
    if q.dtype != residual_keys.dtype:
        raise ValueError(f"q is {q.dtype}, the cache {residual_keys.dtype}")
    num_slots = packed.num_slots + num_residual
    if num_new > num_slots:
        raise ValueError(f"{num_new} new tokens but only {num_slots} slots")
    if window_mask is not None and tuple(window_mask.shape) != (num_kv_heads, num_new, num_slots):
        raise ValueError(f"window_mask is {tuple(window_mask.shape)}")
