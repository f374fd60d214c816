"""Compressors by name: `build_compressor("streamingllm", ratio=4)` or `("kivi", bits=4)`."""

from __future__ import annotations

from dataclasses import fields

from vericache.compress.base import CompressionKind, Compressor
from vericache.compress.kivi import KIVI
from vericache.compress.streamingllm import StreamingLLM
from vericache.errors import InvalidRequestError

COMPRESSORS: dict[str, type[Compressor]] = {cls.name: cls for cls in (StreamingLLM, KIVI)}


def build_compressor(name: str, **params) -> Compressor:
    """A compressor from its registry name and hyper-parameters; None values take the defaults."""
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


__all__ = [
    "COMPRESSORS",
    "KIVI",
    "CompressionKind",
    "Compressor",
    "StreamingLLM",
    "build_compressor",
]
