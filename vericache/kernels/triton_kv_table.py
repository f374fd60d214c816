"""The KV store and attention of a static step on CUDA (model/static_step.py), which find each
sequence's cache through a table, not through arguments: a CUDA graph captured once then serves
whichever caches a step holds (as vLLM's block tables do for its paged KV).

A table holds, per layer, one entry per sequence of the step (`TableEntry`): the addresses of its
cache's head-major key and value buffers [H, capacity, D] and position buffer [capacity, H] int32,
their head stride, the slot of its first new token, and where the sequence reads a shared prefix
first (kv/prefixed.py), that prefix's head-major buffers, head stride and length; for a KIVI
layer, the cache is its full-precision residual and the entry holds its packed part too. The
attention over full-precision slots is the batch-invariant kernel of triton_invariant_attention.py
with its sequence read from the table (TABLE): every row runs the loop a launch over its cache
alone runs, so its bits are the dynamic forward's. Over a KIVI layer it is triton_attention.py's
packed kernel (drafts: deterministic, not bit for bit the dynamic launch, whose splits follow the
slot count), its splits fixed per shape.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from vericache.kernels.triton_attention import (
    _combine_splits,
    _num_sms,
    _packed_attention_kernel,
    _tile_sizes,
)
from vericache.kernels.triton_invariant_attention import (
    BLOCK_R,
    _invariant_attention_kernel,
    block_n,
)
from vericache.kernels.triton_ops import jit, pow2_at_least, tl, triton


class TableEntry(NamedTuple):
    keys: int  # address of [H, capacity, D]
    values: int
    positions: int  # address of [capacity, H] int32
    head_stride: int  # elements from one head's slots to the next's
    first_slot: int  # where the step's first new token goes
    prefix_keys: int = 0  # address of a shared prefix's [H, P', D], or 0
    prefix_values: int = 0
    prefix_head_stride: int = 0
    num_prefix: int = 0  # P: its slots, which every new token sees before the cache's
    # A KIVI layer's packed part (kv/quantized.py; its residual is the cache above), or 0: the
    # addresses of its contiguous codes [Tq, H, D*bits/8] uint8, per-group key stats
    # [Tq / group_size, H, D] and per-slot value stats [Tq, H, 1], and Tq.
    key_codes: int = 0
    key_scale: int = 0
    key_zero: int = 0
    value_codes: int = 0
    value_scale: int = 0
    value_zero: int = 0
    num_quantized: int = 0


TABLE_WIDTH = len(TableEntry._fields)
assert TABLE_WIDTH == 16, "the kernels step through tables by 16 fields"


@jit
def _store_kernel(
    keys_ptr,  # [R, H, D] the new tokens' keys, strided rows and heads
    values_ptr,
    positions_ptr,  # [R] int64
    table_ptr,  # [S, TABLE_WIDTH] int64
    row_seq_ptr,  # [R] int32: the row's entry
    row_offset_ptr,  # [R] int32: the row's token within its sequence
    key_stride_row,
    key_stride_head,
    value_stride_row,
    value_stride_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    row, head = tl.program_id(0), tl.program_id(1)
    entry = table_ptr + tl.load(row_seq_ptr + row).to(tl.int64) * 16  # TABLE_WIDTH
    cache_keys = tl.load(entry).to(tl.pointer_type(keys_ptr.dtype.element_ty))
    cache_values = tl.load(entry + 1).to(tl.pointer_type(values_ptr.dtype.element_ty))
    cache_positions = tl.load(entry + 2).to(tl.pointer_type(tl.int32))
    head_stride = tl.load(entry + 3)
    slot = tl.load(entry + 4) + tl.load(row_offset_ptr + row)
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    row64, head64 = row.to(tl.int64), head.to(tl.int64)
    k = tl.load(keys_ptr + row64 * key_stride_row + head64 * key_stride_head + dims, mask=dim_ok)
    v = tl.load(
        values_ptr + row64 * value_stride_row + head64 * value_stride_head + dims, mask=dim_ok
    )
    slot_offset = head64 * head_stride + slot * HEAD_DIM
    tl.store(cache_keys + slot_offset + dims, k, mask=dim_ok)
    tl.store(cache_values + slot_offset + dims, v, mask=dim_ok)
    position = tl.load(positions_ptr + row).to(tl.int32)
    tl.store(cache_positions + slot * NUM_KV_HEADS + head, position)


def store_kv(
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: torch.Tensor,
    table: torch.Tensor,
    row_seq: torch.Tensor,
    row_offset: torch.Tensor,
) -> None:
    """Writes rows of keys, values [R, H, D] (last axis contiguous) and positions [R] int64 into
    the caches of `table` [S, TABLE_WIDTH]: row r to its entry row_seq[r], slot first_slot +
    row_offset[r]. The caches hold the keys' dtype."""
    num_rows, num_kv_heads, head_dim = keys.shape
    _store_kernel[(num_rows, num_kv_heads)](
        keys, values, positions, table, row_seq, row_offset,
        *keys.stride()[:2], *values.stride()[:2],
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_D=pow2_at_least(head_dim, 16),
    )  # fmt: skip


