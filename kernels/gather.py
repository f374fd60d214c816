"""Gather of kept tokens: per KV head, the slots a token-dropping compressor keeps.

`gather_slots` is the reference (torch.gather, any device); on CUDA, `kernels.triton_ops` provides
a fused version of the same op, checked against this one in tests/test_cuda.py.
"""

from __future__ import annotations

import torch


def gather_slots(
    keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, slot_index: torch.Tensor
):
    """keys, values: [S, H, D]; positions: [S, H]; slot_index: [k, H] int64.

    Returns keys, values [k, H, D] and positions [k, H] of the chosen slots, per head."""
    index = slot_index.unsqueeze(-1).expand(*slot_index.shape, keys.shape[-1])
    return (
        torch.gather(keys, 0, index),
        torch.gather(values, 0, index),
        torch.gather(positions, 0, slot_index),
    )
