"""Asymmetric integer quantization and bit packing, pure torch (the reference on every device).

Codes are unsigned, `bits` wide, packed along the last axis: two 4-bit or four 2-bit codes per
byte, lowest bits first. Scales and zero points are float16, as KIVI stores them.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

SUPPORTED_BITS = (2, 4, 8)


def codes_per_byte(bits: int) -> int:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits}")
    return 8 // bits


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes [..., C] (values < 2**bits, C a multiple of 8 / bits) -> [..., C * bits / 8]."""
    per_byte = codes_per_byte(bits)
    if per_byte == 1:
        return codes.to(torch.uint8)
    grouped = codes.to(torch.uint8).view(*codes.shape[:-1], codes.shape[-1] // per_byte, per_byte)
    packed = grouped[..., 0].clone()
    for slot in range(1, per_byte):
        packed |= grouped[..., slot] << (bits * slot)
    return packed


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of `pack`: uint8 [..., B] -> uint8 [..., B * 8 / bits]."""
    per_byte = codes_per_byte(bits)
    if per_byte == 1:
        return packed
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    codes = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [..., B, per_byte]
    return codes.flatten(-2)


def quantize(x: torch.Tensor, bits: int, dim: int):
    """Min-max quantization with statistics taken along `dim`.

    Returns (codes uint8 shaped like x, scale fp16, zero fp16), scale and zero with `dim` kept as 1.
    The fp16 zero is rounded down and the fp16 scale up, so the grid still covers [min, max] and
    `dequantize` reproduces x to within half a step (plus float32 rounding).
    """
    levels = (1 << bits) - 1
    x32 = x.float()
    low = x32.amin(dim=dim, keepdim=True)
    high = x32.amax(dim=dim, keepdim=True)
    zero = _round_half(low, down=True)
    scale = _round_half(((high - zero.float()) / levels).clamp_min(1e-6), down=False)
    codes = ((x32 - zero.float()) / scale.float()).round_().clamp_(0, levels).to(torch.uint8)
    return codes, scale, zero


def _round_half(x: torch.Tensor, down: bool) -> torch.Tensor:
    """x to float16, rounded toward -inf (down) or +inf."""
    rounded = x.half()
    wrong_side = rounded.float() > x if down else rounded.float() < x
    target = torch.full_like(rounded, float("-inf") if down else float("inf"))
    return torch.where(wrong_side, torch.nextafter(rounded, target), rounded)


def dequantize(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, dtype) -> torch.Tensor:
    """codes * scale + zero, computed in fp32 and returned in `dtype`."""
    return (codes.float() * scale.float() + zero.float()).to(dtype)


def dequantize_packed(
    packed: torch.Tensor, bits: int, scale: torch.Tensor, zero: torch.Tensor, dtype
):
    """`dequantize(unpack(packed))` in two passes: a table maps each byte to its float codes.

    packed: uint8 [..., B]; scale, zero: broadcastable to [..., B * 8 / bits]. On CUDA with
    Triton, one fused kernel (triton_ops.py) does both passes."""
    if packed.is_cuda:
        from vericache.kernels import triton_ops  # it builds on this module: import when used

        if triton_ops.available():
            return triton_ops.dequantize_packed(packed, bits, scale, zero, dtype)
    codes = F.embedding(packed.int(), _byte_table(bits, packed.device))  # [..., B, 8 / bits]
    codes = codes.flatten(-2)
    return torch.addcmul(zero.float(), codes, scale.float()).to(dtype)


@functools.cache
def _byte_table(bits: int, device: torch.device) -> torch.Tensor:
    """[256, 8 / bits] float32: the codes a byte holds, lowest bits first."""
    return unpack(torch.arange(256, dtype=torch.uint8), bits).view(256, -1).float().to(device)
