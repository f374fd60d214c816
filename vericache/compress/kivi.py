from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from vericache.compress.base import CompressionKind, Compressor
from vericache.errors import InvalidRequestError
from vericache.kernels.quant import SUPPORTED_BITS
from vericache.kv.cache import KVCache
from vericache.kv.quantized import QuantizedLayerKV


@dataclass(frozen=True)
class KIVI(Compressor):
    """Asymmetric low-bit KV quantization: keys per channel, values per token.

    Liu et al., "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache", ICML 2024,
    https://arxiv.org/abs/2402.02750. Keys are quantized per channel over groups of `group_size`
    tokens, values per token; the newest `residual_length` tokens (and any partial group) stay in
    full precision, and are quantized group by group as decoding commits more tokens.
    """

    name: ClassVar[str] = "kivi"
    kind: ClassVar[CompressionKind] = CompressionKind.QUANTIZATION

    bits: int = 4
    group_size: int = 32
    residual_length: int = 128

    def __post_init__(self):
        if self.bits not in SUPPORTED_BITS:
            raise InvalidRequestError(f"kivi bits must be one of {SUPPORTED_BITS}, got {self.bits}")
        if self.group_size < 1 or self.residual_length < 0:
            raise InvalidRequestError("kivi group_size must be >= 1 and residual_length >= 0")

    @property
    def label(self) -> str:
        return f"{self.name}-{self.bits}bit"

    def compress(self, full: KVCache) -> KVCache:
        layers = []
        for layer in full.layers:
            keys, values = layer.keys_values()
            quantized = QuantizedLayerKV(
                keys.shape[1], keys.shape[2], keys.dtype, keys.device, self.bits, self.group_size
            )
            quantized.append(keys[: layer.num_slots], values[: layer.num_slots], layer.positions())
            quantized.flush(self.residual_length)
            layers.append(quantized)
        return KVCache(layers, num_tokens=full.num_tokens)

    def update(self, cache: KVCache) -> None:
        for layer in cache.layers:
            layer.flush(self.residual_length)
