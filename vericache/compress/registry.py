"""Compressors by registry name: `build_compressor("snapkv", ratio=4)` or `("kivi", bits=2)`."""

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
