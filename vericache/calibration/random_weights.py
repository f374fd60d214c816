"""The engine's model runner over random weights of a model profile's shapes: what `vericache
calibrate` times, since no weights of a 24-70B model are on the device (or may be fetched)."""

from __future__ import annotations

import torch

from vericache.model.config import ModelConfig, RopeConfig
from vericache.model.linear import Linear
from vericache.model.runner import ModelRunner
from vericache.model.weights import LayerWeights, ModelWeights
from vericache.sim.profiles import ModelProfile


def random_runner(model: ModelProfile, num_layers: int, device, dtype) -> ModelRunner:
    """The engine's model runner over random weights of `model`'s shapes, `num_layers` deep."""
    config = ModelConfig(
        model_type="llama", vocab_size=model.vocab_size, hidden_size=model.hidden_size,
        intermediate_size=model.intermediate_size, num_layers=num_layers,
        num_heads=model.num_heads, num_kv_heads=model.num_kv_heads, head_dim=model.head_dim,
        max_position_embeddings=131072, rms_norm_eps=1e-5, rope=RopeConfig(theta=500000.0),
        tie_word_embeddings=False, qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False,
        layer_windows=(None,) * num_layers, eos_token_ids=(0,),
    )  # fmt: skip
    ones = torch.ones(model.hidden_size, device=device, dtype=dtype)
    layers = [random_layer(model, device, dtype) for _ in range(num_layers)]
    embed = torch.randn(model.vocab_size, model.hidden_size, device=device).to(dtype)
    head = _linear(model.vocab_size, model.hidden_size, device, torch.float32)
    return ModelRunner(config, ModelWeights(embed, layers, ones, head), device)


def random_layer(model: ModelProfile, device, dtype) -> LayerWeights:
    """One decoder layer of random weights of `model`'s shapes, its products fused as the engine
    runs them (QKV, and gate with up)."""
    h, i = model.hidden_size, model.intermediate_size
    q, kv = model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim
    ones = torch.ones(h, device=device, dtype=dtype)
    return LayerWeights(
        input_norm=ones,
        qkv=_linear(q + 2 * kv, h, device, dtype),
        q_norm=None,
        k_norm=None,
        o_proj=_linear(h, q, device, dtype),
        post_attention_norm=ones,
        gate_up=_linear(2 * i, h, device, dtype),
        down=_linear(h, i, device, dtype),
    )


def _linear(out_features: int, in_features: int, device, dtype) -> Linear:
    weight = torch.randn(out_features, in_features, device=device) * in_features**-0.5
    return Linear(weight.to(dtype))


def filled_cache(runner: ModelRunner, context: int, room: int):
    """A cache holding `context` tokens of random KV (attention costs the same whatever they
    hold)."""
    cache = runner.new_cache(capacity=context + room)
    config = runner.config
    shape = (context, config.num_kv_heads, config.head_dim)  # [T, H, D]
    positions = torch.arange(context, dtype=torch.int32, device=runner.device)
    for layer in cache.layers:
        keys = torch.randn(shape, device=runner.device).to(runner.dtype)
        layer.append(keys, keys.clone(), positions)
    cache.advance(context)
    return cache
