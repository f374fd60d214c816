"""The math of one Llama-family forward, in two kernel sets.

`invariant=False` (fast): library kernels as they come. Used for drafting and prefill, whose
results only need to be deterministic for a given input shape.

`invariant=True` (batch-invariant): the result for a token does not depend on how many other
tokens or sequences share the forward. A one-token decode step and a 31-token verification then
produce bit-identical logits for the same token, which makes VeriCache's greedy output identical to
full-KV decoding, not merely close. Linear layers: see linear.py. Attention: measured on MKL,
batched products with fewer than four rows take other code paths than larger ones, so query rows
are padded to a multiple of QUERY_ROW_ALIGN; keys are padded to KEY_ALIGN slots and summed block
by block so that a row's reductions do not depend on how many masked keys trail it.
tests/test_batch_invariance.py checks each property on the machine it runs on.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vericache.kv.cache import aligned
from vericache.model.linear import pad_rows

KEY_ALIGN = 1024
QUERY_ROW_ALIGN = 4


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalises the last axis in float32, like the reference implementation."""
    x32 = x.float()
    variance = x32.pow(2).mean(-1, keepdim=True)
    return weight * (x32 * torch.rsqrt(variance + eps)).to(x.dtype)


def silu(x: torch.Tensor) -> torch.Tensor:
    # Built from exp and exactly rounded arithmetic: torch's fused silu takes a different code path
    # for the vector tail of a tensor, so an element's result would depend on its index.
    return x / (1 + torch.exp(-x))


def attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    num_slots: int,
    invariant: bool,
    window_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of n new tokens over a cache whose last n slots are those tokens.

    q: [n, Hq, D]; keys, values: [T', Hkv, D] with T' >= num_slots (extra slots are masked);
    window_mask: optional [Hkv, n, num_slots] bool, False where a sliding window hides a key.
    Returns [n, Hq * D].
    """
    num_new, num_heads, head_dim = q.shape
    num_kv_heads = keys.shape[1]
    group = num_heads // num_kv_heads
    if invariant:
        out = _invariant_attention(q, keys, values, num_slots, window_mask)
    else:
        out = _sdpa_attention(q, keys[:num_slots], values[:num_slots], window_mask, group)
    return out.reshape(num_new, num_heads * head_dim)


def visibility_mask(num_new: int, num_slots: int, window_mask, device) -> torch.Tensor:
    """[n, num_slots] bool, or [Hkv, n, num_slots] with a window: new token m sees every older
    slot and new slots 0..m, minus what a sliding window hides."""
    slots = torch.arange(num_slots, device=device)
    last_visible = num_slots - num_new + torch.arange(num_new, device=device)
    mask = slots.unsqueeze(0) <= last_visible.unsqueeze(1)
    return mask if window_mask is None else mask & window_mask


def _sdpa_attention(q, keys, values, window_mask, group) -> torch.Tensor:
    num_new, num_slots = q.shape[0], keys.shape[0]
    mask = None
    if num_new > 1 or window_mask is not None:
        mask = visibility_mask(num_new, num_slots, window_mask, q.device)
        if window_mask is not None:
            mask = mask.repeat_interleave(group, dim=0).unsqueeze(0)  # [1, Hq, n, slots]
    out = F.scaled_dot_product_attention(
        q.permute(1, 0, 2).unsqueeze(0),  # [1, Hq, n, D]
        keys.permute(1, 0, 2).unsqueeze(0),  # [1, Hkv, T, D]
        values.permute(1, 0, 2).unsqueeze(0),
        attn_mask=mask,
        enable_gqa=group > 1,
    )
    return out[0].permute(1, 0, 2)  # [n, Hq, D]


def _invariant_attention(q, keys, values, num_slots, window_mask) -> torch.Tensor:
    num_new, num_heads, head_dim = q.shape
    num_kv_heads = keys.shape[1]
    group = num_heads // num_kv_heads
    padded_slots = aligned(num_slots, KEY_ALIGN)
    keys, values = keys[:padded_slots], values[:padded_slots]
    # Rows ordered (group member, token) per KV head: [Hkv, g * n, D].
    rows = (q * head_dim**-0.5).view(num_new, num_kv_heads, group, head_dim)
    rows = pad_rows(
        rows.permute(1, 2, 0, 3).reshape(num_kv_heads, group * num_new, head_dim), QUERY_ROW_ALIGN
    )
    scores = torch.matmul(rows, keys.permute(1, 2, 0))  # [Hkv, R, T']
    scores.masked_fill_(~_visible(scores, num_new, num_slots, group, window_mask), float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(values.dtype)
    # probs @ values, one fixed-shape product per block of KEY_ALIGN keys, summed in block order:
    # the sum over keys then does not depend on how many masked blocks trail the visible ones
    # (MKL reduces a 256-long and a 512-long product in different orders).
    num_blocks = padded_slots // KEY_ALIGN
    value_blocks = values.view(num_blocks, KEY_ALIGN, num_kv_heads, head_dim)
    out = torch.stack(
        [
            torch.bmm(
                probs[h].view(-1, num_blocks, KEY_ALIGN).transpose(0, 1),  # [blocks, R, KEY_ALIGN]
                value_blocks[:, :, h],  # [blocks, KEY_ALIGN, D]
            ).cumsum(0)[-1]
            for h in range(num_kv_heads)
        ]
    )  # [Hkv, R, D]
    out = out[:, : group * num_new].view(num_kv_heads, group, num_new, head_dim)
    return out.permute(2, 0, 1, 3)  # [n, Hkv, g, D] == [n, Hq, D]


def _visible(scores, num_new: int, num_slots: int, group: int, window_mask) -> torch.Tensor:
    """[Hkv, R, T'] bool for the padded score matrix of `_invariant_attention`."""
    num_kv_heads, num_rows, padded_slots = scores.shape
    device = scores.device
    visible = torch.zeros(
        num_kv_heads, group, num_new, padded_slots, dtype=torch.bool, device=device
    )
    token_mask = visibility_mask(num_new, num_slots, window_mask, device)
    visible[..., :num_slots] = token_mask if window_mask is None else token_mask.unsqueeze(1)
    visible = visible.view(num_kv_heads, group * num_new, padded_slots)
    if num_rows > group * num_new:
        # Padding rows see slot 0 only, so their softmax stays finite; their output is discarded.
        extra = torch.zeros(
            num_kv_heads, num_rows - group * num_new, padded_slots, dtype=torch.bool, device=device
        )
        extra[..., 0] = True
        visible = torch.cat([visible, extra], dim=1)
    return visible
