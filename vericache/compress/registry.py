"""Compressors by registry name: `build_compressor("snapkv", ratio=4)` or `("kivi", bits=2)`, and
the caches a stored state describes, whose compressor it names (`cache_from_state`)."""

from __future__ import annotations

from dataclasses import fields

from vericache.compress.base import Compressor
from vericache.compress.h2o import H2O
from vericache.compress.kivi import KIVI
from vericache.compress.kvquant import KVQuant
from vericache.compress.kvzip import KVzip
from vericache.compress.pyramidkv import PyramidKV
from vericache.compress.snapkv import SnapKV
from vericache.compress.streamingllm import StreamingLLM
from vericache.compress.tova import TOVA
from vericache.errors import InvalidRequestError
from vericache.kv.cache import KVCache
from vericache.kv.compressed import CompressedKV, layer_from_state
from vericache.kv.outlier_quantized import OutlierQuantizedLayerKV
from vericache.kv.state import CacheState

COMPRESSORS: dict[str, type[Compressor]] = {
    cls.name: cls for cls in (StreamingLLM, SnapKV, H2O, PyramidKV, KVzip, TOVA, KIVI, KVQuant)
}


def build_compressor(name: str, **params) -> Compressor:
    """A compressor from its registry name and hyper-parameters; None values take the defaults,
    and a strength (`ratio` or `bits`) the method does not take is an error."""
    if name not in COMPRESSORS:
        raise InvalidRequestError(
            f"unknown compressor {name!r} (available: {', '.join(sorted(COMPRESSORS))})"
        )
    cls = COMPRESSORS[name]
    accepted = {field.name for field in fields(cls)}
    given = {key: value for key, value in params.items() if value is not None}
    for key in given.keys() - accepted:
        takes = ", ".join(sorted(accepted))
        raise InvalidRequestError(
            f"compressor {name!r} takes no parameter {key!r} (it takes: {takes})"
        )
    return cls(**given)


def cache_from_state(state: CacheState, rope=None) -> KVCache:
    """The cache a state describes: a CompressedKV when a compressor made it, else a full KVCache.
    `rope` (the model's RotaryEmbedding) serves layers that store keys before RoPE (KVQuant)."""
    layers = [layer_from_state(layer) for layer in state.layers]
    for layer in layers:
        if isinstance(layer, OutlierQuantizedLayerKV):
            layer.attach_rope(rope)
    if state.compressor is None:
        return KVCache(layers, state.num_tokens)
    compressor = build_compressor(state.compressor["name"], **state.compressor["params"])
    extras = {name: list(ts) for name, ts in state.extras.items()}
    return CompressedKV(layers, state.num_tokens, compressor, state.budgets, extras)
