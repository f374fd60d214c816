"""Reading Hugging Face Llama-family weights into fused tensors.

q/k/v projections are fused into one matrix and gate/up into another, so a layer runs four matrix
multiplications. The LM head is kept in float32 whatever the model dtype: logits are always
computed in float32 (greedy choices must not depend on low-precision rounding of the last layer).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from vericache.errors import ModelNotFoundError, UnsupportedModelError
from vericache.model.config import ModelConfig
from vericache.model.linear import Linear


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    qkv: Linear  # hidden -> (Hq + 2 Hkv) * D
    q_norm: torch.Tensor | None  # [D] (Qwen3)
    k_norm: torch.Tensor | None  # [D] (Qwen3)
    o_proj: Linear  # Hq * D -> hidden
    post_attention_norm: torch.Tensor  # [hidden]
    gate_up: Linear  # hidden -> 2 * intermediate
    down: Linear  # intermediate -> hidden


@dataclass
class ModelWeights:
    embed: torch.Tensor  # [vocab, hidden]
    layers: list[LayerWeights]
    final_norm: torch.Tensor  # [hidden]
    lm_head: Linear  # hidden -> vocab, float32

    @property
    def nbytes(self) -> int:
        parts = [self.embed, self.final_norm, self.lm_head]
        for layer in self.layers:
            parts += [part for part in vars(layer).values() if part is not None]
        return sum(part.nbytes for part in parts)


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory: safetensors (single or sharded) or pytorch .bin."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        state: dict[str, torch.Tensor] = {}
        for shard in shards:
            state.update(load_file(path / shard))
        return state
    if (path / "model.safetensors").is_file():
        return load_file(path / "model.safetensors")
    if (path / "pytorch_model.bin").is_file():
        return torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise ModelNotFoundError(f"no model.safetensors or pytorch_model.bin in {path}")


def build_weights(
    config: ModelConfig, state: dict[str, torch.Tensor], dtype, device
) -> ModelWeights:
    state = {name.removeprefix("model."): tensor for name, tensor in state.items()}

    def take(name: str) -> torch.Tensor:
        if name not in state:
            raise UnsupportedModelError(f"checkpoint lacks tensor {name!r}")
        return state[name].to(device=device, dtype=dtype)

    def fused(names: list[str], with_bias: bool) -> Linear:
        weight = torch.cat([take(name + ".weight") for name in names])
        bias = torch.cat([take(name + ".bias") for name in names]) if with_bias else None
        return Linear(weight, bias)

    layers = []
    for i in range(config.num_layers):
        attn, mlp = f"layers.{i}.self_attn.", f"layers.{i}.mlp."
        qkv = [f"{attn}{p}_proj" for p in "qkv"]
        gate_up = [mlp + "gate_proj", mlp + "up_proj"]
        layers.append(
            LayerWeights(
                input_norm=take(f"layers.{i}.input_layernorm.weight"),
                qkv=fused(qkv, config.qkv_bias),
                q_norm=take(attn + "q_norm.weight") if config.qk_norm else None,
                k_norm=take(attn + "k_norm.weight") if config.qk_norm else None,
                o_proj=fused([attn + "o_proj"], config.o_bias),
                post_attention_norm=take(f"layers.{i}.post_attention_layernorm.weight"),
                gate_up=fused(gate_up, config.mlp_bias),
                down=fused([mlp + "down_proj"], config.mlp_bias),
            )
        )
    # Tied checkpoints store the shared matrix once, under either name.
    if "embed_tokens.weight" not in state and config.tie_word_embeddings:
        state["embed_tokens.weight"] = state.get("lm_head.weight")
    if "lm_head.weight" not in state or config.tie_word_embeddings:
        state["lm_head.weight"] = state["embed_tokens.weight"]
    lm_head = Linear(state["lm_head.weight"].to(device=device, dtype=torch.float32))
    return ModelWeights(
        embed=take("embed_tokens.weight"),
        layers=layers,
        final_norm=take("norm.weight"),
        lm_head=lm_head,
    )
