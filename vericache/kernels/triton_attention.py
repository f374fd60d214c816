"""Triton fused packed attention for CUDA decode steps (split-KV "flash decoding"); the torch
reference is kernels.packed_attention.packed_attention_reference, tests/test_cuda.py compares them.
Shared Triton plumbing (optional import, `available`) lives in triton_ops.py."""

import functools

import torch

from vericache.kernels.triton_ops import (
    jit,
    online_softmax_step,
    pow2_at_least,
    tl,
    triton,
    with_shared_strides,
)

# ---------------------------------------------------------------------------------------------
# Fused packed attention (split-KV "flash decoding"). Program (kv_head, split, row_tile) runs an
# online softmax for BLOCK_R query rows of one KV head over the slots of its split: first the
# quantized slots (unpacked and dequantized in registers), then the residual ones. Rows are
# ordered (group member, token) as in the reference. Partial (max, sum, weighted values) go to a
# float32 scratch, and `_combine_splits` merges the splits.


@jit
def _unpack_tile(codes_ptr, offsets, shifts, mask, BITS: tl.constexpr):
    byte = tl.load(codes_ptr + offsets, mask=mask, other=0)
    return ((byte.to(tl.int32) >> shifts) & ((1 << BITS) - 1)).to(tl.float32)


@jit
def _dequantized_block(
    key_codes_ptr,
    key_scale_ptr,
    key_zero_ptr,
    value_codes_ptr,
    value_scale_ptr,
    value_zero_ptr,
    start,
    slots,
    slot_ok,
    kv_head,
    dims,
    dim_ok,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BITS: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # Returns keys transposed [D, N] and values [N, D], float32, of quantized slots
    # slots = start + [0, BLOCK_N).
    per_byte = 8 // BITS
    packed_dim = HEAD_DIM // per_byte
    byte_of_dim, shift_of_dim = dims // per_byte, (dims % per_byte) * BITS
    slots64 = slots.to(tl.int64)
    code_rows = (slots64 * NUM_KV_HEADS + kv_head) * packed_dim  # [N]
    # Keys: per-channel scales of the slot's group.
    mask_t = dim_ok[:, None] & slot_ok[None, :]
    codes = _unpack_tile(
        key_codes_ptr,
        code_rows[None, :] + byte_of_dim[:, None],
        shift_of_dim[:, None],
        mask_t,
        BITS,
    )
    if GROUP_SIZE % BLOCK_N == 0:
        # Blocks start at multiples of BLOCK_N, so the whole block lies in one group: [D] stats.
        group = tl.cast(start // GROUP_SIZE, tl.int64)
        stat_offsets = (group * NUM_KV_HEADS + kv_head) * HEAD_DIM + dims
        scale = tl.load(key_scale_ptr + stat_offsets, mask=dim_ok, other=0.0).to(tl.float32)
        zero = tl.load(key_zero_ptr + stat_offsets, mask=dim_ok, other=0.0).to(tl.float32)
        keys_t = codes * scale[:, None] + zero[:, None]
    else:
        groups = slots64 // GROUP_SIZE
        stat_offsets = (groups[None, :] * NUM_KV_HEADS + kv_head) * HEAD_DIM + dims[:, None]
        scale = tl.load(key_scale_ptr + stat_offsets, mask=mask_t, other=0.0).to(tl.float32)
        zero = tl.load(key_zero_ptr + stat_offsets, mask=mask_t, other=0.0).to(tl.float32)
        keys_t = codes * scale + zero
    # Values: one scale per slot.
    mask = slot_ok[:, None] & dim_ok[None, :]
    codes = _unpack_tile(
        value_codes_ptr,
        code_rows[:, None] + byte_of_dim[None, :],
        shift_of_dim[None, :],
        mask,
        BITS,
    )
    stat_offsets = slots64 * NUM_KV_HEADS + kv_head
    scale = tl.load(value_scale_ptr + stat_offsets, mask=slot_ok, other=0.0).to(tl.float32)
    zero = tl.load(value_zero_ptr + stat_offsets, mask=slot_ok, other=0.0).to(tl.float32)
    return keys_t, codes * scale[:, None] + zero[:, None]


@jit
def _residual_block(
    keys_ptr,
    values_ptr,
    residual_slots,
    slot_ok,
    kv_head,
    dims,
    dim_ok,
    stride_slot,
    stride_head,
):
    # Returns keys transposed [D, N] and values [N, D], in the cache dtype. Keys and values share
    # their strides (head-major cache buffers: slot stride D, head stride capacity * D).
    offsets = residual_slots.to(tl.int64) * stride_slot + kv_head.to(tl.int64) * stride_head
    mask_t = dim_ok[:, None] & slot_ok[None, :]
    keys_t = tl.load(keys_ptr + offsets[None, :] + dims[:, None], mask=mask_t, other=0.0)
    mask = slot_ok[:, None] & dim_ok[None, :]
    values = tl.load(values_ptr + offsets[:, None] + dims[None, :], mask=mask, other=0.0)
    return keys_t, values


@jit
def _visible_tile(
    slots, slot_end, tokens, num_new, num_slots, window_ptr, HAS_WINDOW: tl.constexpr
):
    # New token m sees slots up to num_slots - num_new + m; window_ptr is this head's [n, T] mask.
    last_visible = num_slots - num_new + tokens
    visible = (slots[None, :] < slot_end) & (slots[None, :] <= last_visible[:, None])
    if HAS_WINDOW:
        offsets = tokens[:, None].to(tl.int64) * num_slots + slots[None, :]
        visible = visible & (tl.load(window_ptr + offsets, mask=visible, other=0) != 0)
    return visible


@jit
def _packed_attention_kernel(
    q_ptr,  # [n, Hq, D]
    key_codes_ptr,  # [Tq, H, D*bits/8] uint8
    key_scale_ptr,  # [Tq / group_size, H, D]
    key_zero_ptr,
    value_codes_ptr,  # [Tq, H, D*bits/8] uint8
    value_scale_ptr,  # [Tq, H, 1]
    value_zero_ptr,
    residual_keys_ptr,  # [R, H, D], strided as residual_values
    residual_values_ptr,
    window_ptr,  # [H, n, T] uint8 (unused without HAS_WINDOW)
    max_out_ptr,  # [splits, H, rows_padded] float32
    sum_out_ptr,
    acc_out_ptr,  # [splits, H, rows_padded, BLOCK_D] float32
    table_ptr,  # [S, TABLE_WIDTH] int64: each sequence's layer (with TABLE; triton_kv_table.py)
    num_new,
    num_quantized,
    num_slots,
    slots_per_split,
    residual_stride_slot,
    residual_stride_head,
    sm_scale,
    num_row_tiles,  # per sequence (with TABLE: program_id(2) is sequence * tiles + row tile)
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BITS: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    TABLE: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    kv_head, split, program = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    row_tile = program
    cache_dtype = residual_keys_ptr.dtype.element_ty
    if TABLE:
        # A static step's sequence (model/static_step.py): its packed tensors, residual and slot
        # counts from its table entry (triton_kv_table.TableEntry's 16 fields); its splits are as
        # many as the launch has, each a whole number of blocks.
        seq = program // num_row_tiles
        row_tile = program % num_row_tiles
        entry = table_ptr + seq.to(tl.int64) * 16
        residual_keys_ptr = tl.load(entry).to(tl.pointer_type(cache_dtype))
        residual_values_ptr = tl.load(entry + 1).to(tl.pointer_type(cache_dtype))
        residual_stride_head = tl.load(entry + 3)
        residual_stride_slot = HEAD_DIM
        key_codes_ptr = tl.load(entry + 9).to(tl.pointer_type(tl.uint8))
        key_scale_ptr = tl.load(entry + 10).to(tl.pointer_type(key_scale_ptr.dtype.element_ty))
        key_zero_ptr = tl.load(entry + 11).to(tl.pointer_type(key_zero_ptr.dtype.element_ty))
        value_codes_ptr = tl.load(entry + 12).to(tl.pointer_type(tl.uint8))
        value_scale_ptr = tl.load(entry + 13).to(tl.pointer_type(value_scale_ptr.dtype.element_ty))
        value_zero_ptr = tl.load(entry + 14).to(tl.pointer_type(value_zero_ptr.dtype.element_ty))
        num_quantized = tl.load(entry + 15).to(tl.int32)
        num_slots = num_quantized + (tl.load(entry + 4) + num_new).to(tl.int32)
        slots_per_split = tl.cdiv(tl.cdiv(num_slots, tl.num_programs(1)), BLOCK_N) * BLOCK_N
        q_ptr += seq.to(tl.int64) * num_new * (NUM_KV_HEADS * GROUP * HEAD_DIM)
    rows = row_tile * BLOCK_R + tl.arange(0, BLOCK_R)
    tokens, q_heads = rows % num_new, kv_head * GROUP + rows // num_new
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    q_offsets = (tokens[:, None] * (NUM_KV_HEADS * GROUP) + q_heads[:, None]) * HEAD_DIM
    q_mask = (rows[:, None] < GROUP * num_new) & dim_ok[None, :]
    q = tl.load(q_ptr + q_offsets + dims[None, :], mask=q_mask, other=0.0).to(cache_dtype)
    window_ptr += kv_head.to(tl.int64) * num_new * num_slots

    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    split_start = split * slots_per_split
    split_end = tl.minimum(split_start + slots_per_split, num_slots)
    quantized_end = tl.minimum(split_end, num_quantized)
    for start in range(split_start, quantized_end, BLOCK_N):
        slots = start + tl.arange(0, BLOCK_N)
        slot_ok = slots < quantized_end
        keys_t, values = _dequantized_block(
            key_codes_ptr,
            key_scale_ptr,
            key_zero_ptr,
            value_codes_ptr,
            value_scale_ptr,
            value_zero_ptr,
            start,
            slots,
            slot_ok,
            kv_head,
            dims,
            dim_ok,
            NUM_KV_HEADS,
            HEAD_DIM,
            BITS,
            GROUP_SIZE,
            BLOCK_N,
        )
        visible = _visible_tile(
            slots, quantized_end, tokens, num_new, num_slots, window_ptr, HAS_WINDOW
        )
        m_i, l_i, acc = online_softmax_step(
            q,
            keys_t.to(cache_dtype),
            values.to(cache_dtype),
            visible,
            m_i,
            l_i,
            acc,
            sm_scale,
            PRECISION,
        )
    for start in range(tl.maximum(split_start, num_quantized), split_end, BLOCK_N):
        slots = start + tl.arange(0, BLOCK_N)
        slot_ok = slots < split_end
        keys_t, values = _residual_block(
            residual_keys_ptr,
            residual_values_ptr,
            slots - num_quantized,
            slot_ok,
            kv_head,
            dims,
            dim_ok,
            residual_stride_slot,
            residual_stride_head,
        )
        visible = _visible_tile(
            slots, split_end, tokens, num_new, num_slots, window_ptr, HAS_WINDOW
        )
        m_i, l_i, acc = online_softmax_step(
            q, keys_t, values, visible, m_i, l_i, acc, sm_scale, PRECISION
        )

    out_rows = (split * NUM_KV_HEADS + kv_head).to(tl.int64) * tl.num_programs(2) * BLOCK_R
    out_rows += program * BLOCK_R + tl.arange(0, BLOCK_R)  # a sequence's rows follow its own
    tl.store(max_out_ptr + out_rows, m_i)
    tl.store(sum_out_ptr + out_rows, l_i)
    tl.store(acc_out_ptr + out_rows[:, None] * BLOCK_D + dims[None, :], acc)


def packed_attention(q, packed, residual_keys, residual_values, window_mask=None) -> torch.Tensor:
    """See kernels.packed_attention.packed_attention: q [n, Hq, D] -> [n, Hq * D]."""
    num_new, num_heads, head_dim = q.shape
    num_kv_heads = residual_keys.shape[1]
    group = num_heads // num_kv_heads
    num_quantized = packed.num_slots
    num_slots = num_quantized + residual_keys.shape[0]
    if num_new == 0:
        return q.new_empty(0, num_heads * head_dim)
    block_r, block_n, block_d, num_warps = _tile_sizes(group * num_new, head_dim, q.dtype)
    num_row_tiles = triton.cdiv(group * num_new, block_r)
    slots_per_split = _slots_per_split(num_slots, num_kv_heads * num_row_tiles, block_n, q.device)
    num_splits = triton.cdiv(num_slots, slots_per_split)
    rows_padded = num_row_tiles * block_r
    max_out = q.new_empty(num_splits, num_kv_heads, rows_padded, dtype=torch.float32)
    sum_out = torch.empty_like(max_out)
    acc_out = q.new_empty(num_splits, num_kv_heads, rows_padded, block_d, dtype=torch.float32)
    has_window = window_mask is not None
    window = window_mask.to(torch.uint8).contiguous() if has_window else max_out
    residual_keys, residual_values = with_shared_strides(residual_keys, residual_values)
    grid = (num_kv_heads, num_splits, num_row_tiles)
    _packed_attention_kernel[grid](
        q.contiguous(),
        *packed.kernel_arguments(),
        residual_keys,
        residual_values,
        window,
        max_out,
        sum_out,
        acc_out,
        max_out,  # no table
        num_new,
        num_quantized,
        num_slots,
        slots_per_split,
        residual_keys.stride(0),
        residual_keys.stride(1),
        head_dim**-0.5,
        num_row_tiles,
        NUM_KV_HEADS=num_kv_heads,
        GROUP=group,
        HEAD_DIM=head_dim,
        BITS=packed.bits,
        GROUP_SIZE=packed.group_size,
        HAS_WINDOW=has_window,
        TABLE=False,
        # Full fp32 products for fp32 caches (TF32 would lose the reference's precision).
        PRECISION="ieee" if residual_keys.dtype == torch.float32 else "tf32",
        BLOCK_R=block_r,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        num_warps=num_warps,
    )
    out = _combine_splits(max_out, sum_out, acc_out)[:, : group * num_new, :head_dim]
    out = out.reshape(num_kv_heads, group, num_new, head_dim).permute(2, 0, 1, 3)  # [n, H, g, D]
    return out.reshape(num_new, num_heads * head_dim).to(q.dtype)


def _tile_sizes(num_rows: int, head_dim: int, dtype) -> tuple[int, int, int, int]:
    """BLOCK_R, BLOCK_N, BLOCK_D and num_warps. Checked with ptxas for sm_90: no register spills
    up to head_dim 128 (fp32 caches) or 256 (fp16/bf16). fp32 products ("ieee") take more
    registers than tensor-core ones, hence the smaller fp32 tiles."""
    is_fp32 = dtype == torch.float32
    block_d = pow2_at_least(head_dim, 16)
    budget = 2048 if is_fp32 else 4096  # elements of the [BLOCK_R, BLOCK_D] accumulator
    # tl.dot needs at least 16 rows; more rows than fit are split over row tiles.
    block_r = max(16, min(pow2_at_least(num_rows, 16), budget // block_d))
    block_n = 16 if is_fp32 else 32
    return block_r, block_n, block_d, 4 if block_r * block_d <= budget // 2 else 8


def _slots_per_split(num_slots: int, programs_per_split: int, block_n: int, device) -> int:
    """Enough splits for about two programs per SM. A whole number of BLOCK_N blocks each, so
    every quantized block starts at a multiple of BLOCK_N (the one-group fast path needs it)."""
    target_splits = max(1, 2 * _num_sms(device) // programs_per_split)
    per_split = triton.cdiv(max(num_slots, 1), target_splits)
    return triton.cdiv(per_split, block_n) * block_n


def _num_sms(device) -> int:
    if device.type != "cuda":
        return 4  # Triton's interpreter (TRITON_INTERPRET=1) on CPU tensors: exercise splits
    return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _combine_splits(max_out, sum_out, acc_out) -> torch.Tensor:
    """[splits, H, R] maxes and sums and [splits, H, R, D] partial sums -> [H, R, D]."""
    overall = max_out.amax(0)
    overall = torch.where(overall == float("-inf"), 0.0, overall)
    weights = torch.exp(max_out - overall)  # 0 for a split in which a row saw nothing
    total = (weights * sum_out).sum(0)
    return (weights.unsqueeze(-1) * acc_out).sum(0) / total.unsqueeze(-1)
