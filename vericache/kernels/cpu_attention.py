"""Causal attention on CPU for every sequence of a forward, each over its own KV cache, in one call
per layer (kernels/cpu_attention.cpp at the repository root), and the store of their new tokens'
KV into those caches (kernels/cpu_store.cpp). Each query row is computed on its own, in a fixed
order over the slots it sees, so its result does not depend on what else shares the call: the
runner uses it for draft steps (one token each) and, being batch-invariant by construction, for
every exact forward on CPU (full decode steps and verifications alike). A third op attends over
the packed codes of a KIVI layer (kernels/cpu_packed_attention.cpp), for draft steps over a
quantized cache.

The C++ ops are compiled once per machine for its vector width (cpu_build.py: at install, or by
the first process that needs them; every later process loads the built library) and registered
as torch.ops.vericache_cpu.attention,
.store_kv and .packed_attention, which serve the same caches (`accepts`). Where they cannot be
built (no compiler or ninja), `accepts` says no once a warning has been logged, and callers use
library attention, append sequence by sequence, and dequantize packed layers block by block.
"""

from __future__ import annotations

import functools
import logging

import torch

from vericache.kernels import cpu_build

logger = logging.getLogger(__name__)

_SOURCES = ("cpu_attention.cpp", "cpu_store.cpp", "cpu_packed_attention.cpp")  # in kernels/
# Vector flags per capability torch reports (x86). The capability is part of the extension's name,
# so a build cached for one CPU is never loaded on a machine with narrower vectors.
_ISA_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma"],
    # F16C widens float16 caches (every AVX2 CPU has it; without it the AVX2 build fails).
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
}
# The kernel holds a head row in 1 to 32 vectors of 4 (ARM), 8 or 16 floats.
SUPPORTED_HEAD_DIMS = (16, 32, 64, 128)


def extension() -> cpu_build.Extension:
    """The extension's name, sources and compiler flags for this machine's vector width."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in _ISA_FLAGS:
        capability = "DEFAULT"  # ATen's portable vectors: 8 floats, whatever the compiler makes
    flags = _ISA_FLAGS.get(capability, [])
    flags = [*flags, f"-DCPU_CAPABILITY={capability}", f"-DCPU_CAPABILITY_{capability}"]
    cflags = ("-O3", "-std=c++20", "-fopenmp", *flags)
    name = f"vericache_cpu_attention_{capability.lower()}"
    sources = tuple(map(cpu_build.kernel_source, _SOURCES))
    return cpu_build.Extension(name, sources, cflags, ldflags=("-fopenmp",))


@functools.cache
def _ops():
    try:
        cpu_build.load(extension())
    except Exception as error:  # no compiler or ninja: library attention instead
        logger.warning("CPU attention kernel unavailable (%s): library attention instead", error)
        return None
    return torch.ops.vericache_cpu


def accepts(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the kernels serve this device, dtype and head size (built on first ask)."""
    return (
        device.type == "cpu"
        and dtype == torch.float32
        and head_dim in SUPPORTED_HEAD_DIMS
        and _ops() is not None
    )


def attention(
    queries: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    num_new: list[int],
    prefixes: list[tuple[torch.Tensor, torch.Tensor]] = (),
    prefix_of: list[int] | None = None,
) -> torch.Tensor:
    """Causal softmax attention of each sequence's new tokens over that sequence's cache.

    queries: [N, Hq, D] float32, the new tokens of every sequence in order; keys[b], values[b]:
    [T_b, Hkv, D] with D contiguous (slot and head strides free), whose last num_new[b] slots are
    sequence b's new tokens: its token m sees slots 0 .. T_b - num_new[b] + m. A sequence's slots
    are float32, bfloat16 or float16 (a draft cache stored in 16 bits, widened exactly as read).
    prefixes: shared prefixes' (keys, values) [P, Hkv, D], any P, in the dtype of the sequences
    that read them; prefix_of[b]: the index of the one that precedes sequence b's slots (every
    token of b sees it whole, and its whole chunks are read once for all of them), or -1. The
    result is bit for bit the one over the prefix and the sequence's slots in one buffer.
    Returns [N, Hq, D]. Call only where `accepts` said yes."""
    if prefix_of is None:
        prefix_of = [-1] * len(keys)
    prefix_keys = [k for k, _ in prefixes]
    prefix_values = [v for _, v in prefixes]
    scale = queries.shape[-1] ** -0.5
    return _ops().attention(
        queries, keys, values, num_new, prefix_keys, prefix_values, prefix_of, scale
    )


def store_kv(
    new_keys: torch.Tensor,
    new_values: torch.Tensor,
    new_positions: torch.Tensor,
    stores: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int, int]],
) -> None:
    """Writes rows of new_keys, new_values [N, Hkv, D] float32 and new_positions [N] int64 into
    head-major cache buffers, one call for a whole forward's sequences. Each store is (key buffer
    [Hkv, capacity, D], value buffer, position buffer [capacity, Hkv] int32, first slot, first
    row, num_new): rows first_row.. go to slots first_slot.. (16-bit buffers round to nearest
    even, as a copy does). Call only where `accepts` said yes."""
    keys, values, positions, starts, first_rows, counts = zip(*stores)
    _ops().store_kv(
        new_keys, new_values, new_positions, keys, values, positions, first_rows, starts, counts
    )


def packed_attention(
    rows: torch.Tensor,
    packed,
    residual_keys: torch.Tensor,
    residual_values: torch.Tensor,
    num_new: int,
) -> torch.Tensor:
    """Attention of rows [H, R, D] float32 (each KV head's query rows, ordered group member then
    token, pre-scaled) over a KIVI layer: every slot of `packed` (a
    kernels.packed_attention.PackedKV, older than every new token), then the residual [Rr, H, D]
    float32 whose last num_new slots are the new tokens, causally. Returns [H, R, D]. Call only
    where `accepts` said yes."""
    return _ops().packed_attention(
        rows.contiguous(),
        *packed.kernel_arguments(),
        residual_keys,
        residual_values,
        num_new,
        packed.bits,
        packed.group_size,
    )
