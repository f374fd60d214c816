"""The math of one Llama-family forward, in two kernel sets.

`invariant=False` (fast): library kernels as they come (the runner hands one-token steps on CPU to
vericache/kernels/cpu_attention.py instead). Used for drafting and for prefills into compressed KV,
whose results only drafts read and need only be deterministic for a given input shape.

`invariant=True` (batch-invariant): the result for a token does not depend on how many other
tokens or sequences share the forward. A one-token decode step and a 31-token verification then
produce bit-identical logits for the same token, which makes VeriCache's greedy output identical to
full-KV decoding, not merely close. Prefills into full KV use them too (runner.py `prefill`): a
token's full KV is then the same bits whether a prefill chunk, a decode step or a verification
computed it. Linear layers: see linear.py. Attention: on CPU the runner
hands layers without a sliding window to vericache/kernels/cpu_attention.py, invariant by
construction (each row on its own, in a fixed order); what follows serves the rest. Measured on MKL,
batched products with fewer than four rows take other code paths than larger ones, so query rows
are padded to a multiple of QUERY_ROW_ALIGN; keys are padded to KEY_ALIGN slots and summed block
by block so that a row's reductions do not depend on how many masked keys trail it. On CUDA, whose
kernels pick their algorithm by shape, every product and reduction of the set runs on fixed blocks
of rows (linear.py's CUDA_ROW_BLOCK) and attention combines its key blocks with an online softmax:
in one Triton kernel where Triton is installed (vericache/kernels/triton_invariant_attention.py),
else in torch below.
tests/test_batch_invariance.py checks each property on the machine it runs on, and the CUDA
algorithm on the CPU too.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from vericache.kernels import triton_invariant_attention, triton_ops
from vericache.kv.slots import KEY_ALIGN, aligned
from vericache.model import linear
from vericache.model.linear import CUDA_ROW_BLOCK, map_row_blocks, pad_rows

QUERY_ROW_ALIGN = 4


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, invariant: bool = False
) -> torch.Tensor:
    """Normalises the last axis in float32, like the reference implementation."""
    if invariant and linear.uses_row_blocks(x):
        return map_row_blocks(lambda block: rms_norm(block, weight, eps), x, CUDA_ROW_BLOCK)
    is_float32 = x.dtype == torch.float32  # then no conversions: each is an operator a step pays
    x32 = x if is_float32 else x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * (normed if is_float32 else normed.to(x.dtype))


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
    prefix: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Causal attention of n new tokens over a cache whose last n slots are those tokens.

    q: [n, Hq, D]; keys, values: [T', Hkv, D] with T' >= num_slots (extra slots are masked), in
    q's dtype or another (a 16-bit draft cache);
    window_mask: optional [Hkv, n, num_slots] bool, False where a sliding window hides a key;
    prefix: a shared prefix's (keys, values) [P, Hkv, D] that every row sees before the cache, only
    where `reads_shared_prefix` (the result is that over the two in one buffer, bit for bit).
    Returns [n, Hq * D].
    """
    if prefix is not None and not reads_shared_prefix(q, invariant, keys.dtype):
        raise ValueError("this attention path reads no shared prefix: pass one buffer")
    if _triton_runs(q, invariant, keys.dtype):
        prefix_keys, prefix_values = prefix if prefix is not None else (None, None)
        return triton_invariant_attention.invariant_attention(
            q, keys, values, num_slots, window_mask, prefix_keys, prefix_values
        )
    if keys.dtype != q.dtype:  # a draft cache stored in 16 bits: library attention takes one dtype
        keys, values = keys.to(q.dtype), values.to(q.dtype)
    num_new, num_heads, head_dim = q.shape
    num_kv_heads = keys.shape[1]
    group = num_heads // num_kv_heads
    if invariant and linear.uses_row_blocks(q):
        out = _blocked_invariant_attention(q, keys, values, num_slots, window_mask)
    elif invariant:
        out = _invariant_attention(q, keys, values, num_slots, window_mask)
    else:
        out = _sdpa_attention(q, keys[:num_slots], values[:num_slots], window_mask, group)
    return out.reshape(num_new, num_heads * head_dim)


