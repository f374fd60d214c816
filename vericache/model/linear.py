"""Linear layers on the fastest kernel the device offers, in both kernel sets.

On CPU, torch's oneDNN linear kernel (the one torch's compiler uses for CPU linear layers) runs
decode-sized products about twice as fast as MKL's F.linear on this project's machines, and its
rows are invariant to the row count from two rows up (a lone row takes a matrix-vector path). Its
weights are packed once into oneDNN's blocked layout (as torch's compiler freezes them), which
spares every call the reorder: the products of a step of 10 rows took 20 to 12 ms on the embedded
model, with the same bits. So:
- batch-invariant set: oneDNN for every row count, a lone row padded to two;
- fast set: oneDNN up to SMALL_BATCH_ROWS rows (draft and decode steps), F.linear above (prefill,
  whose numerics then match transformers' to within 1e-4 on the 30-layer embedded model, where
  oneDNN's large-product kernels drift to about 1.3e-4).
Without oneDNN (other builds, or VERICACHE_DISABLE_ONEDNN=1) the fast set is F.linear and the
invariant set computes weight @ x^T on blocks of ROW_ALIGN rows, one shape for every call, where
MKL is row-invariant whatever its thread count. On CUDA the invariant set runs F.linear on fixed
blocks of CUDA_ROW_BLOCK rows.
tests/test_batch_invariance.py checks whichever path runs.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

ROW_ALIGN = 16
SMALL_BATCH_ROWS = 64
# The row count oneDNN packs weights for: the layout that served 2 to 248 rows best (draft steps,
# verifications, decode steps) on the embedded model; every row count runs on it.
PACKED_FOR_ROWS = 16
# CUDA's library kernels pick their algorithm by shape (cuBLAS by the row count, reductions by the
# number of rows reduced): the batch-invariant set runs every product and reduction there on
# blocks of this many rows, so that every call has one shape whatever the batch.
CUDA_ROW_BLOCK = 16


def pad_rows(x: torch.Tensor, multiple: int) -> torch.Tensor:
    """Zero rows appended to the second-last axis up to a multiple of `multiple`."""
    pad = -x.shape[-2] % multiple
    if pad == 0:
        return x
    return torch.cat([x, x.new_zeros(*x.shape[:-2], pad, x.shape[-1])], dim=-2)


_ZERO_ROWS: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}


def zero_row(like: torch.Tensor) -> torch.Tensor:  # [1, width]
    """A zero row of `like`'s width, dtype and device, made once: the pad of a lone
    batch-invariant row (an allocation and a fill spared, every step)."""
    key = (like.shape[-1], like.dtype, like.device)
    if key not in _ZERO_ROWS:
        _ZERO_ROWS[key] = like.new_zeros(1, like.shape[-1])
    return _ZERO_ROWS[key]


def uses_row_blocks(x: torch.Tensor) -> bool:
    """Whether the batch-invariant set runs on fixed blocks of rows here: on CUDA."""
    return x.is_cuda


def map_row_blocks(fn, x: torch.Tensor, block: int) -> torch.Tensor:
    """fn over blocks of `block` rows of x (its first axis, zero-padded), concatenated."""
    rows = x.shape[0]
    pad = -rows % block
    if pad:
        x = torch.cat([x, x.new_zeros(pad, *x.shape[1:])])
    return torch.cat([fn(part) for part in x.split(block)])[:rows]


class Linear:
    """y = x @ weight^T + bias for x [M, in] -> [M, out]."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight = weight  # [out, in]
        self.bias = bias  # [out] or None
        self.uses_onednn = _onednn_runs(weight)
        # The weight in oneDNN's layout (a second copy in host memory; F.linear keeps the first).
        self._onednn_weight = _packed(weight) if self.uses_onednn else None

    def __call__(self, x: torch.Tensor, invariant: bool = False) -> torch.Tensor:
        rows = x.shape[0]
        if invariant and uses_row_blocks(x):
            linear = lambda block: F.linear(block, self.weight, self.bias)  # noqa: E731
            return map_row_blocks(linear, x, CUDA_ROW_BLOCK)
        if self.uses_onednn and (invariant or rows <= SMALL_BATCH_ROWS):
            if self.pads_lone_row(x, invariant):
                return self._onednn(torch.cat([x, zero_row(x)]))[:1]
            return self._onednn(x)
        if not invariant:
            return F.linear(x, self.weight, self.bias)
        # weight @ x^T on blocks of ROW_ALIGN rows: for few rows MKL runs this tall-skinny product
        # near matrix-vector speed, and one shape a call keeps a row's bits whatever the row
        # count (with two threads, MKL splits a 100-row product otherwise than a 16-row one).
        out = map_row_blocks(lambda block: torch.mm(self.weight, block.T).T, x, ROW_ALIGN)
        return out if self.bias is None else out + self.bias

    def _onednn(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self._onednn_weight, self.bias, "none", [], "")

    def pads_lone_row(self, x: torch.Tensor, invariant: bool) -> bool:
        """Whether the batch-invariant product pads x [M, in] of one row to two (oneDNN runs a
        lone row on another path)."""
        return invariant and x.shape[0] == 1 and self.uses_onednn and not uses_row_blocks(x)

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + (0 if self.bias is None else self.bias.nbytes)


def _packed(weight: torch.Tensor) -> torch.Tensor:
    """The weight in oneDNN's blocked layout, or as it is where this build cannot pack it."""
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight, PACKED_FOR_ROWS)
    except (AttributeError, RuntimeError):
        return weight


def _onednn_runs(weight: torch.Tensor) -> bool:
    if (
        weight.device.type != "cpu"
        or os.environ.get("VERICACHE_DISABLE_ONEDNN") == "1"
        or not torch.backends.mkldnn.is_available()
    ):
        return False
    try:
        probe = weight.new_zeros(2, weight.shape[1])
        torch.ops.mkldnn._linear_pointwise(probe, weight, None, "none", [], "")
    except (AttributeError, RuntimeError):  # op missing from this build, or dtype unsupported
        return False
    return True
