"""Gather of kept tokens: per KV head, the slots a token-dropping compressor keeps.

`gather_slots` runs torch.gather (the reference) or, on CUDA with Triton, the fused kernel of
triton_ops.py, which tests/test_cuda.py checks against the reference.
"""

from __future__ import annotations

import torch


def gather_slots(
    keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, slot_index: torch.Tensor
):
    """keys, values: [S, H, D]; positions: [S, H]; slot_index: [k, H] int64.

    Returns keys, values [k, H, D] and positions [k, H] of the chosen slots, per head."""
    if keys.is_cuda:
        from vericache.kernels import triton_ops

        if triton_ops.available():
            return triton_ops.gather_slots(keys, values, positions, slot_index)
    index = slot_index.unsqueeze(-1).expand(*slot_index.shape, keys.shape[-1])
    return (
        torch.gather(keys, 0, index),
        torch.gather(values, 0, index),
        torch.gather(positions, 0, slot_index),
    )
