"""ModelRunner: batched forwards of a Llama-family model over explicit KV caches.

One forward serves many sequences with different cache lengths: their new tokens are concatenated
into one [N, hidden] batch for the linear layers, and attention runs per sequence over its own
cache (on CPU the one-token sequences of a draft step share one call: kernels/cpu_decode.py).
Caches are owned by the caller; the forward appends the new tokens' KV to them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from vericache.kernels import cpu_decode
from vericache.kv.cache import KVCache
from vericache.model.config import ModelConfig
from vericache.model.kernels import KEY_ALIGN, attention, rms_norm, silu
from vericache.model.rope import RotaryEmbedding
from vericache.model.weights import ModelWeights

DEFAULT_PREFILL_CHUNK = 512


@dataclass
class SequenceInput:
    """One sequence's share of a batched forward."""

    token_ids: torch.Tensor  # [n] int64, the tokens after the cache's num_tokens
    cache: KVCache
    num_logits: int = 1  # logits wanted for the last `num_logits` of the n tokens
    # Called per layer with (layer index, positions [n], rotated queries [n, Hq, D], layer KV):
    # how compressors score tokens by the attention they receive.
    observe: Callable | None = None
    # Attention by the fast kernels even in a batch-invariant forward: a draft step shares a
    # forward (and one read of the weights) with verifications, and needs no exactness.
    fast_attention: bool = False


