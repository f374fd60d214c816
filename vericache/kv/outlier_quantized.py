"""KVQuant-style quantized layer: keys quantized before RoPE, dense-and-sparse outliers.

Keys are un-rotated before quantization (pre-RoPE channels have stable magnitudes, so per-channel
statistics fit them better) and rotated again at their original positions when attention reads
them. In each quantized block, the most extreme `outlier_fraction` of key values (per channel)
and of value entries (per head) are kept exactly in a sparse side list; the dense codes then only
span the remaining range, which gives them finer steps.
"""

from __future__ import annotations

import torch

from vericache.errors import CacheStateError
from vericache.kv.quantized import QuantizedLayerKV
from vericache.kv.state import LayerState

OUTLIER_TENSORS = (
    "key_outlier_index",
    "key_outlier_value",
    "value_outlier_index",
    "value_outlier_value",
)  # index: int32 flat into [T, H, D]; value: cache dtype


class OutlierQuantizedLayerKV(QuantizedLayerKV):
    kind = "quantized_outliers"
    # Outliers and the RoPE rotation are applied after dequantization, outside the fused kernel.
    attends_packed = False
    # Its keys are quantized before RoPE with outliers apart: not regrouped from rotated keys.
    regroups = False

    def __init__(
        self,
        num_kv_heads,
        head_dim,
        dtype,
        device,
        bits,
        group_size,
        outlier_fraction: float,
        rope=None,
    ):
        super().__init__(num_kv_heads, head_dim, dtype, device, bits, group_size)
        self.outlier_fraction = outlier_fraction
        self.rope = rope  # the model's RotaryEmbedding; attach_rope() after decoding a state
        empty_index = torch.empty(0, dtype=torch.int32, device=device)
        empty_value = torch.empty(0, dtype=dtype, device=device)
        self._outliers = {
            name: empty_index if "index" in name else empty_value for name in OUTLIER_TENSORS
        }

    def attach_rope(self, rope) -> None:
        self.rope = rope

    def _quantize_and_store(self, keys, values, positions) -> None:
        offset = self.num_quantized * keys[0].numel()
        keys = rotate(self._require_rope(), keys, positions, inverse=True)
        # Keys: thresholds per channel over the block; values: per head over the block.
        keys, key_index, key_value = split_outliers(keys, self.outlier_fraction, dims=(0,))
        values, value_index, value_value = split_outliers(values, self.outlier_fraction, (0, 2))
        super()._quantize_and_store(keys, values, positions)
        new = {
            "key_outlier_index": key_index + offset,
            "key_outlier_value": key_value,
            "value_outlier_index": value_index + offset,
            "value_outlier_value": value_value,
        }
        self._outliers = {name: torch.cat([self._outliers[name], new[name]]) for name in new}

    def _dequantize(self) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = super()._dequantize()  # pre-RoPE keys
        o = self._outliers
        keys.view(-1)[o["key_outlier_index"]] = o["key_outlier_value"]
        values.view(-1)[o["value_outlier_index"]] = o["value_outlier_value"]
        return rotate(self._require_rope(), keys, self._q["positions"], inverse=False), values

    def _require_rope(self):
        if self.rope is None:
            raise CacheStateError("a pre-RoPE quantized layer needs the model's rotary embedding")
        return self.rope

    @property
    def nbytes(self) -> int:
        outliers = sum(t.numel() * t.element_size() for t in self._outliers.values())
        return super().nbytes + outliers

    def to_state(self) -> LayerState:
        state = super().to_state()
        state.kind = self.kind
        state.meta["outlier_fraction"] = self.outlier_fraction
        state.tensors.update(self._outliers)
        return state

    @classmethod
    def from_state(cls, state: LayerState) -> OutlierQuantizedLayerKV:
        base = QuantizedLayerKV.from_state(state)
        layer = cls.__new__(cls)
        layer.__dict__.update(base.__dict__)
        layer.outlier_fraction = float(state.meta["outlier_fraction"])
        layer.rope = None
        layer._outliers = {name: state.tensors[name] for name in OUTLIER_TENSORS}
        return layer


def rotate(rope, x: torch.Tensor, positions: torch.Tensor, inverse: bool) -> torch.Tensor:
    """RoPE (or its inverse) of x [T, H, D] at per-head positions [T, H]."""
    cos, signed_sin = rope.angles(positions.long())  # [T, H, D]
    return rope.turn(x, cos, -signed_sin if inverse else signed_sin).to(x.dtype)


def split_outliers(x: torch.Tensor, fraction: float, dims: tuple[int, ...]):
    """Clamps the `fraction` most extreme entries of x [T, H, D], half at each end, thresholds
    taken over `dims`. Returns (clamped x, flat int32 indices [k] of the outliers, values [k])."""
    if fraction <= 0 or x.numel() == 0:
        return x, torch.empty(0, dtype=torch.int32, device=x.device), x.new_empty(0)
    kept = [d for d in range(x.dim()) if d not in dims]
    moved = x.float().permute(*kept, *dims).flatten(len(kept))  # [kept..., N]
    # Thresholds are entries of x itself, so clamping never widens the range the codes span.
    low = torch.quantile(moved, fraction / 2, dim=-1, keepdim=True, interpolation="higher")
    high = torch.quantile(moved, 1 - fraction / 2, dim=-1, keepdim=True, interpolation="lower")
    shape = [1] * x.dim()
    for dim in kept:
        shape[dim] = x.shape[dim]
    low, high = low.view(shape), high.view(shape)
    is_outlier = (x.float() < low) | (x.float() > high)
    index = is_outlier.flatten().nonzero().squeeze(1)
    clamped = torch.minimum(torch.maximum(x.float(), low), high).to(x.dtype)
    return clamped, index.int(), x.flatten()[index]
