"""A kept set the verifier steers: every `every` rounds, the prefix positions a token dropper keeps
are chosen again from the attention the round's verifications paid them over the full KV.

A token dropper chooses its kept tokens once, from the prompt (SnapKV's observation window, KVzip's
reconstruction). What the drafts come to need moves as decoding goes on, and the verifier sees it
for free: each verification's queries attend over the whole prefix. `KeptSetSteering` records
those queries (the runner's per-layer `observe` hook on the verification rows), and at a refresh
scores each prefix position by the attention mass the recorded queries put on it (per KV head,
summed over the heads of its group and over the rows), then keeps, per layer and head, the same
number of prefix slots as before: the prefix's last `window` tokens (the dropper's observation
window, which the next queries attend to most) and the best scored of the rest. The new slots are
the full KV's exact keys and values, stored as the dropper stores its own; the slots after the
prefix (the prompt's rest, the output) are kept as they are. Only what the drafter reads changes:
every round is still verified over the full KV, so the output is full decoding's.

Scores are the queries' attention over the prefix alone (softmax over the prefix's keys, not the
tokens after it): a ranking of prefix positions, which the positions after it do not change.
Layers the dropper keeps dense are steered (SnapKV, PyramidKV, KVzip); a quantized layer (a
composition) is not: its packed groups would need quantizing again.
"""

from __future__ import annotations

import math

import torch

from vericache.kv.cache import DenseLayerKV, KVCache
from vericache.kv.compressed import CompressedKV
from vericache.kv.prefixed import PrefixedLayerKV


class KeptSetSteering:
    """One sequence's steering: the verification queries since the last refresh, by layer."""

    def __init__(self, every: int, num_prefix_tokens: int, window: int, storage_dtype=None):
        self.every = every  # rounds between refreshes
        self.num_prefix_tokens = num_prefix_tokens
        self.window = window  # the prefix's last tokens always kept
        self.storage_dtype = storage_dtype  # the kept slots' dtype (None: the full KV's)
        self._queries: dict[int, list[torch.Tensor]] = {}  # layer -> [n, Hq, D] per forward
        self.num_refreshes = 0
        self.num_changed = 0  # kept (layer, head, position) entries replaced, over all refreshes

    def observe(self, layer_index: int, positions, queries: torch.Tensor, layer_kv) -> None:
        """The runner's hook on a verification: the rows' rotated queries [n, Hq, D]."""
        self._queries.setdefault(layer_index, []).append(queries.detach())

    def is_due(self, num_rounds: int) -> bool:
        return bool(self._queries) and num_rounds % self.every == 0

    def refresh(self, compressed: CompressedKV, full: KVCache) -> int:
        """Chooses the kept prefix slots again from the recorded queries; returns how many
        (layer, head, position) entries changed. The records are cleared."""
        queries, self._queries = self._queries, {}
        changed = 0
        for index, layer in enumerate(compressed.layers):
            if index not in queries or not getattr(layer, "is_dense", False):
                continue
            prefix_keys, prefix_values = _prefix_kv(full.layers[index], self.num_prefix_tokens)
            scores = attention_mass(torch.cat(queries[index]), prefix_keys)  # [Hkv, P]
            changed += self._refresh_layer(compressed, index, scores, prefix_keys, prefix_values)
        self.num_refreshes += 1
        self.num_changed += changed
        return changed

    def _refresh_layer(self, compressed, index, scores, prefix_keys, prefix_values) -> int:
        layer = compressed.layers[index]
        kept, tail = _split(layer, self.num_prefix_tokens)
        old_positions = kept.positions().long()  # [k, H]
        chosen = self._chosen(scores, old_positions.shape[0])  # [k, H] ascending
        heads = torch.arange(chosen.shape[1], device=chosen.device)
        keys, values = prefix_keys[chosen, heads], prefix_values[chosen, heads]  # [k, H, D]
        dtype = self.storage_dtype or kept.slots(0, 0)[0].dtype
        new = DenseLayerKV.from_tensors(keys.to(dtype), values.to(dtype), chosen.to(torch.int32))
        _replace_prefix(compressed, index, new, tail)
        same = (chosen.unsqueeze(1) == old_positions.to(chosen.device).unsqueeze(0)).any(1)
        return int((~same).sum())

    def _chosen(self, scores: torch.Tensor, budget: int) -> torch.Tensor:
        """Per head, `budget` prefix positions [budget, H] ascending: the last `window` ones,
        then the best scored of the rest."""
        num_prefix = scores.shape[1]
        window = min(self.window, budget, num_prefix)
        ranked = scores.clone()
        ranked[:, num_prefix - window :] = math.inf
        top = ranked.topk(budget, dim=-1).indices  # [H, budget]
        return top.sort(dim=-1).values.T.contiguous()


def attention_mass(queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """The attention queries [n, Hq, D] pay keys [P, Hkv, D], softmax over the P keys, summed
    over the rows and the query heads of each KV head's group: [Hkv, P] float32."""
    num_rows, num_heads, head_dim = queries.shape
    num_kv_heads = keys.shape[1]
    grouped = queries.float().reshape(num_rows, num_kv_heads, num_heads // num_kv_heads, head_dim)
    logits = torch.einsum("nhgd,phd->hngp", grouped, keys.float()) / math.sqrt(head_dim)
    return logits.softmax(-1).sum(dim=(1, 2))


def _prefix_kv(layer, num_prefix: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A full-KV layer's first `num_prefix` slots (its prefix, in token order): [P, H, D] each."""
    if isinstance(layer, PrefixedLayerKV) and layer.shared.num_slots >= num_prefix:
        return layer.shared.slots(0, num_prefix)
    keys, values = layer.keys_values()
    return keys[:num_prefix], values[:num_prefix]


def _split(layer, num_prefix: int) -> tuple[DenseLayerKV, DenseLayerKV | None]:
    """A compressed dense layer's kept prefix slots and, in a layer of its own, what follows
    them (None where a prefixed layer keeps that apart already)."""
    if isinstance(layer, PrefixedLayerKV):
        return layer.shared, None
    positions = layer.positions()  # [slots, H]
    num_kept = int((positions[:, 0] < num_prefix).sum())  # as many for every head
    keys, values = layer.slots(0, layer.num_slots)
    kept = DenseLayerKV.from_tensors(keys[:num_kept], values[:num_kept], positions[:num_kept])
    tail = DenseLayerKV.from_tensors(keys[num_kept:], values[num_kept:], positions[num_kept:])
    return kept, tail


def _replace_prefix(compressed: CompressedKV, index: int, new: DenseLayerKV, tail) -> None:
    layer = compressed.layers[index]
    if isinstance(layer, PrefixedLayerKV):
        layer.shared = new  # the session's own copy now: the shared one stays as it was
        return
    keys, values = tail.slots(0, tail.num_slots)
    new.append(keys, values, tail.positions())
    compressed.layers[index] = new
