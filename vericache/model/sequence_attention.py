"""Every sequence's KV store and attention in one layer of a forward, each over its own cache.

A forward's layer loop (runner.py) hands each layer's new keys and values, and its queries, to a
`LayerKVAccess`: this one, which serves any mix of caches (dense, quantized, over a shared prefix,
windowed), or the static one (static_forward.py), whose calls keep their shapes step after step.
Sequences that one kernel call serves together wait for it: on CPU those `uses_cpu_kernel` picks
(vericache/kernels/cpu_attention.py: every exact sequence, and every one-token draft step), on
CUDA those over one shared prefix (one cascade call reads the prefix once for all of them).
"""

from __future__ import annotations

from typing import Protocol

import torch

from vericache.kernels import cpu_attention
from vericache.kv.prefixed import PrefixedLayerKV
from vericache.model.kernels import (
    attention,
    attention_over_shared_prefix,
    key_alignment,
    reads_shared_prefix,
)
from vericache.model.linear import zero_row


class LayerKVAccess(Protocol):
    """What a forward's layer loop asks of the caches of its batch."""

    def store(self, index: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Appends the new tokens' rotated keys and values [N, Hkv, D] to layer `index`."""

    def attend(self, index: int, q: torch.Tensor) -> torch.Tensor:
        """Rotated queries [N, Hq, D] over layer `index` -> [num_rows, Hq * D] (rows past the
        sequences' are zero)."""


class SequenceAttention:
    """`LayerKVAccess` over each sequence's own cache, whatever its layers hold.

    batch: the forward's SequenceInputs; spans: each one's rows start:end of the layer's
    queries (ascending, gaps and a tail up to num_rows are padding rows, attended as zeros);
    positions: [num_rows] the rows' token positions."""

    def __init__(self, runner, batch, spans, positions, invariant: bool, num_rows: int):
        self.windows = runner.config.layer_windows
        self.cpu_kernel = runner._cpu_kernel
        self.batch, self.spans, self.positions = batch, spans, positions
        self.invariant, self.num_rows = invariant, num_rows

    def store(self, index: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """With the CPU kernel, every dense layer takes its rows in one store call: a draft step
        of 14 caches spent 257 us per layer appending them one by one, 27 in one call
        (measured), some 7% of the step."""
        stores = []
        for seq, (start, end) in zip(self.batch, self.spans):
            layer_kv = seq.cache.layers[index]
            if self.cpu_kernel and getattr(layer_kv, "is_dense", False):
                stores.append((*layer_kv.reserve(end - start), start, end - start))
            else:
                layer_kv.append(keys[start:end], values[start:end], self.positions[start:end])
        if stores:
            cpu_attention.store_kv(keys, values, self.positions, stores)

    def attend(self, index: int, q: torch.Tensor) -> torch.Tensor:
        window = self.windows[index]
        outputs: list[torch.Tensor | None] = [None] * len(self.batch)
        cpu_kernel: list[tuple[int, tuple[int, int], object]] = []  # (output, rows, layer)
        by_prefix: dict[tuple[int, int], list[tuple[int, tuple[int, int], object]]] = {}
        for i, (seq, (start, end)) in enumerate(zip(self.batch, self.spans)):
            n = end - start
            layer_kv = seq.cache.layers[index]
            if seq.observe is not None:
                seq.observe(index, self.positions[start:end], q[start:end], layer_kv)
            window_mask = None
            # The window only hides keys once the newest token is `window` positions in.
            if window is not None and seq.cache.num_tokens + n > window:
                window_mask = _window_mask(window, layer_kv.positions(), self.positions[start:end])
            row_invariant = self.invariant and not seq.fast_attention
            if self.uses_cpu_kernel(layer_kv, window, window_mask, n, row_invariant):
                cpu_kernel.append((i, (start, end), layer_kv))
            elif _reads_prefix_apart(layer_kv, q, window_mask, row_invariant):
                shared_keys, _ = layer_kv.shared.keys_values()
                by_prefix.setdefault(_prefix_identity(shared_keys), []).append(
                    (i, (start, end), layer_kv)
                )
            else:
                outputs[i] = _attend(layer_kv, q[start:end], window_mask, row_invariant)
        calls = [(_attend_by_cpu_kernel, cpu_kernel)]
        calls += [(_attend_sharing_prefix, group) for group in by_prefix.values()]
        for attend, group in calls:
            if group:
                attended = attend(q, [rows for _, rows, _ in group], [kv for *_, kv in group])
                for (i, _, _), out in zip(group, attended):
                    outputs[i] = out
        return self._padded(outputs)

    def _padded(self, outputs: list[torch.Tensor]) -> torch.Tensor:
        """The sequences' outputs in row order, zero rows in the gaps and tail: [num_rows, W]."""
        parts, row = [], 0
        for (start, end), out in zip(self.spans, outputs):
            if start > row:
                parts.append(_zero_rows(outputs[0], start - row))
            parts.append(out)
            row = end
        if self.num_rows > row:
            parts.append(_zero_rows(outputs[0], self.num_rows - row))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def uses_cpu_kernel(self, layer_kv, window, window_mask, n: int, invariant: bool) -> bool:
        """Whether a sequence's attention in this layer joins the CPU kernel's call (over
        full-precision slots only). Batch-invariant rows: all of them on a layer without a
        sliding window, whatever n, since a token must take the same kernel decoded alone as
        verified among others (the kernel is batch-invariant by construction). Fast rows:
        one-token steps; longer runs (prefill) go to library attention."""
        if not self.cpu_kernel or getattr(layer_kv, "attends_packed", False):
            return False
        return window is None if invariant else n == 1 and window_mask is None


def _zero_rows(like: torch.Tensor, num_rows: int) -> torch.Tensor:
    """[num_rows, W] zeros: a lone batch-invariant row's spare (made once) or a bucket's padding."""
    return zero_row(like) if num_rows == 1 else like.new_zeros(num_rows, like.shape[1])


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
