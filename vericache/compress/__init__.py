"""KV compressors behind one interface (base.py), by registry name (registry.py), alone or a token
dropper then a quantizer (composed.py)."""

from vericache.compress.base import CompressionKind, CompressionMode, Compressor
from vericache.compress.composed import Composed
from vericache.compress.context import ModelContext
from vericache.compress.h2o import H2O
from vericache.compress.kivi import KIVI
from vericache.compress.kvquant import KVQuant
from vericache.compress.kvzip import KVzip
from vericache.compress.pyramidkv import PyramidKV
from vericache.compress.registry import COMPRESSORS, build_compressor, cache_from_state
from vericache.compress.snapkv import SnapKV
from vericache.compress.streamingllm import StreamingLLM
from vericache.compress.tova import TOVA

__all__ = [
    "COMPRESSORS",
    "H2O",
    "KIVI",
    "TOVA",
    "Composed",
    "CompressionKind",
    "CompressionMode",
    "Compressor",
    "KVQuant",
    "KVzip",
    "ModelContext",
    "PyramidKV",
    "SnapKV",
    "StreamingLLM",
    "build_compressor",
    "cache_from_state",
]
