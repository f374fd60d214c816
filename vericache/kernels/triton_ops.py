"""Triton versions of this package's ops, for CUDA tensors. Each has its torch reference's signature
and semantics, and tests/test_cuda.py and tests/test_cuda_invariant.py check it against that
reference:

- `dequantize_packed`  == kernels.quant.dequantize_packed
- `packed_attention`   == kernels.packed_attention.packed_attention_reference (decode: n small),
  in triton_attention.py
- `gather_slots`       == kernels.gather.gather_slots
- `invariant_attention`: the batch-invariant attention of vericache/model/kernels.py (same
  semantics; a token's bits do not depend on how many are new), in
  triton_invariant_attention.py

Triton is optional: without it this module still imports and `available()` is False (the
dispatching entries, e.g. kernels.packed_attention.packed_attention, then run the references).
The kernels widen slot indices to int64 before scaling them by a stride, so a layer may hold more
than 2**31 elements. Checked without a GPU: Triton's interpreter (TRITON_INTERPRET=1) against the
references, and an ahead-of-time compile for sm_90.
"""

import contextlib
import types

import torch

from vericache.kernels import quant

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the kernels below stay plain, never-called functions
    triton = None
    tl = types.SimpleNamespace(constexpr=None)  # only evaluated in the kernels' annotations


_switched_off = False


def available() -> bool:
    """True when Triton is installed, a CUDA device is present and `switched_off` is not active."""
    return triton is not None and not _switched_off and torch.cuda.is_available()


@contextlib.contextmanager
def switched_off():
    """Inside the block the dispatching entries run their torch paths: the baseline a benchmark
    compares the kernels with, in the same process."""
    global _switched_off
    previous, _switched_off = _switched_off, True
    try:
        yield
    finally:
        _switched_off = previous


def jit(fn=None, **options):
    """triton.jit, usable bare (`@jit`) or with options (`@jit(do_not_specialize=[...])`)."""
    if fn is None:
        return lambda inner: jit(inner, **options)
    return triton.jit(fn, **options) if triton is not None else fn


def pow2_at_least(value: int, floor: int) -> int:
    return max(floor, 1 << max(value - 1, 0).bit_length())


def with_shared_strides(keys: torch.Tensor, values: torch.Tensor):
    """keys and values [S, H, D] as they are when they share strides and their last axis is
    contiguous (a cache's head-major buffers: no copy), else both made contiguous."""
    if keys.stride() == values.stride() and keys.stride(-1) == 1:
        return keys, values
    return keys.contiguous(), values.contiguous()


@jit
def online_softmax_step(
    q, keys_t, values, visible, m_i, l_i, acc, sm_scale, PRECISION: tl.constexpr
):
    # One block of an online softmax over slots (flash attention). q [R, D], keys_t [D, N],
    # values [N, D] in one dtype; visible [R, N]; running max m_i and sum l_i [R], acc [R, D].
    scores = tl.dot(q, keys_t, input_precision=PRECISION) * sm_scale
    scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    # Rows that have seen no visible slot keep max -inf; shifting by 0 keeps exp finite.
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    correction = tl.exp(m_i - shift)
    probs = tl.exp(scores - shift[:, None])
    l_i = l_i * correction + tl.sum(probs, 1)
    acc = acc * correction[:, None]
    acc += tl.dot(probs.to(values.dtype), values, input_precision=PRECISION)
    return m_new, l_i, acc


# ---------------------------------------------------------------------------------------------
# Unpack + dequantize: out = code * scale + zero, in float32, stored in the output dtype.
# Tensors are viewed as 4-D [A, B, C, codes] with explicit strides, so scales broadcast (stride 0)
# without being materialised.


