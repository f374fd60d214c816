"""Triton batch-invariant attention for CUDA: the exact forwards' attention (verification and
full-KV decoding), where the torch version (model/kernels.py `_blocked_invariant_attention`) runs
a loop of small products and took 575 ms for a 31-token verification of the embedded model at 8k
on an H200 (bench/results/decode_speed_cuda.json).

Program (kv_head, row_tile) runs an online softmax for BLOCK_R query rows of one KV head over
every slot, in blocks of BLOCK_N slots starting at slot 0. The tile sizes depend only on the
dtypes and head size, never on how many tokens are new, so a one-token step and a verification
run the same compiled kernel, and each row's arithmetic is the same in both: a row's own products
do not read its neighbours in the tile, and blocks past its last visible slot change nothing bit
for bit (their probabilities are exactly 0 and the running scale exactly 1). No split over slots
yet: at this model size the exact forwards are bound by kernel launches (38 ms a step, 3 programs
over 8k slots in float32). Splits at fixed slot boundaries, merged in order, would stay invariant
(an empty split merges as an exact no-op), as would ending each tile at its last visible slot.

Keys and values are read through their strides (head-major cache buffers viewed [T, H, D] need no
copy) and in their own dtype, converted in registers to q's: a float32 model attends over a
16-bit draft cache without converting it first.

A shared prefix (kv/prefixed.py: sessions read one copy of a prefix's KV, and each session's cache
holds only its later tokens) is a second segment read before the cache, through its own pointers: a
row's online softmax runs over blocks of [prefix | cache], starting at slot 0 as in one buffer of
the two, so every block holds the slots it would hold there and the result is that buffer's bit
for bit, with no copy of the prefix into each session. The prefix may have any length P (a
session's whole prefix): the one block holding slots P - 1 and P, where P is not a multiple of
BLOCK_N, straddles the segments and loads each slot from its own, the same bits as from one buffer.

Several sequences over one prefix read it once between them (`cascade_attention`, cascade
attention): a first launch runs the prefix's whole blocks of PREFIX_BLOCK slots for the rows of all
of them, gathered from the layer's queries by token, and stores each row's running state (max,
sum, unnormalised output, in float32: exact); then each sequence's launch loads its rows' state and
runs the blocks of [the prefix's tail | its cache], which start where the first launch stopped.
All passes are one kernel, so a block runs the same instructions in each (the pass picks only
where rows, state and output come from), and a row's results do not depend on the rows beside it
in a tile: each row ends as in one launch over [prefix | cache], bit for bit.
"""

import functools

import torch

from vericache.kernels.triton_ops import jit, online_softmax_step, pow2_at_least, tl, triton

# The cascade's prefix pass covers whole blocks of this many slots, a multiple of every BLOCK_N
# (`block_n`), so the own passes' blocks, starting there, are those of one buffer.
PREFIX_BLOCK = 64
# Rows per program: fixed, so the kernel compiled for a step of one token is the verification's.
BLOCK_R = 16


