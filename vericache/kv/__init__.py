from vericache.kv.cache import DenseLayerKV, KVCache, LayerKV
from vericache.kv.compressed import CompressedKV
from vericache.kv.quantized import QuantizedLayerKV
from vericache.kv.state import CacheState, LayerState

__all__ = [
    "CacheState",
    "CompressedKV",
    "DenseLayerKV",
    "KVCache",
    "LayerKV",
    "LayerState",
    "QuantizedLayerKV",
]
