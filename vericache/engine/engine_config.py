"""Configuration of the engine and of the parts it shares with the long-context engine."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from vericache.errors import InvalidRequestError
from vericache.model.runner import DEFAULT_PREFILL_CHUNK


class DraftKVSource(str, enum.Enum):
    """What the compressed cache holds for tokens once they are committed.

    VERIFIER: the exact KV the verification computed (or the prefill, for the prompt's suffix).
    DRAFTER: the KV the drafter computed itself over its compressed cache.
    Measured with `vericache bench acceptance --draft-kv both` (README: "Draft KV"): exact KV
    accepts more tokens per round, so it is the default.
    """

    VERIFIER = "verifier"
    DRAFTER = "drafter"


@dataclass(frozen=True)
class EngineConfig:
    draft_kv_source: DraftKVSource = DraftKVSource.VERIFIER
    # Batch-invariant kernels for every full-KV decode or verification: greedy vericache output is
    # then bit-identical to full decoding. False trades that guarantee for speed.
    invariant_full_kv: bool = True
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK
    # Full and compressed KV of prompt prefixes kept for reuse (0 turns reuse off).
    prefix_cache_bytes: int = 2 << 30
    # Decode, draft and verification forwards over static buffers, captured in CUDA graphs
    # (model/static_forward.py); None: on CUDA, off on CPU (where no capture pays for the
    # padding).
    static_shapes: bool | None = None

    def __post_init__(self):
        if self.prefill_chunk < 1 or self.prefix_cache_bytes < 0:
            raise InvalidRequestError("prefill_chunk must be >= 1 and prefix_cache_bytes >= 0")