def attention_over_shared_prefix(
    q: torch.Tensor,
    spans: list[tuple[int, int]],
    own: list[tuple[torch.Tensor, torch.Tensor, int]],
    prefix: tuple[torch.Tensor, torch.Tensor],
) -> list[torch.Tensor]:
    """`attention` of several sequences over one shared prefix, where `reads_shared_prefix`: the
    prefix is read once for the rows of all of them (cascade attention), and each result is bit
    for bit `attention(q[start:end], keys, values, num_slots, invariant, prefix=prefix)`.

    q: [N, Hq, D]; spans: each sequence's rows start:end of q; own: each sequence's cache
    (keys, values [T', Hkv, D], num_slots), whose newest slots are its rows; prefix: (keys,
    values) [P, Hkv, D]. Returns [end - start, Hq * D] per sequence."""
    if not reads_shared_prefix(q, True, prefix[0].dtype):
        raise ValueError("this attention path reads no shared prefix: pass one buffer")
    return triton_invariant_attention.cascade_attention(q, spans, own, *prefix)


def key_alignment(q: torch.Tensor, invariant: bool) -> int:
    """Slots to pad the keys handed to `attention` to: the torch batch-invariant paths sum fixed
    blocks of KEY_ALIGN keys; the fast path and the Triton kernel read only the live slots."""
    return KEY_ALIGN if invariant and not _triton_runs(q, invariant, q.dtype) else 1


def reads_shared_prefix(q: torch.Tensor, invariant: bool, keys_dtype: torch.dtype) -> bool:
    """Whether `attention` reads a shared prefix apart from the cache (the Triton kernel); the
    other paths take the two in one buffer."""
    return _triton_runs(q, invariant, keys_dtype)


def _triton_runs(q: torch.Tensor, invariant: bool, keys_dtype: torch.dtype) -> bool:
    """Whether `attention` runs the Triton kernel: exact attention on CUDA, and fast attention over
    keys stored in another dtype, which library attention would have to convert first."""
    return q.is_cuda and triton_ops.available() and (invariant or keys_dtype != q.dtype)


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
    rows = _query_rows(q, num_kv_heads, QUERY_ROW_ALIGN)
    scores = torch.matmul(rows, keys.permute(1, 2, 0))  # [Hkv, R, T']
    # Without a window every row sees every slot before the first new token, so only the columns
    # from there on are masked (padding rows then see the early slots too: finite scores, and
    # their output, which no other row's depends on, is discarded).
    first_masked = 0 if window_mask is not None else num_slots - num_new
    masked = scores[..., first_masked:]
    if window_mask is None:
        visible = _causal_tail_visible(
            tuple(masked.shape), scores.device, num_new, num_slots, group, first_masked
        )
    else:
        visible = _visible(
            masked.shape, scores.device, num_new, num_slots, group, window_mask, first_masked
        )
    masked.masked_fill_(~visible, float("-inf"))
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
    return _from_query_rows(out, num_new, group)


def _blocked_invariant_attention(q, keys, values, num_slots, window_mask) -> torch.Tensor:
    """The batch-invariant attention for CUDA, where kernels pick their algorithm by shape: query
    rows in blocks of CUDA_ROW_BLOCK, keys in blocks of KEY_ALIGN, every product and reduction on
    one (row block, key block) shape, and the key blocks combined in order with an online softmax.
    Key blocks a row cannot see change nothing, bit for bit (their weights are exactly 0 and the
    running scale exactly 1), so a row's result does not depend on how many trail it."""
    num_new, num_heads, _ = q.shape
    num_kv_heads = keys.shape[1]
    group = num_heads // num_kv_heads
    padded_slots = aligned(num_slots, KEY_ALIGN)
    rows = _query_rows(q, num_kv_heads, CUDA_ROW_BLOCK)
    shape = (num_kv_heads, rows.shape[1], padded_slots)
    visible = _visible(shape, q.device, num_new, num_slots, group, window_mask)
    keys_t = keys[:padded_slots].permute(1, 2, 0)  # [Hkv, D, T']
    values_h = values[:padded_slots].permute(1, 0, 2)  # [Hkv, T', D]
    blocks = []
    for start in range(0, rows.shape[1], CUDA_ROW_BLOCK):
        part = slice(start, start + CUDA_ROW_BLOCK)
        blocks.append(_online_softmax_rows(rows[:, part], keys_t, values_h, visible[:, part]))
    return _from_query_rows(torch.cat(blocks, dim=1), num_new, group)


