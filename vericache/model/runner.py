"""ModelRunner: batched forwards of a Llama-family model over explicit KV caches.

One forward serves many sequences with different cache lengths: their new tokens are concatenated
into one [N, hidden] batch for the linear layers, and attention runs per sequence over its own
cache (on CPU the sequences of a layer share one call of vericache/kernels/cpu_attention.py:
every exact sequence, and every one-token draft step; on CUDA those over one shared prefix share
one cascade call, which reads the prefix once for all of them).
Caches are owned by the caller; the forward appends the new tokens' KV to them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from vericache.kernels import cpu_attention
from vericache.kv.cache import KVCache
from vericache.kv.pool import BufferPool
from vericache.kv.prefixed import PrefixedLayerKV
from vericache.model.config import ModelConfig
from vericache.model.kernels import (
    attention,
    attention_over_shared_prefix,
    key_alignment,
    reads_shared_prefix,
    rms_norm,
    silu,
)
from vericache.model.linear import zero_row
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
        self._cpu_kernel = cpu_attention.accepts(self.device, self.dtype, config.head_dim)
        self._qkv_split = [
            c.num_heads * c.head_dim,
            c.num_kv_heads * c.head_dim,
            c.num_kv_heads * c.head_dim,
        ]

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
        token_ids = self._joined([seq.token_ids for seq in batch])  # [N]
        positions = self._joined(
            [
                torch.arange(s.cache.num_tokens, s.cache.num_tokens + n)
                for s, n in zip(batch, counts)
            ]
        )  # [N]
        hidden = self.weights.embed[token_ids]  # [N, hidden]
        if self.weights.layers[0].qkv.pads_lone_row(hidden, invariant):
            # A spare zero row that every product carries (rows are computed apart): one pad a
            # forward and one a layer, where each product would pad its own lone row.
            hidden = torch.cat([hidden, zero_row(hidden)])  # [2, hidden]
            positions = positions.repeat(2)  # the spare row's: any position serves
        cos, signed_sin = (t.unsqueeze(1) for t in self.rope.angles(positions))  # [N, 1, D] each
        for index, layer in enumerate(self.weights.layers):
            hidden = self._layer(
                index, layer, hidden, positions, (cos, signed_sin), batch, counts, invariant
            )
        for seq, n in zip(batch, counts):
            seq.cache.advance(n)
        return self._logits(hidden, batch, counts, invariant)

    def _layer(
        self, index, layer, hidden, positions, angles, batch, counts, invariant
    ) -> torch.Tensor:
        c = self.config
        x = rms_norm(hidden, layer.input_norm, c.rms_norm_eps, invariant)
        q, k, v = self._rotated_qkv(layer, x, angles, invariant)
        self._append(index, batch, counts, k, v, positions)
        attended = self._attention(index, q, positions, batch, counts, invariant, hidden.shape[0])
        hidden = hidden + layer.o_proj(attended, invariant)
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

    def _attention(
        self, index, q, positions, batch, counts, invariant, num_rows: int
    ) -> torch.Tensor:
        """Every sequence's attention in layer `index` over its cache, which holds its new
        tokens already: q [N, Hq, D] -> [num_rows, Hq * D] (a spare zero row after the N where
        the forward carries one). Sequences that one kernel call serves
        together wait for it: on CPU those `_uses_cpu_kernel` picks, on CUDA those over one
        shared prefix (read once for all their rows)."""
        window = self.config.layer_windows[index]
        outputs: list[torch.Tensor | None] = [None] * len(batch)
        cpu_kernel: list[tuple[int, tuple[int, int], object]] = []  # (output, rows, layer)
        by_prefix: dict[tuple[int, int], list[tuple[int, tuple[int, int], object]]] = {}
        start = 0
        for i, (seq, n) in enumerate(zip(batch, counts)):
            end = start + n
            layer_kv = seq.cache.layers[index]
            if seq.observe is not None:
                seq.observe(index, positions[start:end], q[start:end], layer_kv)
            window_mask = None
            # The window only hides keys once the newest token is `window` positions in.
            if window is not None and seq.cache.num_tokens + n > window:
                window_mask = _window_mask(window, layer_kv.positions(), positions[start:end])
            row_invariant = invariant and not seq.fast_attention
            if self._uses_cpu_kernel(layer_kv, window, window_mask, n, row_invariant):
                cpu_kernel.append((i, (start, end), layer_kv))
            elif _reads_prefix_apart(layer_kv, q, window_mask, row_invariant):
                shared_keys, _ = layer_kv.shared.keys_values()
                by_prefix.setdefault(_prefix_identity(shared_keys), []).append(
                    (i, (start, end), layer_kv)
                )
            else:
                outputs[i] = _attend(layer_kv, q[start:end], window_mask, row_invariant)
            start = end
        calls = [(_attend_by_cpu_kernel, cpu_kernel)]
        calls += [(_attend_sharing_prefix, group) for group in by_prefix.values()]
        for attend, group in calls:
            if group:
                attended = attend(q, [rows for _, rows, _ in group], [kv for *_, kv in group])
                for (i, _, _), out in zip(group, attended):
                    outputs[i] = out
        if num_rows > start:
            outputs.append(zero_row(outputs[0]))
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs)

    def _append(self, index, batch, counts, k, v, positions) -> None:
        """Appends each sequence's new tokens (k, v: [N, Hkv, D]; positions: [N]) to its cache's
        layer `index`. With the CPU kernel, every dense layer takes them in one store call: a
        draft step of 14 caches spent 257 us per layer appending them one by one, 27 in one call
        (measured), some 7% of the step."""
        stores, start = [], 0
        for seq, n in zip(batch, counts):
            layer_kv = seq.cache.layers[index]
            if self._cpu_kernel and getattr(layer_kv, "is_dense", False):
                stores.append((*layer_kv.reserve(n), start, n))
            else:
                end = start + n
                layer_kv.append(k[start:end], v[start:end], positions[start:end])
            start += n
        if stores:
            cpu_attention.store_kv(k, v, positions, stores)

    def _uses_cpu_kernel(self, layer_kv, window, window_mask, n: int, invariant: bool) -> bool:
        """Whether a sequence's attention in this layer joins the CPU kernel's call (over
        full-precision slots only). Batch-invariant rows: all of them on a layer without a
        sliding window, whatever n, since a token must take the same kernel decoded alone as
        verified among others (the kernel is batch-invariant by construction). Fast rows:
        one-token steps; longer runs (prefill) go to library attention."""
        if not self._cpu_kernel or getattr(layer_kv, "attends_packed", False):
            return False
        return window is None if invariant else n == 1 and window_mask is None

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
        normed = rms_norm(selected, self.weights.final_norm, self.config.rms_norm_eps, invariant)
        logits = self.weights.lm_head(normed.float(), invariant)
        if logits.shape[0] > sum(counts):
            return [logits[: counts[0]]]  # the spare row's cut
        return list(logits.split([seq.num_logits for seq in batch]))

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


def _attend(layer_kv, q: torch.Tensor, window_mask, invariant: bool) -> torch.Tensor:
    """q [n, Hq, D] of the layer's newest n slots -> [n, Hq * D], over one buffer (a prefixed
    layer's two parts copied into one, where `_reads_prefix_apart` does not hold)."""
    if not invariant and getattr(layer_kv, "attends_packed", False):
        # A quantized layer dequantizes block by block inside attention (fused on CUDA).
        return layer_kv.attend(q, window_mask)
    keys, values = layer_kv.keys_values(pad_to=key_alignment(q, invariant))
    return attention(q, keys, values, layer_kv.num_slots, invariant, window_mask)


