"""The compressor interface.

A compressor is a frozen dataclass of hyper-parameters with one job: turn the full KV of a prefix
into a compressed `KVCache` (`compress`) and, for online methods, keep it compressed as committed
tokens are appended (`update`). What a compressed cache holds is visible in its layers: kept slots
with their original positions (token dropping) or packed codes with scales (quantization).
"""

from __future__ import annotations

import abc
import enum
from dataclasses import dataclass
from typing import ClassVar

from vericache.kv.cache import KVCache


class CompressionKind(str, enum.Enum):
    TOKEN_DROPPING = "token_dropping"
    QUANTIZATION = "quantization"


@dataclass(frozen=True)
class Compressor(abc.ABC):
    name: ClassVar[str]
    kind: ClassVar[CompressionKind]

    @property
    @abc.abstractmethod
    def label(self) -> str:
        """Short name with the strength, e.g. `streamingllm-4x` or `kivi-4bit`."""

    @abc.abstractmethod
    def compress(self, full: KVCache) -> KVCache:
        """A new compressed cache of the tokens `full` holds; `full` is left unchanged."""

    def update(self, cache: KVCache) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Re-compress after committed tokens were appended. Offline methods keep them as is."""