@jit
def _dequantize_kernel(
    packed_ptr,
    scale_ptr,
    zero_ptr,
    out_ptr,
    size_b,
    size_c,
    num_codes,
    packed_strides_0,
    packed_strides_1,
    packed_strides_2,
    packed_strides_3,
    scale_strides_0,
    scale_strides_1,
    scale_strides_2,
    scale_strides_3,
    zero_strides_0,
    zero_strides_1,
    zero_strides_2,
    zero_strides_3,
    BITS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # flat index over [A, B, C]
    a, b, c = row // (size_b * size_c), (row // size_c) % size_b, row % size_c
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_row = cols < num_codes
    per_byte = 8 // BITS
    byte_offsets = a * packed_strides_0 + b * packed_strides_1 + c * packed_strides_2
    byte = tl.load(packed_ptr + byte_offsets + (cols // per_byte) * packed_strides_3, mask=in_row)
    codes = (byte.to(tl.int32) >> ((cols % per_byte) * BITS)) & ((1 << BITS) - 1)
    scale_offsets = a * scale_strides_0 + b * scale_strides_1 + c * scale_strides_2
    scale = tl.load(scale_ptr + scale_offsets + cols * scale_strides_3, mask=in_row, other=0.0)
    zero_offsets = a * zero_strides_0 + b * zero_strides_1 + c * zero_strides_2
    zero = tl.load(zero_ptr + zero_offsets + cols * zero_strides_3, mask=in_row, other=0.0)
    out = codes.to(tl.float32) * scale.to(tl.float32) + zero.to(tl.float32)
    tl.store(out_ptr + row * num_codes + cols, out.to(out_ptr.dtype.element_ty), mask=in_row)


def dequantize_packed(
    packed: torch.Tensor, bits: int, scale: torch.Tensor, zero: torch.Tensor, dtype
) -> torch.Tensor:
    """packed: uint8 [..., B]; scale, zero: broadcastable to [..., B * 8 / bits] (up to 4-D)."""
    num_codes = packed.shape[-1] * quant.codes_per_byte(bits)
    shape = torch.broadcast_shapes((*packed.shape[:-1], num_codes), scale.shape, zero.shape)
    if len(shape) > 4 or shape[-1] != num_codes:
        # Not the dispatching entry of quant.py: that one may call back here.
        return quant.dequantize(quant.unpack(packed, bits), scale, zero, dtype)
    out = torch.empty(shape, dtype=dtype, device=packed.device)
    if out.numel() == 0:
        return out
    lead = (None,) * (4 - len(shape))  # prepend size-1 axes: views, whatever the strides
    packed4 = packed.expand(*shape[:-1], packed.shape[-1])[lead]
    scale4, zero4 = scale.expand(shape)[lead], zero.expand(shape)[lead]
    size_a, size_b, size_c, _ = packed4.shape
    block = min(1024, pow2_at_least(num_codes, 16))
    grid = (size_a * size_b * size_c, triton.cdiv(num_codes, block))
    _dequantize_kernel[grid](
        packed4,
        scale4,
        zero4,
        out,
        size_b,
        size_c,
        num_codes,
        *packed4.stride(),
        *scale4.stride(),
        *zero4.stride(),
        BITS=bits,
        BLOCK=block,
    )
    return out


# ---------------------------------------------------------------------------------------------
# Gather of kept slots: program (kept slot i, head h) copies one head's key and value rows. The
# inputs are read through their strides: a cache's head-major buffers need no copy.


@jit
def _gather_kernel(
    keys_ptr,  # [S, H, D], strided as values
    values_ptr,
    positions_ptr,  # [S, H], strided
    index_ptr,  # [k, H], strided
    out_keys_ptr,  # [k, H, D], contiguous
    out_values_ptr,
    out_positions_ptr,  # [k, H], contiguous
    num_heads,
    head_dim,
    kv_stride_slot,
    kv_stride_head,
    positions_stride_slot,
    positions_stride_head,
    index_stride_kept,
    index_stride_head,
    BLOCK_D: tl.constexpr,
):
    kept, head = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    slot = tl.load(index_ptr + kept * index_stride_kept + head * index_stride_head).to(tl.int64)
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < head_dim
    source = slot * kv_stride_slot + head * kv_stride_head + dims
    target = (kept * num_heads + head) * head_dim + dims
    tl.store(out_keys_ptr + target, tl.load(keys_ptr + source, mask=dim_ok), mask=dim_ok)
    tl.store(out_values_ptr + target, tl.load(values_ptr + source, mask=dim_ok), mask=dim_ok)
    position = tl.load(positions_ptr + slot * positions_stride_slot + head * positions_stride_head)
    tl.store(out_positions_ptr + kept * num_heads + head, position)


def gather_slots(
    keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, slot_index: torch.Tensor
):
    """keys, values: [S, H, D]; positions: [S, H]; slot_index: [k, H] int64, each in [0, S)
    (unchecked: an out-of-range index reads out of bounds, where torch.gather would raise).

    Returns keys, values [k, H, D] and positions [k, H] of the chosen slots, per head."""
    num_kept, num_heads = slot_index.shape
    head_dim = keys.shape[-1]
    out_keys = keys.new_empty(num_kept, num_heads, head_dim)
    out_values = values.new_empty(num_kept, num_heads, head_dim)
    out_positions = positions.new_empty(num_kept, num_heads)
    if not (num_kept and num_heads):
        return out_keys, out_values, out_positions
    keys, values = with_shared_strides(keys, values)
    _gather_kernel[(num_kept, num_heads)](
        keys,
        values,
        positions,
        slot_index,
        out_keys,
        out_values,
        out_positions,
        num_heads,
        head_dim,
        *keys.stride()[:2],
        *positions.stride(),
        *slot_index.stride(),
        BLOCK_D=pow2_at_least(head_dim, 16),
    )
    return out_keys, out_values, out_positions
