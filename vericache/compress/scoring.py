"""Shared pieces of the token-dropping methods: attention scores and the kept-token selection."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from vericache.kernels.gather import gather_slots
from vericache.kv.cache import DenseLayerKV, LayerKV

# Query rows scored at once: bounds the [Hkv, g, rows, slots] probability block.
SCORE_CHUNK = 256


def attention_probs(
    queries: torch.Tensor,
    query_positions: torch.Tensor,
    keys: torch.Tensor,
    key_positions: torch.Tensor,
) -> torch.Tensor:
    """Causal attention probabilities in float32, [Hkv, g, n, S].

    queries: [n, Hq, D] rotated; query_positions: [n]; keys: [S, Hkv, D] rotated;
    key_positions: [S, Hkv]. A query sees the keys at its own position or before.
    """
    num_new, num_heads, head_dim = queries.shape
    num_kv_heads = keys.shape[1]
    q = queries.float().view(num_new, num_kv_heads, num_heads // num_kv_heads, head_dim)
    scores = torch.einsum("nhgd,shd->hgns", q, keys.float()) / math.sqrt(head_dim)
    visible = key_positions.T.unsqueeze(1) <= query_positions.view(1, -1, 1)  # [Hkv, n, S]
    scores.masked_fill_(~visible.unsqueeze(1), float("-inf"))
    return torch.softmax(scores, dim=-1)


def accumulate_attention(
    queries: torch.Tensor,
    query_positions: torch.Tensor,
    layer: LayerKV,
    num_slots: int,
    reduce: str = "sum",
) -> torch.Tensor:
    """Attention the first `num_slots` slots of `layer` receive from the queries, [num_slots, Hkv]:
    summed (or maximised) over the queries and the query heads of each KV head's group."""
    keys, _ = layer.keys_values()
    keys, key_positions = keys[: layer.num_slots], layer.positions()
    total = None
    for begin in range(0, queries.shape[0], SCORE_CHUNK):
        rows = slice(begin, begin + SCORE_CHUNK)
        probs = attention_probs(queries[rows], query_positions[rows], keys, key_positions)
        probs = probs[..., :num_slots]  # [Hkv, g, n, S]
        if reduce == "sum":
            part = probs.sum(dim=(1, 2))
            total = part if total is None else total + part
        else:
            part = probs.amax(dim=(1, 2))
            total = part if total is None else torch.maximum(total, part)
    return total.T.contiguous()  # [S, Hkv]


def pool_scores(scores: torch.Tensor, kernel_size: int, kind: str = "avg") -> torch.Tensor:
    """Smooths [S, H] scores along tokens (SnapKV's clustering of neighbouring tokens)."""
    if kernel_size <= 1 or not scores.shape[0]:
        return scores
    x = scores.T.unsqueeze(0)  # [1, H, S]
    pad = kernel_size // 2
    if kind == "max":
        pooled = F.max_pool1d(x, kernel_size, stride=1, padding=pad)
    else:
        pooled = F.avg_pool1d(x, kernel_size, stride=1, padding=pad, count_include_pad=False)
    return pooled[0, :, : scores.shape[0]].T


def select_slots(scores: torch.Tensor, budget: int, forced: torch.Tensor | None = None):
    """[k, H] slot indices, ascending per head: the `budget` highest-scoring slots of each head,
    slots where `forced` ([S] or [S, H] bool) is True first (by score if they do not all fit).
    k = min(budget, S)."""
    num_slots = scores.shape[0]
    if budget >= num_slots:
        return torch.arange(num_slots, device=scores.device).unsqueeze(1).expand_as(scores)
    ranked = scores.double().clone()
    if forced is not None:
        forced = forced if forced.dim() == 2 else forced.unsqueeze(1).expand_as(ranked)
        # Above every unforced score, and still ordered by score among themselves: when more
        # slots are forced than fit, the best of them stay.
        lift = ranked.max() - ranked.min() + 1
        ranked[forced] += lift
    top = ranked.topk(budget, dim=0).indices  # [budget, H]
    return top.sort(dim=0).values


