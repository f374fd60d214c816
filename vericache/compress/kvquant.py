from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from vericache.compress.kivi import KIVI
from vericache.errors import InvalidRequestError
from vericache.kv.outlier_quantized import OutlierQuantizedLayerKV


@dataclass(frozen=True)
class KVQuant(KIVI):
    """Pre-RoPE per-channel key quantization with dense-and-sparse outliers.

    Hooper et al., "KVQuant: Towards 10 Million Context Length LLM Inference with KV Cache
    Quantization", NeurIPS 2024, https://arxiv.org/abs/2401.18079. Keys are quantized per channel
    before the rotary embedding is applied (rotation mixes channel pairs and smears their
    outliers), values per token; the `outlier_fraction` most extreme entries stay exact in a sparse
    list. Uniform min-max codes stand in for the paper's non-uniform datatypes. As in KIVI, the
    newest tokens wait in full precision until `residual_length` of them are committed.
    """

    name: ClassVar[str] = "kvquant"
    # Its keys are quantized before RoPE with outliers apart: not regrouped from rotated keys.
    regroups: ClassVar[bool] = False

    outlier_fraction: float = 0.01

    def __post_init__(self):
        super().__post_init__()
        if not 0 <= self.outlier_fraction < 0.5:
            raise InvalidRequestError("kvquant outlier_fraction must lie in [0, 0.5)")

    def new_layer(self, keys, context) -> OutlierQuantizedLayerKV:
        rope = self.require_context(context).runner.rope
        num_kv_heads, head_dim = keys.shape[1:]
        return OutlierQuantizedLayerKV(
            num_kv_heads, head_dim, keys.dtype, keys.device, self.bits, self.group_size,
            self.outlier_fraction, rope,
        )  # fmt: skip