def _query_rows(q: torch.Tensor, num_kv_heads: int, row_align: int) -> torch.Tensor:
    """Scaled queries [n, Hq, D] as rows ordered (group member, token) per KV head, padded with
    zero rows to a multiple of row_align: [Hkv, R, D], R >= g * n."""
    num_new, num_heads, head_dim = q.shape
    group = num_heads // num_kv_heads
    rows = (q * head_dim**-0.5).view(num_new, num_kv_heads, group, head_dim)
    rows = rows.permute(1, 2, 0, 3).reshape(num_kv_heads, group * num_new, head_dim)
    return pad_rows(rows, row_align)


def _from_query_rows(out: torch.Tensor, num_new: int, group: int) -> torch.Tensor:
    """The inverse of `_query_rows` for an output [Hkv, R, D]: [n, Hq, D], padding dropped."""
    num_kv_heads, _, head_dim = out.shape
    out = out[:, : group * num_new].view(num_kv_heads, group, num_new, head_dim)
    return out.permute(2, 0, 1, 3).reshape(num_new, num_kv_heads * group, head_dim)


def _online_softmax_rows(rows, keys_t, values_h, visible) -> torch.Tensor:
    """softmax(rows @ keys) @ values for one block of rows [Hkv, B, D], key block by key block."""
    num_kv_heads, num_rows, _ = rows.shape
    running_max = rows.new_full((num_kv_heads, num_rows, 1), float("-inf"), dtype=torch.float32)
    total = rows.new_zeros((num_kv_heads, num_rows, 1), dtype=torch.float32)
    out = rows.new_zeros((num_kv_heads, num_rows, values_h.shape[-1]), dtype=torch.float32)
    for start in range(0, keys_t.shape[-1], KEY_ALIGN):
        end = start + KEY_ALIGN
        scores = torch.matmul(rows, keys_t[..., start:end]).float()  # [Hkv, B, KEY_ALIGN]
        scores.masked_fill_(~visible[..., start:end], float("-inf"))
        new_max = torch.maximum(running_max, scores.amax(-1, keepdim=True))
        # A row that has seen no key yet keeps -inf: subtract 0 there, never -inf - -inf.
        shift = torch.where(torch.isinf(new_max), torch.zeros_like(new_max), new_max)
        weights = torch.exp(scores - shift)
        scale = torch.exp(running_max - shift)
        total = total * scale + weights.sum(-1, keepdim=True)
        block = torch.matmul(weights.to(values_h.dtype), values_h[:, start:end]).float()
        out = out * scale + block
        running_max = new_max
    return (out / total).to(values_h.dtype)


@functools.lru_cache(maxsize=64)
def _causal_tail_visible(shape, device, num_new, num_slots, group, first_slot) -> torch.Tensor:
    """`_visible` without a window, for the columns from the first new token on (small: C = n
    rounded up to KEY_ALIGN at most). Every layer of a forward asks for the same one per
    sequence, so it is built once, not per layer. Shared: read only."""
    return _visible(shape, device, num_new, num_slots, group, None, first_slot)


def _visible(
    shape, device, num_new: int, num_slots: int, group: int, window_mask, first_slot: int = 0
) -> torch.Tensor:
    """[Hkv, R, C] bool for the columns first_slot .. first_slot + C of a padded score matrix
    (R rows: g * n, then padding), shaped `shape`."""
    num_kv_heads, num_rows, num_columns = shape
    visible = torch.zeros(
        num_kv_heads, group, num_new, num_columns, dtype=torch.bool, device=device
    )
    token_mask = visibility_mask(num_new, num_slots, window_mask, device)[..., first_slot:]
    visible[..., : num_slots - first_slot] = (
        token_mask if window_mask is None else token_mask.unsqueeze(1)
    )
    visible = visible.view(num_kv_heads, group * num_new, num_columns)
    if num_rows > group * num_new:
        # Padding rows see slot 0 (or the unmasked slots before first_slot), so their softmax
        # stays finite; their output is discarded.
        extra = torch.zeros(
            num_kv_heads, num_rows - group * num_new, num_columns, dtype=torch.bool, device=device
        )
        extra[..., 0] = first_slot == 0
        visible = torch.cat([visible, extra], dim=1)
    return visible