def attention(
    q: torch.Tensor, table: torch.Tensor, num_new: int, like: torch.Tensor, prefixed: bool
) -> torch.Tensor:
    """Batch-invariant causal attention of S sequences of num_new new tokens each: q [S * n, Hq,
    D], sequence s's rows s * n.., over the caches of `table` [S, TABLE_WIDTH], whose new slots
    hold those tokens already; `prefixed`: each over its entry's shared prefix first (compiled
    apart, as the dynamic forward's launches are). like: a tensor of the caches' dtype and head
    count [.., H, D]. Returns [S * n, Hq * D] in q's dtype."""
    num_rows, num_heads, head_dim = q.shape
    num_kv_heads = like.shape[-2]
    group = num_heads // num_kv_heads
    q = q if q.stride(-1) == 1 else q.contiguous()
    out = q.new_empty(num_rows, num_heads, head_dim)
    grid = (num_kv_heads, triton.cdiv(group * num_new, BLOCK_R), table.shape[0])
    _invariant_attention_kernel[grid](
        q, like, like, like, like, q, q, q, q, q, out, table,
        num_new, 0, 0, 0,
        *q.stride()[:2],
        0, 0, 0, 0, 0, 0, 0, 0,  # strides: the table's
        head_dim**-0.5,
        GROUP=group, HEAD_DIM=head_dim, HAS_PREFIX=prefixed, HAS_WINDOW=False, PASS="whole",
        TABLE=True, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        BLOCK_R=BLOCK_R, BLOCK_N=block_n(head_dim, q.dtype),
        BLOCK_D=pow2_at_least(head_dim, 16), num_warps=4,
    )  # fmt: skip
    return out.view(num_rows, num_heads * head_dim)


def packed_attention(
    q: torch.Tensor,
    table: torch.Tensor,
    num_new: int,
    like: torch.Tensor,
    bits: int,
    group_size: int,
) -> torch.Tensor:
    """Causal attention of S sequences of num_new new tokens each (q [S * n, Hq, D], sequence
    s's rows s * n..) over the KIVI layers of `table` [S, TABLE_WIDTH], the new tokens the last
    slots of their residuals already. like: a tensor of the residuals' dtype and head count
    [.., H, D]. Splits: about two programs per SM, fixed for the shape (a graph replays them
    whatever the slot counts). Returns [S * n, Hq * D] in q's dtype."""
    num_rows, num_heads, head_dim = q.shape
    num_seqs, num_kv_heads = table.shape[0], like.shape[-2]
    group = num_heads // num_kv_heads
    block_r, block_n, block_d, num_warps = _tile_sizes(group * num_new, head_dim, q.dtype)
    num_row_tiles = triton.cdiv(group * num_new, block_r)
    programs = num_kv_heads * num_row_tiles * num_seqs
    num_splits = max(1, min(32, 2 * _num_sms(q.device) // programs))
    rows_padded = num_row_tiles * block_r
    max_out = q.new_empty(num_splits, num_kv_heads, num_seqs * rows_padded, dtype=torch.float32)
    sum_out = torch.empty_like(max_out)
    acc_out = q.new_empty(*max_out.shape, block_d, dtype=torch.float32)
    codes = q.new_empty(1, dtype=torch.uint8)  # the pointers' types; the table gives them
    stats = q.new_empty(1, dtype=torch.float16)
    _packed_attention_kernel[(num_kv_heads, num_splits, num_seqs * num_row_tiles)](
        q.contiguous(), codes, stats, stats, codes, stats, stats, like, like,
        max_out, max_out, sum_out, acc_out, table,
        num_new, 0, 0, 0, 0, 0, head_dim**-0.5, num_row_tiles,
        NUM_KV_HEADS=num_kv_heads, GROUP=group, HEAD_DIM=head_dim, BITS=bits,
        GROUP_SIZE=group_size, HAS_WINDOW=False, TABLE=True,
        PRECISION="ieee" if like.dtype == torch.float32 else "tf32",
        BLOCK_R=block_r, BLOCK_N=block_n, BLOCK_D=block_d, num_warps=num_warps,
    )  # fmt: skip
    out = _combine_splits(max_out, sum_out, acc_out)  # [H, S * rows_padded, BLOCK_D]
    out = out.view(num_kv_heads, num_seqs, rows_padded, block_d)[:, :, : group * num_new]
    out = out[..., :head_dim].reshape(num_kv_heads, num_seqs, group, num_new, head_dim)
    out = out.permute(1, 3, 0, 2, 4)  # [S, n, H, g, D]
    return out.reshape(num_rows, num_heads * head_dim).to(q.dtype)