@jit(do_not_specialize=["num_new", "num_slots", "num_prefix", "state_first_row"])
def _invariant_attention_kernel(
    q_ptr,  # [n, Hq, D]; in the prefix pass [N, Hq, D], rows picked through token_index_ptr
    keys_ptr,  # [T, H, D], strided
    values_ptr,
    prefix_keys_ptr,  # [P, H, D], strided (unused without HAS_PREFIX)
    prefix_values_ptr,
    window_ptr,  # [H, n, T] uint8 (unused without HAS_WINDOW)
    token_index_ptr,  # [n] int32: the prefix pass's rows in q (unused in the other passes)
    state_max_ptr,  # [M, Hq] float32: running state after the prefix (unused in the whole pass)
    state_sum_ptr,  # [M, Hq] float32
    state_acc_ptr,  # [M, Hq, D] float32, unnormalised
    out_ptr,  # [n, Hq, D], contiguous (unused in the prefix pass)
    table_ptr,  # [S, TABLE_WIDTH] int64: each sequence's cache (with TABLE; triton_kv_table.py)
    num_new,
    num_slots,
    num_prefix,  # P, any length
    state_first_row,  # the own pass's first token among the state's M
    q_stride_token,
    q_stride_head,
    key_stride_slot,
    key_stride_head,
    value_stride_slot,
    value_stride_head,
    prefix_key_stride_slot,
    prefix_key_stride_head,
    prefix_value_stride_slot,
    prefix_value_stride_head,
    sm_scale,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HAS_PREFIX: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    PASS: tl.constexpr,  # "whole", "prefix" or "own" (see `cascade_attention`)
    TABLE: tl.constexpr,  # program_id(2) is a sequence whose cache its table entry gives
    PRECISION: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    kv_head, row_tile = tl.program_id(0), tl.program_id(1)
    compute_dtype = q_ptr.dtype.element_ty
    num_heads = GROUP * tl.num_programs(0)
    if TABLE:
        # A static step's sequence (model/static_step.py): its rows of q and out, and its cache's
        # head-major buffers [H, capacity, D] with its slot count, found in its table entry. The
        # loop below is the one a launch over that cache alone runs: the same bits.
        seq = tl.program_id(2)
        entry = table_ptr + seq * 16  # triton_kv_table.TableEntry's fields
        keys_ptr = tl.load(entry).to(tl.pointer_type(keys_ptr.dtype.element_ty))
        values_ptr = tl.load(entry + 1).to(tl.pointer_type(values_ptr.dtype.element_ty))
        key_stride_head = tl.load(entry + 3)
        value_stride_head = key_stride_head
        key_stride_slot = HEAD_DIM
        value_stride_slot = HEAD_DIM
        num_slots = (tl.load(entry + 4) + num_new).to(tl.int32)
        if HAS_PREFIX:  # its shared prefix's layer, head-major too
            prefix_keys_ptr = tl.load(entry + 5).to(tl.pointer_type(keys_ptr.dtype.element_ty))
            prefix_values_ptr = tl.load(entry + 6).to(tl.pointer_type(values_ptr.dtype.element_ty))
            prefix_key_stride_head = tl.load(entry + 7)
            prefix_value_stride_head = prefix_key_stride_head
            prefix_key_stride_slot = HEAD_DIM
            prefix_value_stride_slot = HEAD_DIM
            num_prefix = tl.load(entry + 8).to(tl.int32)
        q_ptr += seq.to(tl.int64) * num_new * q_stride_token
        out_ptr += seq.to(tl.int64) * num_new * num_heads * HEAD_DIM
    rows = row_tile * BLOCK_R + tl.arange(0, BLOCK_R)  # ordered (group member, token)
    row_ok = rows < GROUP * num_new
    tokens, q_heads = rows % num_new, kv_head * GROUP + rows // num_new
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    row_mask = row_ok[:, None] & dim_ok[None, :]
    # Slots are counted in [prefix | cache]: the cache's first is P.
    total_slots = num_prefix + num_slots
    if PASS == "prefix":
        # Tokens of several sequences, each seeing every slot of the prefix (it precedes them).
        # A runtime bound, as in the other passes: an all-true mask known to the compiler would
        # let it fuse the scaling and the shift of the scores into one FMA, rounded otherwise.
        q_tokens = tl.load(token_index_ptr + tokens, mask=row_ok, other=0)
        last_visible = tl.zeros([BLOCK_R], tl.int32) + (total_slots - 1)
    else:
        q_tokens = tokens
        last_visible = total_slots - num_new + tokens  # [R]
    q_offsets = q_tokens.to(tl.int64) * q_stride_token + q_heads.to(tl.int64) * q_stride_head
    q = tl.load(q_ptr + q_offsets[:, None] + dims[None, :], mask=row_mask, other=0.0)
    key_base = keys_ptr + kv_head.to(tl.int64) * key_stride_head
    value_base = values_ptr + kv_head.to(tl.int64) * value_stride_head
    prefix_key_base = prefix_keys_ptr + kv_head.to(tl.int64) * prefix_key_stride_head
    prefix_value_base = prefix_values_ptr + kv_head.to(tl.int64) * prefix_value_stride_head
    window_row = (kv_head.to(tl.int64) * num_new + tokens) * num_slots  # [R]
    state_rows = (state_first_row + tokens).to(tl.int64) * num_heads + q_heads  # [R]

    if PASS == "own":
        # The prefix pass's state: the loop goes on as over one buffer [prefix | cache]. The
        # launch counts slots from where that pass stopped (a multiple of PREFIX_BLOCK, so of
        # BLOCK_N), its prefix the tail of the prefix: only which slots a row sees matters, and
        # the blocks then are the whole pass's. Padding rows start afresh, as there.
        m_i = tl.load(state_max_ptr + state_rows, mask=row_ok, other=float("-inf"))
        l_i = tl.load(state_sum_ptr + state_rows, mask=row_ok, other=0.0)
        acc_offsets = state_rows[:, None] * HEAD_DIM + dims[None, :]
        acc = tl.load(state_acc_ptr + acc_offsets, mask=row_mask, other=0.0)
    else:
        m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_R], tl.float32)
        acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    # One loop over both segments, so a block of the prefix runs the very instructions of a block
    # of one buffer [prefix | cache] (two loops compiled apart could differ, e.g. in FMA
    # contraction); only where the block's slots are read from is chosen per block.
    for start in range(0, total_slots, BLOCK_N):
        slots = start + tl.arange(0, BLOCK_N)
        slot_ok = slots < total_slots
        key_ptr, key_stride = key_base, key_stride_slot
        value_ptr, value_stride = value_base, value_stride_slot
        first, end = num_prefix, total_slots  # [first, end): the segment of its first slot
        if HAS_PREFIX:
            if start < num_prefix:
                key_ptr, key_stride = prefix_key_base, prefix_key_stride_slot
                value_ptr, value_stride = prefix_value_base, prefix_value_stride_slot
                first, end = 0, num_prefix
        # Slots past the segment's end load as 0: the cache's, in a block that straddles (read
        # below), or past the last slot, whose probabilities are 0 (and 0 * 0 adds nothing).
        keys_t, values = _load_block(
            key_ptr, value_ptr, key_stride, value_stride, slots - first, slots < end, dims, dim_ok
        )
        if HAS_PREFIX:
            # P need not be a multiple of BLOCK_N: the block holding slot P straddles, and its
            # slots from P on are the cache's. A uniform branch, taken by that block alone: the
            # others keep their one load, and this one feeds the same step the same bits.
            if (start < num_prefix) & (num_prefix < start + BLOCK_N):
                in_cache = slots >= num_prefix
                cache_keys_t, cache_values = _load_block(
                    key_base, value_base, key_stride_slot, value_stride_slot,
                    slots - num_prefix, in_cache & slot_ok, dims, dim_ok,
                )  # fmt: skip
                keys_t = tl.where(in_cache[None, :], cache_keys_t, keys_t)
                values = tl.where(in_cache[:, None], cache_values, values)
        visible = slot_ok[None, :] & (slots[None, :] <= last_visible[:, None])
        if HAS_WINDOW:  # only without a prefix (P = 0): slots are the window's columns
            window = tl.load(window_ptr + window_row[:, None] + slots[None, :], mask=visible)
            visible = visible & (window != 0)
        keys_t, values = keys_t.to(compute_dtype), values.to(compute_dtype)
        m_i, l_i, acc = online_softmax_step(
            q, keys_t, values, visible, m_i, l_i, acc, sm_scale, PRECISION
        )
    if PASS == "prefix":  # unnormalised: the own pass goes on from here
        tl.store(state_max_ptr + state_rows, m_i, mask=row_ok)
        tl.store(state_sum_ptr + state_rows, l_i, mask=row_ok)
        tl.store(state_acc_ptr + state_rows[:, None] * HEAD_DIM + dims[None, :], acc, mask=row_mask)
    else:
        # Every row sees at least its own token (a padding row repeats a real row's token), so
        # l_i > 0; padding rows are not stored.
        out = acc / l_i[:, None]
        out_offsets = (tokens.to(tl.int64) * num_heads + q_heads) * HEAD_DIM
        tl.store(
            out_ptr + out_offsets[:, None] + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_mask,
        )


