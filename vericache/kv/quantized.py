"""A layer of KIVI-style quantized KV: packed integer codes plus a full-precision recent window.

Keys are quantized per channel over groups of `group_size` tokens (channel outliers stay local to a
channel); values per token over the head dimension. The newest tokens stay in full precision in
`residual`; `flush` quantizes them in blocks once enough are committed. Attention dequantizes one
layer at a time (`keys_values`).
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

import torch

from vericache.errors import CacheStateError
from vericache.kernels.packed_attention import KERNEL_TENSORS, PackedKV, packed_attention
from vericache.kernels.quant import codes_per_byte, dequantize_packed, pack, quantize
from vericache.kv.cache import DenseLayerKV
from vericache.kv.slots import aligned
from vericache.kv.state import LayerState

if TYPE_CHECKING:
    from vericache.kv.pool import BufferPool

# Resident tensors of the quantized part, in state order.
QUANTIZED_TENSORS = (
    "key_codes",  # [T, H, D*bits/8] uint8, T a multiple of group_size
    "key_scale",  # [T / group_size, H, D] fp16
    "key_zero",  # [T / group_size, H, D] fp16
    "value_codes",  # [T, H, D*bits/8] uint8
    "value_scale",  # [T, H, 1] fp16
    "value_zero",  # [T, H, 1] fp16
    "positions",  # [T, H] int32
)


class QuantizedLayerKV:
    # Attention may read the packed codes directly (`attend`) instead of `keys_values`.
    attends_packed = True
    # Its leading groups may be quantized again from exact keys and values (`replace_leading`):
    # a steered kept set's (compress/kept_set.py).
    regroups = True

    def __init__(self, num_kv_heads: int, head_dim: int, dtype, device, bits: int, group_size: int):
        if head_dim % codes_per_byte(bits):
            raise ValueError(f"head_dim {head_dim} cannot be packed at {bits} bits")
        self.bits = bits
        self.group_size = group_size
        self.dtype = dtype
        self.residual = DenseLayerKV(num_kv_heads, head_dim, dtype, device)
        packed_dim = head_dim * bits // 8
        codes = torch.empty(0, num_kv_heads, packed_dim, dtype=torch.uint8, device=device)
        channel_stats = torch.empty(0, num_kv_heads, head_dim, dtype=torch.float16, device=device)
        token_stats = torch.empty(0, num_kv_heads, 1, dtype=torch.float16, device=device)
        self._q = {
            "key_codes": codes,
            "key_scale": channel_stats,
            "key_zero": channel_stats,
            "value_codes": codes,
            "value_scale": token_stats,
            "value_zero": token_stats,
            "positions": torch.empty(0, num_kv_heads, dtype=torch.int32, device=device),
        }

    @property
    def num_quantized(self) -> int:
        return self._q["key_codes"].shape[0]

    @property
    def num_slots(self) -> int:
        return self.num_quantized + self.residual.num_slots

    def append(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        self.residual.append(keys, values, positions)

    def drop_last(self, num_slots: int) -> None:
        if num_slots > self.residual.num_slots:
            raise CacheStateError("quantized tokens cannot be rolled back")
        self.residual.drop_last(num_slots)

    def positions(self) -> torch.Tensor:
        return torch.cat([self._q["positions"], self.residual.positions()])

    def newest_positions(self, num_slots: int) -> torch.Tensor:
        if num_slots <= self.residual.num_slots:
            return self.residual.newest_positions(num_slots)
        return self.positions()[-num_slots:]

    def flush(self, residual_length: int) -> None:
        """Quantize the residual in whole blocks of `residual_length` tokens, as KIVI does: the
        full-precision window then holds between 0 and residual_length - 1 tokens. With
        residual_length 0, every whole group is quantized."""
        block = residual_length or self.group_size
        count = self.residual.num_slots // block * block
        if count == 0:
            return
        keys, values = self.residual.keys_values()
        self._quantize_and_store(keys[:count], values[:count], self.residual.positions()[:count])
        remaining = torch.arange(count, self.residual.num_slots, device=keys.device)
        self.residual.retain(remaining.unsqueeze(1).expand(-1, keys.shape[1]))

    def _quantize_and_store(self, keys, values, positions) -> None:
        new = quantized_groups(keys, values, positions, self.bits, self.group_size)
        self._q = {name: torch.cat([self._q[name], new[name]]) for name in QUANTIZED_TENSORS}

    def replace_leading(self, groups: dict[str, torch.Tensor]) -> None:
        """Its first quantized slots replaced by `groups` (`quantized_groups`' output, as many
        whole groups as it holds there): a steered kept set's (compress/kept_set.py). The
        tensors are replaced, not written, so a clone sharing them keeps its own."""
        num_slots = groups["positions"].shape[0]
        if num_slots % self.group_size or num_slots > self.num_quantized:
            raise CacheStateError(
                f"{num_slots} slots are not whole groups of the {self.num_quantized} quantized"
            )
        per_group = {"key_scale", "key_zero"}  # one row a group, not a slot
        self._q = {
            name: torch.cat([
                groups[name].to(self._q[name].device),
                self._q[name][num_slots // self.group_size if name in per_group else num_slots :],
            ])
            for name in QUANTIZED_TENSORS
        }  # fmt: skip

    def keys_values(self, pad_to: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        num_quantized, total = self.num_quantized, self.num_slots
        end = aligned(total, pad_to)
        residual_keys, residual_values = self.residual.keys_values()
        keys = residual_keys.new_empty(end, *residual_keys.shape[1:])
        values = torch.empty_like(keys)
        if num_quantized:
            keys[:num_quantized], values[:num_quantized] = self._dequantize()
        keys[num_quantized:total] = residual_keys
        values[num_quantized:total] = residual_values
        keys[total:] = 0
        values[total:] = 0
        return keys, values

    def packed(self) -> PackedKV:
        """Its quantized part, as the attention kernels read it (views, no copies)."""
        return PackedKV.from_tensors(self._q, self.bits, self.group_size)

    def packed_tensors(self) -> tuple[torch.Tensor, ...]:
        """`packed().kernel_tensors()` without building (and checking) a PackedKV: what a static
        step's table points at, every step."""
        return tuple(self._q[name] for name in KERNEL_TENSORS)

    def attend(self, q: torch.Tensor, window_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Causal attention of the newest n slots' queries q [n, Hq, D] over this layer, without
        materialising its dequantized keys and values; [n, Hq * D]."""
        packed = self.packed()
        residual_keys, residual_values = self.residual.keys_values()
        num_residual = self.residual.num_slots
        return packed_attention(
            q, packed, residual_keys[:num_residual], residual_values[:num_residual], window_mask
        )

    def _dequantize(self) -> tuple[torch.Tensor, torch.Tensor]:
        """[num_quantized, H, D] keys and values in the cache dtype."""
        q = self._q
        key_codes = q["key_codes"].unflatten(0, (-1, self.group_size))  # [G, S, H, D*bits/8]
        key_scale, key_zero = q["key_scale"].unsqueeze(1), q["key_zero"].unsqueeze(1)  # [G,1,H,D]
        keys = dequantize_packed(key_codes, self.bits, key_scale, key_zero, self.dtype)
        values = dequantize_packed(
            q["value_codes"], self.bits, q["value_scale"], q["value_zero"], self.dtype
        )
        return keys.flatten(0, 1), values

    @property
    def nbytes(self) -> int:
        quantized = sum(
            q.numel() * q.element_size() for name, q in self._q.items() if name != "positions"
        )
        return quantized + self.residual.nbytes

    def to_state(self) -> LayerState:
        residual = self.residual.to_state().tensors
        tensors = {**self._q, **{f"residual_{name}": t for name, t in residual.items()}}
        return LayerState("quantized", {"bits": self.bits, "group_size": self.group_size}, tensors)

    @classmethod
    def from_state(cls, state: LayerState) -> QuantizedLayerKV:
        t = state.tensors
        keys = t["residual_keys"]
        layer = cls(
            keys.shape[1],
            keys.shape[2],
            keys.dtype,
            keys.device,
            int(state.meta["bits"]),
            int(state.meta["group_size"]),
        )
        layer._q = {name: t[name] for name in QUANTIZED_TENSORS}
        layer.residual = DenseLayerKV.from_tensors(
            keys, t["residual_values"], t["residual_positions"]
        )
        return layer

    def clone(self, capacity: int = 0, pool: BufferPool | None = None) -> QuantizedLayerKV:
        # The quantized tensors are replaced, never written in place: sharing them is safe.
        twin = copy.copy(self)
        twin.residual = self.residual.clone(capacity - self.num_quantized, pool)
        return twin


def quantized_groups(
    keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, bits: int, group_size: int
) -> dict[str, torch.Tensor]:
    """Keys and values [T, H, D] at `positions` [T, H] (T whole groups of `group_size`) quantized
    as a `QuantizedLayerKV` stores them: keys per channel over each group, values per token."""
    num_groups = keys.shape[0] // group_size
    grouped = keys.reshape(num_groups, group_size, *keys.shape[1:])  # [G, S, H, D]
    key_codes, key_scale, key_zero = quantize(grouped, bits, dim=1)
    value_codes, value_scale, value_zero = quantize(values, bits, dim=-1)
    return {
        "key_codes": pack(key_codes.flatten(0, 1), bits),
        "key_scale": key_scale.squeeze(1),
        "key_zero": key_zero.squeeze(1),
        "value_codes": pack(value_codes, bits),
        "value_scale": value_scale,
        "value_zero": value_zero,
        "positions": positions,
    }
