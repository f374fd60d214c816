from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from vericache.compress.base import CompressionKind, CompressionMode, Compressor
from vericache.errors import InvalidRequestError
from vericache.kernels.quant import SUPPORTED_BITS
from vericache.kv.cache import KVCache
from vericache.kv.compressed import CompressedKV
from vericache.kv.quantized import QuantizedLayerKV


@dataclass(frozen=True)
class KIVI(Compressor):
    """Asymmetric low-bit KV quantization: keys per channel, values per token.

    Liu et al., "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache", ICML 2024,
    https://arxiv.org/abs/2402.02750. Keys are quantized per channel over groups of `group_size`
    tokens, values per token. Tokens wait in full precision until `residual_length` of them have
    accumulated, then are quantized together, so between 0 and residual_length - 1 of the newest
    tokens are exact at any time.
    """

    name: ClassVar[str] = "kivi"
    kind: ClassVar[CompressionKind] = CompressionKind.QUANTIZATION
    mode: ClassVar[CompressionMode] = CompressionMode.ONLINE
    # A composition's kept groups may be quantized again from exact keys (compress/steering.py).
    regroups: ClassVar[bool] = True

    bits: int = 4
    group_size: int = 32
    residual_length: int = 128

    def __post_init__(self):
        name = self.name
        if self.bits not in SUPPORTED_BITS:
            raise InvalidRequestError(
                f"{name} bits must be one of {SUPPORTED_BITS}, not {self.bits}"
            )
        if self.group_size < 1 or self.residual_length < 0:
            raise InvalidRequestError(f"{name} group_size must be >= 1 and residual_length >= 0")
        if self.residual_length % self.group_size:
            raise InvalidRequestError(
                f"{name} residual_length ({self.residual_length}) must be a multiple of "
                f"group_size ({self.group_size})"
            )

    @property
    def label(self) -> str:
        return f"{self.name}-{self.bits}bit"

    def compress(self, full: KVCache, context=None) -> CompressedKV:
        layers = []
        for layer in full.layers:
            keys, values = layer.keys_values()
            quantized = self.new_layer(keys, context)
            quantized.append(keys[: layer.num_slots], values[: layer.num_slots], layer.positions())
            quantized.flush(self.residual_length)
            layers.append(quantized)
        return CompressedKV(layers, full.num_tokens, self)

    def new_layer(self, keys: torch.Tensor, context) -> QuantizedLayerKV:
        """An empty quantized layer for keys like `keys` [T, H, D]."""
        num_kv_heads, head_dim = keys.shape[1:]
        return QuantizedLayerKV(
            num_kv_heads, head_dim, keys.dtype, keys.device, self.bits, self.group_size
        )

    def update(self, cache: CompressedKV) -> None:
        for layer in cache.layers:
            layer.flush(self.residual_length)