@jit
def _load_block(key_ptr, value_ptr, key_stride, value_stride, local, ok, dims, dim_ok):
    # Keys [D, N] and values [N, D] of a block's slots, `local` within their segment; slots not
    # `ok` load as 0.
    local64 = local.to(tl.int64)
    key_offsets = local64[None, :] * key_stride + dims[:, None]
    keys_t = tl.load(key_ptr + key_offsets, mask=dim_ok[:, None] & ok[None, :], other=0)
    value_offsets = local64[:, None] * value_stride + dims[None, :]
    values = tl.load(value_ptr + value_offsets, mask=ok[:, None] & dim_ok[None, :], other=0)
    return keys_t, values


def invariant_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    num_slots: int,
    window_mask: torch.Tensor | None = None,
    prefix_keys: torch.Tensor | None = None,
    prefix_values: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of n new tokens over a cache whose last n slots are those tokens.

    q: [n, Hq, D]; keys, values: [T', H, D] with T' >= num_slots, any dtype and slot/head strides
    (the last axis contiguous); window_mask: optional [H, n, num_slots] bool, False where a
    sliding window hides a slot. prefix_keys, prefix_values: optional [P, H, D], as keys and in
    their dtype, any P: a shared prefix every row sees in full before the cache, the result bit
    for bit that over the two concatenated (P + num_slots slots). Not with a window_mask (callers
    concatenate instead). Returns [n, Hq * D] in q's dtype."""
    has_prefix = prefix_keys is not None
    if has_prefix != (prefix_values is not None):
        raise ValueError("prefix_keys and prefix_values go together")
    if has_prefix:
        if window_mask is not None:
            raise ValueError("a window_mask over a shared prefix is not supported")
        _check_prefix(prefix_keys, prefix_values, keys)
    num_new, num_heads, head_dim = q.shape
    out = q.new_empty(num_new, num_heads, head_dim)
    if num_new == 0:
        return out.view(0, num_heads * head_dim)
    window = window_mask.to(torch.uint8).contiguous() if window_mask is not None else None
    prefix = (prefix_keys, prefix_values) if has_prefix else None
    _launch(q, keys, values, num_new, num_slots, "whole", out, prefix=prefix, window=window)
    return out.view(num_new, num_heads * head_dim)


def cascade_attention(
    q: torch.Tensor,
    spans: list[tuple[int, int]],
    own: list[tuple[torch.Tensor, torch.Tensor, int]],
    prefix_keys: torch.Tensor,
    prefix_values: torch.Tensor,
) -> list[torch.Tensor]:
    """`invariant_attention` of several sequences over one shared prefix, which is read once for
    the rows of all of them (cascade attention); each result is bit for bit the sequence's own
    `invariant_attention` call, with or without the prefix concatenated to its cache.

    q: [N, Hq, D], a layer's new tokens; spans: each sequence's rows start:end of q; own: each
    sequence's cache (keys, values [T', H, D], num_slots), whose last end - start slots are those
    rows; prefix_keys, prefix_values: [P, H, D], any P. Returns [end - start, Hq * D] per
    sequence, in q's dtype."""
    if len(spans) != len(own):
        raise ValueError(f"{len(spans)} spans of q for {len(own)} caches")
    for keys, _, _ in own:
        _check_prefix(prefix_keys, prefix_values, keys)
    num_prefix = prefix_keys.shape[0]
    # The prefix pass stops at a block boundary of every BLOCK_N; the own passes read the rest.
    aligned = num_prefix // PREFIX_BLOCK * PREFIX_BLOCK
    # Nothing to share (one sequence, or no whole block): one launch per sequence reads both,
    # the same bits.
    if len(spans) < 2 or aligned == 0:
        return [
            invariant_attention(
                q[start:end], keys, values, num_slots, None, prefix_keys, prefix_values
            )
            for (start, end), (keys, values, num_slots) in zip(spans, own)
        ]
    num_heads, head_dim = q.shape[1:]
    token_index = _token_index(tuple(spans), q.device)
    num_rows = token_index.numel()
    state = (
        q.new_empty(num_rows, num_heads, dtype=torch.float32),  # running max
        q.new_empty(num_rows, num_heads, dtype=torch.float32),  # running sum
        q.new_empty(num_rows, num_heads, head_dim, dtype=torch.float32),  # unnormalised output
    )
    # The prefix pass: every row's cache is the prefix's first `aligned` slots, all visible.
    _launch(
        q, prefix_keys[:aligned], prefix_values[:aligned], num_rows, aligned, "prefix",
        token_index=token_index, state=state,
    )  # fmt: skip
    # Each own pass goes on over [tail | cache], its blocks aligned at `aligned` as the whole
    # pass's; the tail is a view of the prefix, not a copy.
    tail = (prefix_keys[aligned:], prefix_values[aligned:]) if aligned < num_prefix else None
    outputs, first_row = [], 0
    for (start, end), (keys, values, num_slots) in zip(spans, own):
        num_new = end - start
        out = q.new_empty(num_new, num_heads, head_dim)
        _launch(
            q[start:end], keys, values, num_new, num_slots, "own", out,
            prefix=tail, state=state, state_first_row=first_row,
        )  # fmt: skip
        outputs.append(out.view(num_new, num_heads * head_dim))
        first_row += num_new
    return outputs


def _launch(
    q,
    keys,
    values,
    num_new: int,
    num_slots: int,
    pass_name: str,
    out=None,
    *,
    prefix=None,
    window=None,
    token_index=None,
    state=None,
    state_first_row: int = 0,
) -> None:
    """One launch over num_new tokens of q (see the kernel's arguments); `prefix` is the segment
    a whole or own pass reads before the cache."""
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = keys.shape[1]
    group = num_heads // num_kv_heads
    q, keys, values = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, keys, values))
    if prefix is not None:
        prefix_keys, prefix_values = (t if t.stride(-1) == 1 else t.contiguous() for t in prefix)
    else:  # never read: HAS_PREFIX=False compiles the prefix's branch away
        prefix_keys, prefix_values = keys, values
    unread = q  # a pointer for the arguments this pass compiles away
    state_max, state_sum, state_acc = state if state is not None else (unread,) * 3
    grid = (num_kv_heads, triton.cdiv(group * num_new, BLOCK_R))
    _invariant_attention_kernel[grid](
        q,
        keys,
        values,
        prefix_keys,
        prefix_values,
        window if window is not None else unread,
        token_index if token_index is not None else unread,
        state_max,
        state_sum,
        state_acc,
        out if out is not None else unread,
        unread,
        num_new,
        num_slots,
        prefix_keys.shape[0] if prefix is not None else 0,
        state_first_row,
        *q.stride()[:2],  # token, head
        *keys.stride()[:2],  # slot, head
        *values.stride()[:2],
        *prefix_keys.stride()[:2],
        *prefix_values.stride()[:2],
        head_dim**-0.5,
        GROUP=group,
        HEAD_DIM=head_dim,
        HAS_PREFIX=prefix is not None,
        HAS_WINDOW=window is not None,
        PASS=pass_name,
        TABLE=False,
        # Full fp32 products for fp32 models (TF32 would lose the CPU path's precision).
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        BLOCK_R=BLOCK_R,
        BLOCK_N=block_n(head_dim, q.dtype),
        BLOCK_D=pow2_at_least(head_dim, 16),
        num_warps=4,
    )


