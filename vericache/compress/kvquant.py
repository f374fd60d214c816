from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from vericache.compress.base import CompressionKind, CompressionMode, Compressor
from vericache.errors import InvalidRequestError
from vericache.kernels.quant import SUPPORTED_BITS
from vericache.kv.cache import KVCache
from vericache.kv.compressed import CompressedKV
from vericache.kv.outlier_quantized import OutlierQuantizedLayerKV


@dataclass(frozen=True)
class KVQuant(Compressor):
    """Pre-RoPE per-channel key quantization with dense-and-sparse outliers.

    Hooper et al., "KVQuant: Towards 10 Million Context Length LLM Inference with KV Cache
    Quantization", NeurIPS 2024, https://arxiv.org/abs/2401.18079. Keys are quantized per channel
    before the rotary embedding is applied (rotation mixes channel pairs and smears their
    outliers), values per token; the `outlier_fraction` most extreme entries stay exact in a sparse
    list. Uniform min-max codes stand in for the paper's non-uniform datatypes. Like KIVI, the
    newest tokens wait in full precision until `residual_length` of them are committed.
    """

    name: ClassVar[str] = "kvquant"
    kind: ClassVar[CompressionKind] = CompressionKind.QUANTIZATION
    mode: ClassVar[CompressionMode] = CompressionMode.ONLINE

    bits: int = 4
    group_size: int = 32
    residual_length: int = 128
    outlier_fraction: float = 0.01

    def __post_init__(self):
        if self.bits not in SUPPORTED_BITS:
            raise InvalidRequestError(f"kvquant bits must be one of {SUPPORTED_BITS}")
        if (
            self.group_size < 1
            or self.residual_length < 0
            or self.residual_length % self.group_size
        ):
            raise InvalidRequestError(
                "kvquant needs group_size >= 1 and residual_length a multiple of it"
            )
        if not 0 <= self.outlier_fraction < 0.5:
            raise InvalidRequestError("kvquant outlier_fraction must lie in [0, 0.5)")

    @property
    def label(self) -> str:
        return f"{self.name}-{self.bits}bit"

    def compress(self, full: KVCache, context=None) -> CompressedKV:
        rope = self.require_context(context).runner.rope
        layers = []
        for layer in full.layers:
            keys, values = layer.keys_values()
            quantized = OutlierQuantizedLayerKV(
                keys.shape[1],
                keys.shape[2],
                keys.dtype,
                keys.device,
                self.bits,
                self.group_size,
                self.outlier_fraction,
                rope,
            )
            quantized.append(keys[: layer.num_slots], values[: layer.num_slots], layer.positions())
            quantized.flush(self.residual_length)
            layers.append(quantized)
        return CompressedKV(layers, full.num_tokens, self)

    def update(self, cache: CompressedKV) -> None:
        for layer in cache.layers:
            layer.flush(self.residual_length)
