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
Layers the dropper keeps dense are steered (SnapKV, PyramidKV, KVzip), and so are a composition's
KIVI layers (`snapkv+kivi`): their leading whole groups are chosen again as a dense layer's slots
are, within the positions below those the slots past them hold, and quantized again from the full
KV's exact keys and values (compress/kept_set.py `LayerRegrouped`).

Where the drafter is remote, the verifier plans each refresh against the kept set the drafter last
said it holds (its version, which the drafts carry) and sends only what changes
(compress/kept_set.py `KeptSetRefresh`, serve/workers/steered_sessions.py). Where the full KV is
beside the drafter (the engine, the long-context engine, a warm drafter node), each refresh is
planned and applied at once, with no link bytes.
"""

from __future__ import annotations

import math

import torch

from vericache.compress.composed import Composed
from vericache.compress.kept_set import (
    KeptPositions,
    KeptSetRefresh,
    LayerRefresh,
    LayerRegrouped,
    apply_refresh,
    kept_positions,
    refreshed_positions,
)
from vericache.compress.kivi import KIVI
from vericache.kv.cache import KVCache
from vericache.kv.prefixed import PrefixedLayerKV
from vericache.kv.quantized import quantized_groups

# Kept sets a steering keeps besides the newest: those a drafter may still hold (a refresh on its
# way, or lost on the way).
_VERSIONS_KEPT = 2


class KeptSetSteering:
    """One sequence's steering: the verification queries since the last refresh, by layer, and
    the kept sets it made, by version (0: the dropper's own)."""

    def __init__(
        self, every: int, num_prefix_tokens: int, window: int, kept: KeptPositions,
        storage_dtype: torch.dtype | None = None, quantizer: KIVI | None = None,
    ):  # fmt: skip
        self.every = every  # rounds between refreshes
        self.num_prefix_tokens = num_prefix_tokens
        self.window = window  # the prefix's last tokens always kept
        self.storage_dtype = storage_dtype  # the kept slots' dtype (None: the full KV's)
        self.quantizer = quantizer  # a composition's: its layers' kept slots are quantized groups
        self._queries: dict[int, list[torch.Tensor]] = {}  # layer -> [n, Hq, D] per forward
        self._kept: dict[int, KeptPositions] = {0: kept}
        self.version = 0  # the newest kept set
        self.num_rounds = 0
        self.num_refreshes = 0
        self.num_changed = 0  # kept (layer, head, position) entries replaced, over all refreshes

    @classmethod
    def of(cls, every: int, compressed: KVCache, num_prefix_tokens: int, compressor):
        """The steering of a sequence drafting over `compressed` (its copy of the prefix kept by
        `compressor`, a token dropper)."""
        kept = kept_positions(compressed, num_prefix_tokens)
        return cls(
            every, num_prefix_tokens, compressor.observation_window, kept,
            compressor.storage_dtype, kept_quantizer(compressor),
        )  # fmt: skip

    @property
    def num_kept_entries(self) -> int:
        """The (layer, head, position) entries of a kept set: every set it makes keeps as many."""
        return sum(
            positions.numel() for positions in self._kept[self.version] if positions is not None
        )

    def observe(self, layer_index: int, positions, queries: torch.Tensor, layer_kv) -> None:
        """The runner's hook on a verification: the rows' rotated queries [n, Hq, D]."""
        self._queries.setdefault(layer_index, []).append(queries.detach())

    def round_done(self) -> bool:
        """Counts a verified round; whether a refresh is due after it."""
        self.num_rounds += 1
        return bool(self._queries) and self.num_rounds % self.every == 0

    def drop_queries(self) -> None:
        """Forgets the queries recorded since the last refresh (none can be planned now)."""
        self._queries = {}

    def refresh(self, compressed: KVCache, full: KVCache) -> int:
        """In-process: chooses the kept prefix slots again and applies the change to
        `compressed` at once; returns how many entries changed."""
        planned = self.plan(full, self.version)
        apply_refresh(compressed, self.num_prefix_tokens, planned)
        return planned.num_changed

    def plan(self, full: KVCache, base_version: int) -> KeptSetRefresh:
        """The refresh from kept set `base_version` (the one the drafter holds) to the set the
        recorded queries (cleared) choose, with the added positions' rows from `full`."""
        queries, self._queries = self._queries, {}
        base = self._kept[base_version]
        layers = []
        for index, positions in enumerate(base):
            if index in queries and positions is not None:
                layer = self._layer(index, positions, torch.cat(queries[index]), full)
                if layer is not None and layer.num_changed:  # a set that stays carries nothing
                    layers.append(layer)
        refresh = KeptSetRefresh(self.version + 1, base_version, tuple(layers))
        self.version += 1
        self._kept[self.version] = refreshed_positions(base, refresh)
        # The drafter holds `base_version` or a later set: older ones are never asked for again.
        stale = self.version - _VERSIONS_KEPT
        for old in [v for v in self._kept if v < base_version or (v < stale and v != base_version)]:
            del self._kept[old]
        self.num_refreshes += 1
        self.num_changed += refresh.num_changed
        return refresh

    def holds(self, version: int) -> bool:
        """Whether a refresh can be planned from kept set `version`."""
        return version in self._kept

    def _layer(
        self, index: int, base: torch.Tensor, queries: torch.Tensor, full: KVCache
    ) -> LayerRefresh | LayerRegrouped | None:
        """Layer `index`'s entries whose positions leave the kept set `base` [k, H], each paired
        with one that enters it in the same head, and the entering ones' keys and values."""
        if self.quantizer is not None:
            return self._regrouped(index, base, queries, full)
        prefix_keys, prefix_values = _prefix_kv(full.layers[index], self.num_prefix_tokens)
        scores = attention_mass(queries, prefix_keys)  # [Hkv, P]
        chosen = self._chosen(scores, base.shape[0]).to(base.device)  # [k, H] ascending
        heads, removed, added = _exchanged(base, chosen)
        dtype = self.storage_dtype or prefix_keys.dtype
        at = (added.long().to(prefix_keys.device), heads.to(prefix_keys.device))
        keys, values = prefix_keys[at].to(dtype), prefix_values[at].to(dtype)  # [m, D]
        return LayerRefresh(index, heads, removed, added, keys, values)

    def _regrouped(
        self, index: int, base: torch.Tensor, queries: torch.Tensor, full: KVCache
    ) -> LayerRegrouped | None:
        """A quantized layer's leading whole groups of the kept set `base` [k, H], chosen again
        below the positions its slots past them hold, and quantized again (None: no whole
        group)."""
        quantizer = self.quantizer
        num_grouped = base.shape[0] // quantizer.group_size * quantizer.group_size
        if not num_grouped:
            return None
        prefix_keys, prefix_values = _prefix_kv(full.layers[index], self.num_prefix_tokens)
        scores = attention_mass(queries, prefix_keys)  # [Hkv, P]
        held_past = base[num_grouped] if num_grouped < base.shape[0] else None  # [H]
        chosen = self._chosen(scores, num_grouped, held_past)  # [n, H] ascending
        at = (chosen.long().to(prefix_keys.device), torch.arange(chosen.shape[1]))
        keys, values = prefix_keys[at], prefix_values[at]  # [n, H, D]
        groups = quantized_groups(keys, values, chosen, quantizer.bits, quantizer.group_size)
        entering, _, _ = _exchanged(base[:num_grouped], chosen.to(base.device))
        return LayerRegrouped(index, entering.numel(), groups)

    def _chosen(
        self, scores: torch.Tensor, budget: int, below: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Per head, `budget` prefix positions [budget, H] ascending: the last `window` ones,
        then the best scored of the rest; where `below` [H] is given, only positions below
        each head's."""
        num_prefix = scores.shape[1]
        window = min(self.window, budget, num_prefix)
        ranked = scores.clone()
        ranked[:, num_prefix - window :] = math.inf
        if below is not None:  # the positions from there on are held past the groups
            past = (
                torch.arange(num_prefix, device=ranked.device) >= below.to(ranked.device)[:, None]
            )
            ranked[past] = -math.inf
        top = ranked.topk(budget, dim=-1).indices  # [H, budget]
        return top.sort(dim=-1).values.T.contiguous().to(torch.int32)


def _exchanged(
    base: torch.Tensor, chosen: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per head, the positions of `base` [k, H] that `chosen` [k, H] lacks, each paired with one
    of `chosen` that `base` lacks (as many: both keep k): heads [m], removed [m], added [m]."""
    heads, removed, added = [], [], []
    for head in range(base.shape[1]):
        old, new = base[:, head], chosen[:, head]
        leaving, entering = old[~torch.isin(old, new)], new[~torch.isin(new, old)]
        heads.append(torch.full((leaving.numel(),), head, dtype=torch.long))
        removed.append(leaving.sort().values.to(torch.int32).cpu())
        added.append(entering.sort().values.to(torch.int32).cpu())
    return torch.cat(heads), torch.cat(removed), torch.cat(added)


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


def kept_quantizer(compressor) -> KIVI | None:
    """The quantizer a steered compressor's kept slots are grouped by (a composition's), or
    None (a dropper's dense slots)."""
    return compressor.quantizer if isinstance(compressor, Composed) else None