def _reads_prefix_apart(layer_kv, q: torch.Tensor, window_mask, invariant: bool) -> bool:
    """Whether this attention reads a prefixed layer's shared part in place (the Triton kernel),
    so that sequences over the same prefix can share one read of it."""
    if not isinstance(layer_kv, PrefixedLayerKV) or window_mask is not None:
        return False
    own_keys, _ = layer_kv.own.keys_values()
    return reads_shared_prefix(q, invariant, own_keys.dtype)


def _prefix_identity(shared_keys: torch.Tensor) -> tuple[int, int]:
    """Which copy of a prefix a layer reads, from its shared keys [P, Hkv, D]: their address
    and slots."""
    return shared_keys.data_ptr(), shared_keys.shape[0]


def _attend_sharing_prefix(
    q: torch.Tensor, spans: list[tuple[int, int]], layers: list[PrefixedLayerKV]
) -> list[torch.Tensor]:
    """As `_attend_by_cpu_kernel`, for layers over one shared prefix on CUDA: the kernel reads
    the prefix once for all their rows, then each layer's own slots."""
    own = [(*layer_kv.own.keys_values(), layer_kv.own.num_slots) for layer_kv in layers]
    return attention_over_shared_prefix(q, spans, own, layers[0].shared.keys_values())


def _attend_by_cpu_kernel(
    q: torch.Tensor, spans: list[tuple[int, int]], layers: list
) -> list[torch.Tensor]:
    """The rows start:end of q [N, Hq, D] for each span, over the layer beside it (whose newest
    slots they are), in one kernel call -> [end - start, Hq * D] per span. A prefix that several
    layers share goes to the kernel once, which reads it once for all their rows."""
    if all(prev[1] == span[0] for prev, span in zip(spans, spans[1:])):
        queries = q[spans[0][0] : spans[-1][1]]  # adjacent spans: one slice, no copy
    else:
        queries = torch.cat([q[start:end] for start, end in spans])
    keys, values, prefix_of = [], [], []
    prefixes: list[tuple[torch.Tensor, torch.Tensor]] = []
    prefix_index: dict[tuple[int, int], int] = {}  # (first key's address, slots) -> its index
    for layer_kv in layers:
        own = layer_kv
        if isinstance(layer_kv, PrefixedLayerKV):
            own = layer_kv.own
            shared_keys, shared_values = layer_kv.shared.keys_values()  # [P, Hkv, D]
            where = _prefix_identity(shared_keys)
            if where not in prefix_index:
                prefix_index[where] = len(prefixes)
                prefixes.append((shared_keys, shared_values))
        prefix_of.append(prefix_index[where] if own is not layer_kv else -1)
        own_keys, own_values = own.keys_values()
        keys.append(own_keys)
        values.append(own_values)
    counts = [end - start for start, end in spans]
    out = cpu_attention.attention(queries, keys, values, counts, prefixes, prefix_of).flatten(1)
    return [out] if len(counts) == 1 else list(out.split(counts))


def _window_mask(window: int, key_positions: torch.Tensor, query_positions: torch.Tensor):
    """[Hkv, n, slots] bool: key_positions [slots, Hkv] within `window` of query_positions [n]."""
    return key_positions.T.unsqueeze(1) > (query_positions.view(1, -1, 1) - window)
