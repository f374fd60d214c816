"""A token dropper followed by a quantizer, as one compressor: `snapkv+kivi` keeps the tokens
SnapKV keeps, then stores them as KIVI stores a cache, so its share of the full KV's bytes is the
product of the two (`--compressor snapkv+kivi --ratio 4 --bits 4`: about 1/4 x 1/4).

The dropper runs first, over the prefix's full KV (with the model, where it scores tokens); the
quantizer then packs the kept slots in whole groups, each head's at its own positions
(kv/quantized.py keeps positions per head). The kept slots are not held back in the quantizer's
full-precision residual window, as a quantizer alone holds a prefix's newest tokens: a dropper
keeps a few hundred slots of a few thousand tokens, which a 128-token window would leave mostly
unquantized, and it keeps the prefix's last tokens itself (SnapKV's observation window). Tokens
that come after the prefix are the quantizer's: they wait at full precision until its residual
window fills, then are quantized. Only droppers that choose their
tokens once (offline: SnapKV, PyramidKV, KVzip) compose: an online dropper evicts single tokens as
decoding goes on, which packed groups of quantized tokens cannot give up. The kept slots are
quantized, so a dropper's 16-bit storage (`dtype`) does not apply.

Its name joins the parts' with `+` and its parameters are both parts' (no part takes another's),
so `spec()` rebuilds it through `build_compressor` and the KV codec carries it as any other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from vericache.compress.base import CompressionKind, CompressionMode, Compressor, TokenDropping
from vericache.compress.kivi import KIVI
from vericache.errors import InvalidRequestError
from vericache.kv.cache import KVCache
from vericache.kv.compressed import CompressedKV

SEPARATOR = "+"


@dataclass(frozen=True)
class Composed(Compressor):
    kind: ClassVar[CompressionKind] = CompressionKind.COMPOSED
    mode: ClassVar[CompressionMode] = CompressionMode.ONLINE  # the quantizer's flushes

    dropper: TokenDropping
    quantizer: KIVI  # KIVI or KVQuant

    def __post_init__(self):
        if not isinstance(self.dropper, TokenDropping) or not isinstance(self.quantizer, KIVI):
            kinds = f"{self.dropper.kind.value} and {self.quantizer.kind.value}"
            raise InvalidRequestError(
                f"{self.dropper.name}{SEPARATOR}{self.quantizer.name} composes {kinds}: a "
                f"composed compressor is a token dropper then a quantizer ({composable()})"
            )
        if self.dropper.mode is not CompressionMode.OFFLINE:
            raise InvalidRequestError(
                f"{self.dropper.name} evicts tokens while decoding, which quantized groups "
                f"cannot give up: {composable()}"
            )
        if self.dropper.dtype is not None:
            raise InvalidRequestError(
                f"{self.name} quantizes the kept slots: a 16-bit dtype does not apply"
            )

    @property
    def name(self) -> str:  # type: ignore[override] - a composition's name is its parts'
        return f"{self.dropper.name}{SEPARATOR}{self.quantizer.name}"

    @property
    def label(self) -> str:
        return f"{self.dropper.label}{SEPARATOR}{self.quantizer.label}"

    @property
    def params(self) -> dict:
        return self.dropper.params | self.quantizer.params

    @property
    def kept_token_ratio(self) -> float:
        return self.dropper.ratio

    @property
    def is_steerable(self) -> bool:
        """Steered as its dropper is, its KIVI groups quantized again (compress/steering.py)."""
        return self.dropper.is_steerable and self.quantizer.regroups

    @property
    def steers_by_default(self) -> bool:
        """Not by default: steering snapkv+kivi every round (4x and 8x, x=30, whole rounds,
        10 code and 10 tool prompts of 3-4k tokens) gave -1% and +2% on code and tools
        (bench/results/acceptance_steering_composed.json), where SnapKV alone gains 7-10%, and a
        remote drafter's refresh carries its kept groups whole."""
        return False

    @property
    def observation_window(self) -> int:
        return self.dropper.observation_window

    @property
    def storage_dtype(self) -> None:
        return None  # the kept slots are quantized

    def compress(self, full: KVCache, context=None) -> CompressedKV:
        kept = self.dropper.compress(full, context)
        quantized = self.quantizer.compress(kept, context)
        for layer in quantized.layers:
            layer.flush(0)  # every whole group of the kept slots
        return CompressedKV(quantized.layers, full.num_tokens, self)

    def update(self, cache: CompressedKV) -> None:
        self.quantizer.update(cache)


def composable() -> str:
    """Which compressors compose, for errors."""
    from vericache.compress.registry import COMPRESSORS

    droppers = sorted(
        name
        for name, cls in COMPRESSORS.items()
        if cls.kind is CompressionKind.TOKEN_DROPPING and cls.mode is CompressionMode.OFFLINE
    )
    quantizers = sorted(
        name for name, cls in COMPRESSORS.items() if cls.kind is CompressionKind.QUANTIZATION
    )
    return f"droppers: {', '.join(droppers)}; quantizers: {', '.join(quantizers)}"