class ModelRunner:
    def __init__(self, config: ModelConfig, weights: ModelWeights, device="cpu"):
        self.config = config
        self.weights = weights
        self.device = torch.device(device)
        self.dtype = weights.embed.dtype
        self.rope = RotaryEmbedding(
            config.rope, config.head_dim, config.max_position_embeddings, self.device, self.dtype
        )
        c = config
        self._cpu_decode_kernel = cpu_decode.accepts(self.device, self.dtype, config.head_dim)
        self._qkv_split = [
            c.num_heads * c.head_dim,
            c.num_kv_heads * c.head_dim,
            c.num_kv_heads * c.head_dim,
        ]

    def new_cache(self, capacity: int = 0) -> KVCache:
        c = self.config
        return KVCache.empty(
            c.num_layers, c.num_kv_heads, c.head_dim, self.dtype, self.device, capacity
        )

    # no_grad, not inference_mode: caches outlive the forward and compressors edit them in place.
    @torch.no_grad()
    def forward(self, batch: list[SequenceInput], invariant: bool = False) -> list[torch.Tensor]:
        """Runs the new tokens of every sequence; float32 logits [num_logits, vocab] for each."""
        counts = [int(seq.token_ids.numel()) for seq in batch]
        if min(counts) < 1:
            raise ValueError("every sequence in a forward needs at least one new token")
        last = max(seq.cache.num_tokens + n for seq, n in zip(batch, counts))
        if last > self.config.max_position_embeddings:
            raise ValueError(
                f"position {last} exceeds the model's {self.config.max_position_embeddings}"
            )
        token_ids = torch.cat([seq.token_ids for seq in batch]).to(self.device)
        positions = torch.cat(
            [
                torch.arange(s.cache.num_tokens, s.cache.num_tokens + n)
                for s, n in zip(batch, counts)
            ]
        ).to(self.device)
        hidden = self.weights.embed[token_ids]  # [N, hidden]
        for index, layer in enumerate(self.weights.layers):
            hidden = self._layer(index, layer, hidden, positions, batch, counts, invariant)
        for seq, n in zip(batch, counts):
            seq.cache.advance(n)
        return self._logits(hidden, batch, counts, invariant)

    def _layer(self, index, layer, hidden, positions, batch, counts, invariant) -> torch.Tensor:
        c = self.config
        x = rms_norm(hidden, layer.input_norm, c.rms_norm_eps, invariant)
        q, k, v = layer.qkv(x, invariant).split(self._qkv_split, dim=-1)
        q = q.view(-1, c.num_heads, c.head_dim)  # [N, Hq, D]
        k = k.view(-1, c.num_kv_heads, c.head_dim)  # [N, Hkv, D]
        v = v.view(-1, c.num_kv_heads, c.head_dim)  # [N, Hkv, D]
        if c.qk_norm:
            q = rms_norm(q, layer.q_norm, c.rms_norm_eps, invariant)
            k = rms_norm(k, layer.k_norm, c.rms_norm_eps, invariant)
        q, k = self.rope(q, positions), self.rope(k, positions)
        outputs: list[torch.Tensor | None] = []
        # Sequences left to the batched CPU decode kernel: their outputs index, q row and layer.
        one_token_outputs, one_token_rows, one_token_layers = [], [], []
        window = c.layer_windows[index]
        start = 0
        for seq, n in zip(batch, counts):
            end = start + n
            layer_kv = seq.cache.layers[index]
            layer_kv.append(k[start:end], v[start:end], positions[start:end])
            if seq.observe is not None:
                seq.observe(index, positions[start:end], q[start:end], layer_kv)
            window_mask = None
            # The window only hides keys once the newest token is `window` positions in.
            if window is not None and seq.cache.num_tokens + n > window:
                window_mask = _window_mask(window, layer_kv.positions(), positions[start:end])
            exact = invariant and not seq.fast_attention
            if n == 1 and window_mask is None and self._batches_decode(layer_kv, exact):
                one_token_outputs.append(len(outputs))
                one_token_rows.append(start)
                one_token_layers.append(layer_kv)
                outputs.append(None)
            else:
                outputs.append(_attend(layer_kv, q[start:end], window_mask, exact))
            start = end
        if one_token_rows:
            attended = _attend_one_token_batch(q[one_token_rows], one_token_layers)
            for i, row in zip(one_token_outputs, attended):
                outputs[i] = row.unsqueeze(0)
        hidden = hidden + layer.o_proj(torch.cat(outputs), invariant)
        x = rms_norm(hidden, layer.post_attention_norm, c.rms_norm_eps, invariant)
        gate, up = layer.gate_up(x, invariant).chunk(2, dim=-1)
        return hidden + layer.down(silu(gate) * up, invariant)

    def _batches_decode(self, layer_kv, exact: bool) -> bool:
        """Whether a one-token sequence joins the batched CPU decode kernel: drafting only (the
        batch-invariant set has its own attention) and over full-precision slots."""
        return (
            not exact and self._cpu_decode_kernel and not getattr(layer_kv, "attends_packed", False)
        )

    def _logits(self, hidden, batch, counts, invariant) -> list[torch.Tensor]:
        rows, start = [], 0
        for seq, n in zip(batch, counts):
            rows.append(torch.arange(start + n - seq.num_logits, start + n))
            start += n
        selected = hidden[torch.cat(rows).to(self.device)]
        if selected.shape[0] == 0:
            return [
                selected.new_empty(0, self.config.vocab_size, dtype=torch.float32) for _ in batch
            ]
        normed = rms_norm(selected, self.weights.final_norm, self.config.rms_norm_eps, invariant)
        logits = self.weights.lm_head(normed.float(), invariant)
        return list(logits.split([seq.num_logits for seq in batch]))

    def prefill(
        self,
        token_ids: torch.Tensor,
        cache: KVCache,
        num_logits: int = 1,
        chunk_size: int = DEFAULT_PREFILL_CHUNK,
    ) -> torch.Tensor:
        """Appends a long run of tokens chunk by chunk (bounded memory).

        Returns float32 logits [num_logits, vocab] of the last `num_logits` tokens."""
        total = token_ids.numel()
        logits = []
        for start in range(0, total, chunk_size):
            chunk = token_ids[start : start + chunk_size]
            wanted = max(0, min(chunk.numel(), start + chunk.numel() - (total - num_logits)))
            logits += self.forward([SequenceInput(chunk, cache, wanted)])
        return torch.cat(logits)


def _attend(layer_kv, q: torch.Tensor, window_mask, invariant: bool) -> torch.Tensor:
    """q [n, Hq, D] of the layer's newest n slots -> [n, Hq * D]."""
    if not invariant and getattr(layer_kv, "attends_packed", False):
        # A quantized layer dequantizes block by block inside attention (fused on CUDA).
        return layer_kv.attend(q, window_mask)
    keys, values = layer_kv.keys_values(pad_to=KEY_ALIGN if invariant else 1)
    return attention(q, keys, values, layer_kv.num_slots, invariant, window_mask)


def _attend_one_token_batch(q: torch.Tensor, layers: list) -> torch.Tensor:
    """q [B, Hq, D], one new token per sequence, each over its layer in `layers`, in one kernel
    call -> [B, Hq * D]."""
    keys, values = zip(*(layer_kv.keys_values() for layer_kv in layers))
    return cpu_decode.decode_attention(q, list(keys), list(values)).flatten(1)


def _window_mask(window: int, key_positions: torch.Tensor, query_positions: torch.Tensor):
    """[Hkv, n, slots] bool: key_positions [slots, Hkv] within `window` of query_positions [n]."""
    return key_positions.T.unsqueeze(1) > (query_positions.view(1, -1, 1) - window)
