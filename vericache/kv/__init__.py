from vericache.kv.cache import DenseLayerKV, KVCache, LayerKV
from vericache.kv.quantized import QuantizedLayerKV

__all__ = ["DenseLayerKV", "KVCache", "LayerKV", "QuantizedLayerKV"]
