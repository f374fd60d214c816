"""Batched one-token attention on CPU: every sequence of a draft step over its own KV cache, in one
call that reads each cached KV head once (kernels/cpu_decode_attention.cpp).

The C++ op is compiled on first use for this machine's vector width (torch's cpp_extension, cached
under TORCH_EXTENSIONS_DIR) and registered as torch.ops.vericache_cpu.decode_attention. Where it
cannot be built (no compiler or ninja), `accepts` says no once a warning has been logged, and
callers use library attention per sequence.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("cpu_decode_attention.cpp")
# Vector flags per capability torch reports (x86). The capability is part of the extension's name,
# so a build cached for one CPU is never loaded on a machine with narrower vectors.
_ISA_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma"],
    "AVX2": ["-mavx2", "-mfma"],
}
# The kernel holds a head row in 1 to 32 vectors of 4 (ARM), 8 or 16 floats.
SUPPORTED_HEAD_DIMS = (16, 32, 64, 128)


@functools.cache
def _op():
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in _ISA_FLAGS:
        capability = "DEFAULT"  # ATen's portable vectors: 8 floats, whatever the compiler makes
    flags = _ISA_FLAGS.get(capability, [])
    flags = [*flags, f"-DCPU_CAPABILITY={capability}", f"-DCPU_CAPABILITY_{capability}"]
    try:
        from torch.utils import cpp_extension

        cpp_extension.load(
            name=f"vericache_cpu_decode_{capability.lower()}",
            sources=[str(_SOURCE)],
            extra_cflags=["-O3", "-fopenmp", *flags],
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
            verbose=False,
        )
    except Exception as error:  # no compiler or ninja: library attention instead
        logger.warning("CPU decode kernel unavailable (%s): SDPA per sequence instead", error)
        return None
    return torch.ops.vericache_cpu.decode_attention


def accepts(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the kernel serves this device, dtype and head size (it is built on first ask)."""
    return (
        device.type == "cpu"
        and dtype == torch.float32
        and head_dim in SUPPORTED_HEAD_DIMS
        and _op() is not None
    )


def decode_attention(
    queries: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]
) -> torch.Tensor:
    """Softmax attention of one new token per sequence over that sequence's whole cache.

    queries: [B, Hq, D] float32; keys[b], values[b]: [T_b, Hkv, D] with D contiguous (slot and
    head strides free), the token's own slot included. Returns [B, Hq, D]. Call only where
    `accepts` said yes."""
    return _op()(queries, keys, values, queries.shape[-1] ** -0.5)