def keep_slots(
    layer: LayerKV, slot_index: torch.Tensor, dtype: torch.dtype | None = None
) -> DenseLayerKV:
    """A new dense layer of the given slots of `layer`, slot_index [k, H] ascending per head,
    stored in `dtype` (None: the layer's own)."""
    keys, values = layer.keys_values()
    kept_keys, kept_values, kept_positions = gather_slots(
        keys[: layer.num_slots], values[: layer.num_slots], layer.positions(), slot_index
    )
    if dtype is not None:
        kept_keys, kept_values = kept_keys.to(dtype), kept_values.to(dtype)
    return DenseLayerKV.from_tensors(kept_keys, kept_values, kept_positions)


def token_budget(num_tokens: int, ratio: float, minimum: int = 1) -> int:
    """Slots kept per head for `ratio` times fewer than `num_tokens` tokens."""
    return min(num_tokens, max(minimum, math.ceil(num_tokens / ratio)))


def committed_queries(cache, layer_index: int):
    """The drafter queries a layer observed for committed tokens since the last update, as
    (queries [n, Hq, D], positions [n]), or None; clears the layer's log. Queries of rejected
    drafts (positions at or past `cache.num_tokens`) are discarded."""
    observed, cache.observed[layer_index] = cache.observed[layer_index], []
    if not observed:
        return None
    positions = torch.cat([p for p, _ in observed])
    queries = torch.cat([q for _, q in observed])
    keep = positions < cache.num_tokens
    if not bool(keep.any()):
        return None
    return queries[keep], positions[keep]


def replay_scores(full, context, replays, reduce: str = "sum") -> list[torch.Tensor]:
    """Per layer [T, Hkv]: attention the T prefix slots receive from the queries of replayed
    tokens, summed (or maximised) over every replay. `replays` holds (start, token ids) pairs:
    the ids are fed after the first `start` tokens of `full` (on a copy), queries observed."""
    num_tokens = full.num_tokens
    scores: list[torch.Tensor | None] = [None] * len(full.layers)

    def observe(index, positions, queries, layer_kv):
        part = accumulate_attention(queries, positions, layer_kv, num_tokens, reduce)
        pad = num_tokens - part.shape[0]  # a replay from the start sees fewer slots at first
        part = F.pad(part, (0, 0, 0, pad)) if pad else part
        if scores[index] is None:
            scores[index] = part
        else:
            scores[index] = scores[index] + part if reduce == "sum" else scores[index].maximum(part)

    for start, token_ids in replays:
        context.observe(full, start, token_ids, observe)
    # A layer no query reached (an empty prefix: nothing replayed) scores every slot 0.
    return [
        layer_scores if layer_scores is not None else _zero_scores(layer, num_tokens)
        for layer, layer_scores in zip(full.layers, scores)
    ]


def _zero_scores(layer, num_tokens: int) -> torch.Tensor:
    keys, _ = layer.keys_values()
    return torch.zeros(num_tokens, keys.shape[1], device=keys.device)


def all_prefix_scores(full, context) -> list[torch.Tensor]:
    """Per layer [T, Hkv]: attention every prefix token receives from all later prefix queries,
    by re-running the prefix with its queries observed (offline; one extra prefill)."""
    return replay_scores(full, context, [(0, list(context.token_ids[: full.num_tokens]))])


def window_scores(full, context, window: int) -> list[torch.Tensor]:
    """Per layer [T, Hkv]: attention the last `window` prefix tokens pay to every prefix token."""
    num_tokens = full.num_tokens
    window = min(window, num_tokens)
    tail = list(context.token_ids[num_tokens - window : num_tokens])
    return replay_scores(full, context, [(num_tokens - window, tail)] if window else [])