def _check_prefix(prefix_keys: torch.Tensor, prefix_values: torch.Tensor, keys: torch.Tensor):
    if prefix_keys.shape != prefix_values.shape or prefix_keys.shape[1:] != keys.shape[1:]:
        raise ValueError(
            f"prefix keys {tuple(prefix_keys.shape)} and values "
            f"{tuple(prefix_values.shape)} must be [P, {keys.shape[1]}, {keys.shape[2]}]"
        )
    # Any length will do (a block straddling the segments reads each slot from its own), but
    # one dtype: the kernel picks a block's pointers from either segment and merges their loads.
    if (prefix_keys.dtype, prefix_values.dtype) != (keys.dtype, keys.dtype):
        raise ValueError(f"a shared prefix in {prefix_keys.dtype} over a cache in {keys.dtype}")


@functools.lru_cache(maxsize=64)
def _token_index(spans: tuple[tuple[int, int], ...], device: torch.device) -> torch.Tensor:
    """[M] int32: the rows of q that the spans cover, in order. Every layer of a forward asks for
    the same one, so it is built (and copied to the device) once. Shared: read only."""
    rows = torch.cat([torch.arange(start, end, dtype=torch.int32) for start, end in spans])
    if device.type != "cuda":
        return rows.to(device)
    # Pinned, so that the copy does not wait for the device to finish its queue.
    return rows.pin_memory().to(device, non_blocking=True)


def block_n(head_dim: int, dtype) -> int:
    """Slots per block, from the dtype and head size alone (see the module docstring): fp32
    products ("ieee") and wide heads take more registers. Each divides PREFIX_BLOCK."""
    return 32 if dtype == torch.float32 or head_dim > 128 else 64
