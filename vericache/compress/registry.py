"""Compressors by registry name: `build_compressor("snapkv", ratio=4)`, `("kivi", bits=2)` or a
composition `("snapkv+kivi", ratio=4, bits=4)`, and the caches a stored state describes, whose
compressor it names (`cache_from_state`)."""

from __future__ import annotations

from dataclasses import fields

from vericache.compress.base import Compressor
from vericache.compress.composed import SEPARATOR, Composed, composable
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
    and a strength (`ratio` or `bits`) the method does not take is an error. `dropper+quantizer`
    composes two (composed.py), each part taking the parameters it accepts."""
    given = {key: value for key, value in params.items() if value is not None}
    if SEPARATOR not in name:
        return _single(name, given)
    parts = name.split(SEPARATOR)
    if len(parts) != 2:
        raise InvalidRequestError(
            f"a composed compressor has two parts, a token dropper then a quantizer, not "
            f"{name!r} ({composable()})"
        )
    classes = [_registered(part) for part in parts]
    accepted = [{field.name for field in fields(cls)} for cls in classes]
    split: list[dict] = [{}, {}]
    for key, value in given.items():
        takers = [i for i in (0, 1) if key in accepted[i]]
        if len(takers) != 1:
            takes = ", ".join(sorted(accepted[0] | accepted[1]))
            raise InvalidRequestError(
                f"compressor {name!r} takes no parameter {key!r} (its parts take: {takes})"
            )
        split[takers[0]][key] = value
    return Composed(*(_single(part, part_params) for part, part_params in zip(parts, split)))


def _registered(name: str) -> type[Compressor]:
    if name not in COMPRESSORS:
        raise InvalidRequestError(
            f"unknown compressor {name!r} (available: {', '.join(sorted(COMPRESSORS))}, or a "
            f"dropper and a quantizer joined by {SEPARATOR!r})"
        )
    return COMPRESSORS[name]


def _single(name: str, given: dict) -> Compressor:
    cls = _registered(name)
    accepted = {field.name for field in fields(cls)}
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
