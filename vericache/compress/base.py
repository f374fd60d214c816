"""The compressor interface.

A compressor is a small frozen dataclass: a registry `name`, a `kind` (token dropping or
quantization), a `mode` and its hyper-parameters, validated at construction. `compress` turns the
full KV of a prefix into a `CompressedKV`; offline methods run once, when a prefix is registered,
and may run extra forward passes through the `ModelContext`. Online methods also `update` the
compressed cache as decoding commits tokens.
"""

from __future__ import annotations

import abc
import enum
import math
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, ClassVar

import torch

from vericache.compress.scoring import keep_slots
from vericache.errors import InvalidRequestError
from vericache.kv.cache import DenseLayerKV, KVCache, LayerKV
from vericache.kv.compressed import CompressedKV

if TYPE_CHECKING:
    from vericache.compress.context import ModelContext


class CompressionKind(str, enum.Enum):
    TOKEN_DROPPING = "token_dropping"
    QUANTIZATION = "quantization"
    COMPOSED = "composed"  # a token dropper, then a quantizer over what it kept (composed.py)


class CompressionMode(str, enum.Enum):
    OFFLINE = "offline"  # compresses the prefix once; later tokens are kept as they come
    ONLINE = "online"  # also evicts or quantizes tokens committed while decoding


@dataclass(frozen=True)
class Compressor(abc.ABC):
    name: ClassVar[str]
    kind: ClassVar[CompressionKind]
    mode: ClassVar[CompressionMode]
    # True when `update` scores tokens by the attention the drafter's queries pay them.
    records_queries: ClassVar[bool] = False

    @property
    @abc.abstractmethod
    def label(self) -> str:
        """Short name with the strength, e.g. `snapkv-4x` or `kivi-4bit`."""

    @abc.abstractmethod
    def compress(self, full: KVCache, context: ModelContext | None = None) -> CompressedKV:
        """A new compressed cache of the tokens `full` holds; `full` is left unchanged."""

    def update(self, cache: CompressedKV) -> None:  # noqa: B027 - offline methods keep tokens
        """Evict or quantize after committed tokens were appended (online methods)."""

    @property
    def kept_token_ratio(self) -> float | None:
        """Tokens of the prefix per token it keeps, where it drops tokens; None where it keeps
        every one."""
        return None

    @property
    def is_steerable(self) -> bool:
        """Its kept prefix positions may be chosen again by the verifier (compress/steering.py):
        a token dropper that chooses them once and keeps them dense."""
        return False

    @property
    def steers_by_default(self) -> bool:
        """Whether a request that does not choose is steered over a long prefix
        (engine/request.py `default_steer_every`): where steering was measured to pay."""
        return self.is_steerable

    @property
    def params(self) -> dict:
        return {field.name: getattr(self, field.name) for field in fields(self)}

    def spec(self) -> dict:
        """What rebuilds this compressor: `build_compressor(spec["name"], **spec["params"])`."""
        return {"name": self.name, "params": self.params}

    def describe(self) -> dict:
        return {
            "name": self.name,
            "kind": self.kind.value,
            "mode": self.mode.value,
            "label": self.label,
            "params": self.params,
        }

    def require_context(self, context: ModelContext | None) -> ModelContext:
        if context is None:
            raise InvalidRequestError(f"{self.name} scores tokens with the model: pass a context")
        return context


# 16-bit storage a token-dropping compressor may keep its slots in, by the name a label carries.
STORAGE_DTYPES = {"bfloat16": ("bf16", torch.bfloat16), "float16": ("fp16", torch.float16)}


# Past 64x, an 8k-token prefix keeps 128 tokens: too few to draft from, and a ratio of 1e9 or inf
# is a typo, not a setting.
MAX_RATIO = 64


@dataclass(frozen=True)
class TokenDropping(Compressor):
    """A compressor that keeps `ratio` times fewer tokens than the prefix holds."""

    kind: ClassVar[CompressionKind] = CompressionKind.TOKEN_DROPPING

    ratio: float = 4.0
    # The kept slots' storage: None keeps the full cache's dtype; "bfloat16" or "float16" halves
    # a float32 cache's bytes, and the bytes a draft step reads (drafts need no exactness: the
    # verification reads the full KV).
    dtype: str | None = None

    def __post_init__(self):
        if not 1 <= self.ratio <= MAX_RATIO:  # also rejects NaN
            raise InvalidRequestError(
                f"{self.name} ratio must lie in [1, {MAX_RATIO}], got {self.ratio}"
            )
        if self.dtype is not None and self.dtype not in STORAGE_DTYPES:
            raise InvalidRequestError(
                f"{self.name} dtype must be one of {', '.join(STORAGE_DTYPES)}, got {self.dtype!r}"
            )

    @property
    def label(self) -> str:
        suffix = f"-{STORAGE_DTYPES[self.dtype][0]}" if self.dtype else ""
        return f"{self.name}-{self.ratio:g}x{suffix}"

    @property
    def kept_token_ratio(self) -> float:
        return self.ratio

    @property
    def is_steerable(self) -> bool:
        return self.mode is CompressionMode.OFFLINE

    @property
    def observation_window(self) -> int:
        """The prefix's last tokens it keeps whatever they score (0: none)."""
        return 0

    @property
    def storage_dtype(self) -> torch.dtype | None:
        """The torch dtype of the kept slots; None: the full cache's."""
        return STORAGE_DTYPES[self.dtype][1] if self.dtype else None

    def keep_slots(self, layer: LayerKV, slot_index: torch.Tensor) -> DenseLayerKV:
        """A new dense layer of the given slots of `layer` (slot_index [k, H], ascending per
        head), stored in this compressor's dtype: every token-dropping method keeps tokens here."""
        return keep_slots(layer, slot_index, self.storage_dtype)

    def grow_budgets(self, cache: CompressedKV) -> list[int]:
        """Online eviction keeps the cache `ratio` times smaller than the tokens seen so far: the
        per-layer budgets grow with the sequence (never shrink)."""
        floor = math.ceil(cache.num_tokens / self.ratio)
        cache.budgets = [max(budget, floor) for budget in cache.budgets]
        return cache.budgets
