"""Architecture settings of a Llama-family checkpoint, read from its config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vericache.errors import ModelNotFoundError, UnsupportedModelError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED_ROPE_TYPES = ("default", "llama3")


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"
    # llama3 scaling (Llama 3.1+): long wavelengths are divided by `factor`, with a smooth band.
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(
                f"RoPE type {self.rope_type!r} is not supported (supported: {SUPPORTED_ROPE_TYPES})"
            )


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool  # per-head RMSNorm of q and k before RoPE (Qwen3)
    layer_windows: tuple[int | None, ...]  # sliding-window size per layer; None: full attention
    eos_token_ids: tuple[int, ...]

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"{self.num_heads} query heads are not a multiple of {self.num_kv_heads} KV heads"
            )

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    def kv_bytes_per_token(self, element_size: int) -> int:
        """Bytes of keys and values one token occupies across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element_size

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        config_file = Path(path) / "config.json"
        if not config_file.is_file():
            raise ModelNotFoundError(f"no config.json in {path}: not a Hugging Face checkpoint")
        raw = json.loads(config_file.read_text())
        generation_file = Path(path) / "generation_config.json"
        generation = json.loads(generation_file.read_text()) if generation_file.is_file() else {}
        return cls.from_hf(raw, generation)

    @classmethod
    def from_hf(cls, raw: dict[str, Any], generation: dict[str, Any] | None = None) -> ModelConfig:
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {model_type!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        if raw.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"activation {raw['hidden_act']!r} is not supported")
        num_heads = raw["num_attention_heads"]
        attention_bias = bool(raw.get("attention_bias", False))
        return cls(
            model_type=model_type,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope=_rope_config(raw),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            # As transformers builds them: Qwen2 biases q/k/v only, always; Llama and Qwen3 bias
            # all four projections when attention_bias is set.
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=model_type != "qwen2" and attention_bias,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            layer_windows=_layer_windows(model_type, raw),
            eos_token_ids=_eos_ids(raw, generation or {}),
        )


def _layer_windows(model_type: str, raw: dict[str, Any]) -> tuple[int | None, ...]:
    num_layers, window = raw["num_hidden_layers"], raw.get("sliding_window")
    if model_type == "llama" or window is None:
        return (None,) * num_layers
    if "layer_types" in raw:
        return tuple(window if kind == "sliding_attention" else None for kind in raw["layer_types"])
    if model_type == "mistral":
        return (window,) * num_layers
    # Qwen2/Qwen3: the window is opt-in and spares the first max_window_layers layers.
    if not raw.get("use_sliding_window", False):
        return (None,) * num_layers
    first = raw.get("max_window_layers", num_layers)
    return tuple(window if index >= first else None for index in range(num_layers))


def _rope_config(raw: dict[str, Any]) -> RopeConfig:
    # transformers >= 5 writes `rope_parameters` (theta inside); older files have `rope_theta`
    # and an optional `rope_scaling` dict.
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "llama3":
        return RopeConfig(theta=float(theta), rope_type=rope_type)
    return RopeConfig(
        theta=float(theta),
        rope_type="llama3",
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
    )


def _eos_ids(raw: dict[str, Any], generation: dict[str, Any]) -> tuple[int, ...]:
    ids: list[int] = []
    for source in (generation.get("eos_token_id"), raw.get("eos_token_id")):
        for token_id in source if isinstance(source, list) else [source]:
            if token_id is not None and token_id not in ids:
                ids.append(int(token_id))
    return tuple(ids)
