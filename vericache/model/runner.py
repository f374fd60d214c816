"""ModelRunner: batched forwards of a Llama-family model over explicit KV caches.

One forward serves many sequences with different cache lengths: their new tokens are concatenated
into one [N, hidden] batch for the linear layers, and attention runs per sequence over its own
cache (sequence_attention.py). Caches are owned by the caller; the forward appends the new tokens'
KV to them.

With static shapes (static_forward.py; on by default on CUDA), a forward whose sequences fit a
bucket runs over preallocated buffers, captured once per bucket in a CUDA graph and replayed; on
CPU the same static forward runs eagerly. Either way its exact rows (verifications, full decode
steps) have this forward's bits.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from vericache.kernels import cpu_attention, triton_ops
from vericache.kv.cache import KVCache
from vericache.kv.pool import BufferPool
from vericache.model.config import ModelConfig
from vericache.model.kernels import rms_norm, silu
from vericache.model.linear import zero_row
from vericache.model.rope import RotaryEmbedding
from vericache.model.sequence_attention import LayerKVAccess, SequenceAttention
from vericache.model.static_forward import CaptureFailed, StaticForward
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
    def __init__(
        self,
        config: ModelConfig,
        weights: ModelWeights,
        device="cpu",
        static_shapes: bool | None = None,
    ):
        self.config = config
        self.weights = weights
        self.device = torch.device(device)
        self.dtype = weights.embed.dtype
        self.rope = RotaryEmbedding(
            config.rope, config.head_dim, config.max_position_embeddings, self.device, self.dtype
        )
        c = config
        self._cpu_kernel = cpu_attention.accepts(self.device, self.dtype, config.head_dim)
        self._qkv_split = [
            c.num_heads * c.head_dim,
            c.num_kv_heads * c.head_dim,
            c.num_kv_heads * c.head_dim,
        ]
        # oneDNN runs a lone row on another path than two: a batch-invariant forward of one
        # token carries a spare zero row.
        self._pads_lone_invariant_row = weights.layers[0].qkv.pads_lone_row(weights.embed[:1], True)
        if static_shapes is None:
            static_shapes = _static_by_default(self.device)
        self.static = StaticForward(self) if static_shapes else None

    def new_cache(self, capacity: int = 0, pool: BufferPool | None = None) -> KVCache:
        c = self.config
        return KVCache.empty(
            c.num_layers, c.num_kv_heads, c.head_dim, self.dtype, self.device, capacity, pool
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
        split = self.static.split(batch, invariant) if self.static is not None else None
        if split is None:
            return self.forward_dynamic(batch, invariant)
        # Those it serves in a static forward, the others in a dynamic one beside it.
        logits: list[torch.Tensor | None] = [None] * len(batch)
        try:
            static_logits = self.static.forward([batch[i] for i in split.chosen], split)
        except CaptureFailed:  # the caches are as before: all of it dynamic
            return self.forward_dynamic(batch, invariant)
        if len(split.chosen) == len(batch):
            return static_logits
        for i, rows in zip(split.chosen, static_logits):
            logits[i] = rows
        rest = [i for i in range(len(batch)) if logits[i] is None]
        for i, rows in zip(rest, self.forward_dynamic([batch[i] for i in rest], invariant)):
            logits[i] = rows
        return logits

    def forward_dynamic(self, batch: list[SequenceInput], invariant: bool) -> list[torch.Tensor]:
        """`forward` for any batch, shapes as they come (never static)."""
        counts = [int(seq.token_ids.numel()) for seq in batch]
        token_ids = self._joined([seq.token_ids for seq in batch])  # [N]
        positions = self._joined(
            [
                torch.arange(s.cache.num_tokens, s.cache.num_tokens + n)
                for s, n in zip(batch, counts)
            ]
        )  # [N]
        num_rows = self.rows_for(len(positions), invariant)
        if num_rows > len(positions):
            positions = positions.repeat(2)  # the spare row's: any position serves
        spans, start = [], 0
        for n in counts:
            spans.append((start, start + n))
            start += n
        kv = SequenceAttention(self, batch, spans, positions, invariant, num_rows)
        hidden = self.layers(self.embed(token_ids, num_rows), positions, kv, invariant)
        for seq, n in zip(batch, counts):
            seq.cache.advance(n)
        return self._logits(hidden, batch, counts, invariant)

    @contextlib.contextmanager
    def dynamic_only(self):
        """Inside the block every forward is dynamic: the baseline a benchmark compares static
        forwards with, in the same process."""
        static, self.static = self.static, None
        try:
            yield
        finally:
            self.static = static

    def rows_for(self, num_tokens: int, invariant: bool) -> int:
        """Rows a forward of num_tokens tokens computes: a batch-invariant lone row gets a spare
        zero row that every product carries (rows are computed apart): one pad a forward and
        one a layer, where each product would pad its own lone row."""
        lone = num_tokens == 1 and invariant and self._pads_lone_invariant_row
        return 2 if lone else num_tokens

    def embed(self, token_ids: torch.Tensor, num_rows: int) -> torch.Tensor:
        """[num_rows, hidden]: the tokens' embeddings, then zero rows up to num_rows."""
        hidden = self.weights.embed[token_ids]  # [N, hidden]
        if num_rows > hidden.shape[0]:
            hidden = torch.cat([hidden, zero_row(hidden)])  # [2, hidden]
        return hidden

    def layers(
        self, hidden: torch.Tensor, positions: torch.Tensor, kv: LayerKVAccess, invariant: bool
    ) -> torch.Tensor:
        """Every decoder layer over hidden [R, hidden] at positions [R], the KV through `kv`."""
        cos, signed_sin = (t.unsqueeze(1) for t in self.rope.angles(positions))  # [R, 1, D] each
        for index, layer in enumerate(self.weights.layers):
            hidden = self._layer(index, layer, hidden, (cos, signed_sin), kv, invariant)
        return hidden

    def _layer(self, index, layer, hidden, angles, kv: LayerKVAccess, invariant) -> torch.Tensor:
        c = self.config
        x = rms_norm(hidden, layer.input_norm, c.rms_norm_eps, invariant)
        q, k, v = self._rotated_qkv(layer, x, angles, invariant)
        kv.store(index, k, v)
        hidden = hidden + layer.o_proj(kv.attend(index, q), invariant)
        x = rms_norm(hidden, layer.post_attention_norm, c.rms_norm_eps, invariant)
        gate, up = layer.gate_up(x, invariant).chunk(2, dim=-1)
        return hidden + layer.down(silu(gate) * up, invariant)

    def _rotated_qkv(self, layer, x, angles, invariant) -> tuple[torch.Tensor, ...]:
        """The layer's queries [N, Hq, D] and keys [N, Hkv, D], rotated, and values
        [N, Hkv, D]. Queries and keys lie side by side in the product's rows: without a norm
        of their own between, one rotation turns them both (views of its result)."""
        c = self.config
        qkv = layer.qkv(x, invariant)  # [N, (Hq + 2 Hkv) D]
        num_qk_heads = c.num_heads + c.num_kv_heads
        v = qkv[:, num_qk_heads * c.head_dim :].view(-1, c.num_kv_heads, c.head_dim)
        if c.qk_norm:
            q, k, _ = qkv.split(self._qkv_split, dim=-1)
            q = rms_norm(
                q.view(-1, c.num_heads, c.head_dim), layer.q_norm, c.rms_norm_eps, invariant
            )
            k = rms_norm(
                k.view(-1, c.num_kv_heads, c.head_dim), layer.k_norm, c.rms_norm_eps, invariant
            )
            return self.rope.turn(q, *angles), self.rope.turn(k, *angles), v
        qk = qkv[:, : num_qk_heads * c.head_dim].view(-1, num_qk_heads, c.head_dim)
        qk = self.rope.turn(qk, *angles)
        return qk[:, : c.num_heads], qk[:, c.num_heads :], v

    def _joined(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """The sequences' parts in one tensor on the device (a lone part as it is: each operator
        spared is host time spared, every step)."""
        joined = parts[0] if len(parts) == 1 else torch.cat(parts)
        return joined if joined.device == self.device else joined.to(self.device)

    def _logits(self, hidden, batch, counts, invariant) -> list[torch.Tensor]:
        # [rows, hidden]: every row's logits are wanted (decode steps; a spare row's are cut)
        selected = hidden
        if any(seq.num_logits != n for seq, n in zip(batch, counts)):
            rows, start = [], 0
            for seq, n in zip(batch, counts):
                rows.append(torch.arange(start + n - seq.num_logits, start + n))
                start += n
            selected = hidden[self._joined(rows)]
        if selected.shape[0] == 0:
            return [
                selected.new_empty(0, self.config.vocab_size, dtype=torch.float32) for _ in batch
            ]
        logits = self.head(selected, invariant)
        if logits.shape[0] > sum(counts):
            return [logits[: counts[0]]]  # the spare row's cut
        return list(logits.split([seq.num_logits for seq in batch]))

    def head(self, hidden: torch.Tensor, invariant: bool) -> torch.Tensor:
        """float32 logits [R, vocab] of the final hidden states [R, hidden]."""
        normed = rms_norm(hidden, self.weights.final_norm, self.config.rms_norm_eps, invariant)
        return self.weights.lm_head(normed.float(), invariant)

    def prefill(
        self,
        token_ids: torch.Tensor,
        cache: KVCache,
        num_logits: int = 1,
        chunk_size: int = DEFAULT_PREFILL_CHUNK,
        invariant: bool | None = None,
    ) -> torch.Tensor:
        """Appends a long run of tokens chunk by chunk (bounded memory).

        Into a full cache by the batch-invariant kernels (unless `invariant` says otherwise): a
        token's full KV is then the same bits however it was computed, in a prefill chunk of any
        size or by a decode step or a verification, so a session reopened elsewhere over its
        history (a migration, a warm node, a later turn) holds what full-KV decoding held.
        Measured on CPU, the invariant set also prefills faster (1.4 s against 3.0 s for 1024
        tokens of the embedded model's architecture, one thread). Into compressed KV, which only
        drafts read, by the fast kernels.

        Returns float32 logits [num_logits, vocab] of the last `num_logits` tokens."""
        if invariant is None:
            invariant = cache.is_full
        total = token_ids.numel()
        logits = []
        for start in range(0, total, chunk_size):
            chunk = token_ids[start : start + chunk_size]
            wanted = max(0, min(chunk.numel(), start + chunk.numel() - (total - num_logits)))
            logits += self.forward([SequenceInput(chunk, cache, wanted)], invariant=invariant)
        return torch.cat(logits)


def _static_by_default(device: torch.device) -> bool:
    """Static forwards where nothing asks otherwise: on CUDA, with Triton. VERICACHE_STATIC_SHAPES=1
    (or 0) says so for every runner of a process: the whole test suite over static forwards on
    CPU."""
    setting = os.environ.get("VERICACHE_STATIC_SHAPES")
    if setting is not None:
        return setting == "1"
    return device.type == "cuda" and triton_ops.available()  # its KV kernels are Triton's
