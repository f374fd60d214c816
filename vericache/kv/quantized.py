"""A layer of KIVI-style quantized KV: packed integer codes plus a full-precision recent window.

Keys are quantized per channel over groups of `group_size` tokens (channel outliers stay local to a
channel); values per token over the head dimension. The newest tokens stay in full precision in
`residual` until they are committed and more than `residual_length` of them have accumulated.
Attention dequantizes one layer at a time (`keys_values`).
"""

from __future__ import annotations

import copy

import torch

from vericache.errors import CacheStateError
from vericache.kernels.quant import codes_per_byte, dequantize_packed, pack, quantize
from vericache.kv.cache import DenseLayerKV, aligned


class QuantizedLayerKV:
    def __init__(self, num_kv_heads: int, head_dim: int, dtype, device, bits: int, group_size: int):
        if head_dim % codes_per_byte(bits):
            raise ValueError(f"head_dim {head_dim} cannot be packed at {bits} bits")
        self.bits = bits
        self.group_size = group_size
        self.dtype = dtype
        self.residual = DenseLayerKV(num_kv_heads, head_dim, dtype, device)
        packed_dim = head_dim * bits // 8
        # Quantized part, grown by whole groups. Codes: [T, H, D*bits/8].
        self._key_codes = torch.empty(0, num_kv_heads, packed_dim, dtype=torch.uint8, device=device)
        self._value_codes = torch.empty_like(self._key_codes)
        self._key_scale = torch.empty(0, num_kv_heads, head_dim, dtype=torch.float16, device=device)
        self._key_zero = torch.empty_like(self._key_scale)  # [T / group_size, H, D]
        self._value_scale = torch.empty(0, num_kv_heads, 1, dtype=torch.float16, device=device)
        self._value_zero = torch.empty_like(self._value_scale)  # [T, H, 1]
        self._positions = torch.empty(0, num_kv_heads, dtype=torch.int32, device=device)

    @property
    def num_quantized(self) -> int:
        return self._key_codes.shape[0]

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
        return torch.cat([self._positions, self.residual.positions()])

    def flush(self, residual_length: int) -> None:
        """Quantize the oldest whole groups of the residual, keeping at least `residual_length`."""
        num_groups = max(0, self.residual.num_slots - residual_length) // self.group_size
        if num_groups == 0:
            return
        count = num_groups * self.group_size
        keys, values = self.residual.keys_values()
        self._quantize_and_store(keys[:count], values[:count], self.residual.positions()[:count])
        remaining = torch.arange(count, self.residual.num_slots, device=keys.device)
        self.residual.retain(remaining.unsqueeze(1).expand(-1, keys.shape[1]))

    def _quantize_and_store(self, keys, values, positions) -> None:
        num_groups = keys.shape[0] // self.group_size
        grouped = keys.reshape(num_groups, self.group_size, *keys.shape[1:])  # [G, S, H, D]
        key_codes, key_scale, key_zero = quantize(grouped, self.bits, dim=1)
        value_codes, value_scale, value_zero = quantize(values, self.bits, dim=-1)
        self._key_codes = torch.cat([self._key_codes, pack(key_codes.flatten(0, 1), self.bits)])
        self._key_scale = torch.cat([self._key_scale, key_scale.squeeze(1)])
        self._key_zero = torch.cat([self._key_zero, key_zero.squeeze(1)])
        self._value_codes = torch.cat([self._value_codes, pack(value_codes, self.bits)])
        self._value_scale = torch.cat([self._value_scale, value_scale])
        self._value_zero = torch.cat([self._value_zero, value_zero])
        self._positions = torch.cat([self._positions, positions])

    def keys_values(self, pad_to: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        num_quantized, total = self.num_quantized, self.num_slots
        end = aligned(total, pad_to)
        shape = (end, *self.residual.keys_values()[0].shape[1:])
        keys = torch.empty(shape, dtype=self.dtype, device=self._key_codes.device)
        values = torch.empty_like(keys)
        if num_quantized:
            key_codes = self._key_codes.unflatten(0, (-1, self.group_size))  # [G, S, H, D*bits/8]
            scale, zero = self._key_scale.unsqueeze(1), self._key_zero.unsqueeze(1)  # [G, 1, H, D]
            keys[:num_quantized] = dequantize_packed(
                key_codes, self.bits, scale, zero, self.dtype
            ).flatten(0, 1)
            values[:num_quantized] = dequantize_packed(
                self._value_codes, self.bits, self._value_scale, self._value_zero, self.dtype
            )
        residual_keys, residual_values = self.residual.keys_values()
        keys[num_quantized:total] = residual_keys
        values[num_quantized:total] = residual_values
        keys[total:] = 0
        values[total:] = 0
        return keys, values

    @property
    def nbytes(self) -> int:
        quantized = sum(
            t.numel() * t.element_size()
            for t in (
                self._key_codes,
                self._value_codes,
                self._key_scale,
                self._key_zero,
                self._value_scale,
                self._value_zero,
            )
        )
        return quantized + self.residual.nbytes

    def clone(self, capacity: int = 0) -> QuantizedLayerKV:
        # The quantized tensors are replaced, never written in place: sharing them is safe.
        twin = copy.copy(self)
        twin.residual = self.residual.clone(capacity - self.num_quantized)
        return twin
