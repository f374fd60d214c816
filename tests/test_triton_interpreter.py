"""Cascade attention's logic on CPU, under Triton's interpreter: the checks of
tests/test_cuda_invariant.py, by the kernel and through the runner. Skipped unless Triton is
installed and TRITON_INTERPRET=1 was set before the kernels were imported, e.g.
`TRITON_INTERPRET=1 python -m pytest tests/test_triton_interpreter.py` (a CPU torch will do).

The interpreter computes a tile's products by one BLAS call, whose rounding of a row can depend on
the rows beside it; on the GPU a row's products never read its neighbours (test_cuda_invariant.py
checks a token decoded alone against the same token verified among others). `row_by_row_dots`
makes the interpreter do the same, one call per row, so that tiles holding different rows (a
cascade's gathered rows, a sequence's own) can be compared bit for bit. It also widens bfloat16
operands, whose bit patterns the interpreter would multiply as integers.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

triton = pytest.importorskip("triton")

from tests.test_cuda_invariant import (  # noqa: E402  (after the skip: they import Triton's kernels)
    DTYPES,
    check_cascade_attention,
    check_prefix_is_the_concatenation,
    check_prefix_read_by_one_launch,
    check_two_prefixes_in_one_forward,
)
from vericache.kernels import triton_invariant_attention  # noqa: E402
from vericache.model import kernels  # noqa: E402
from vericache.model.loader import load_model  # noqa: E402
from vericache.model.runner import ModelRunner  # noqa: E402

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="runs under TRITON_INTERPRET=1"
)


@pytest.fixture(autouse=True)
def row_by_row_dots(monkeypatch):
    from triton.runtime import interpreter

    def widened(handle):
        if handle.dtype.scalar == triton.language.bfloat16:  # stored as uint16 bit patterns
            return (handle.data.astype(np.uint32) << 16).view(np.float32)
        return handle.data

    def dot(builder, a, b, acc, input_precision, max_num_imprecise_acc):
        a_rows, b_data = widened(a), widened(b)
        out = [np.matmul(row[None], b_data, dtype=acc.data.dtype) for row in a_rows]
        return interpreter.TensorHandle(np.concatenate(out) + acc.data, acc.dtype.scalar)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", dot)


# Prefixes of any length: the block holding slot P reads the prefix's last slots and the cache's
# first (at 64 the block after the prefix is the cache's alone). A cascade's prefix pass covers
# none of the first two, all of 64 and the whole PREFIX_BLOCKs of the others.
PREFIX_LENGTHS = [1, 37, 64, 100, 129, 200]
# (new tokens, own slots): steps and verifications, ending in the straddling block or past it.
SEQUENCES = [(1, 1), (1, 70), (31, 31), (31, 100)]


@pytest.mark.parametrize("num_prefix", PREFIX_LENGTHS)
@pytest.mark.parametrize("dtypes", list(DTYPES), ids=lambda d: f"{d[0]}-{d[1]}")
def test_invariant_attention_over_an_unaligned_shared_prefix_is_the_concatenation(
    dtypes, num_prefix
):
    check_prefix_is_the_concatenation("cpu", dtypes, (2, 2, 64), num_prefix, SEQUENCES)


@pytest.mark.parametrize("num_prefix", PREFIX_LENGTHS)
@pytest.mark.parametrize("dtypes", list(DTYPES), ids=lambda d: f"{d[0]}-{d[1]}")
def test_cascade_attention_over_an_unaligned_prefix_gives_each_sequence_its_bits(
    dtypes, num_prefix
):
    check_cascade_attention("cpu", dtypes, (2, 2, 64), num_prefix)


def test_invariant_attention_refuses_a_prefix_in_another_dtype():
    keys, values = torch.randn(2, 10, 2, 64)
    prefix = torch.randn(2, 37, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="over a cache in"):
        triton_invariant_attention.invariant_attention(
            torch.randn(1, 4, 64), keys, values, 10, None, *prefix
        )


@pytest.mark.parametrize("shape", [(3, 3, 64), (2, 1, 128)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtypes", list(DTYPES), ids=lambda d: f"{d[0]}-{d[1]}")
def test_cascade_attention_gives_each_sequence_its_bits_alone(dtypes, shape):
    check_cascade_attention("cpu", dtypes, shape, num_prefix=256)


@pytest.mark.parametrize("num_prefix", [256, 300, 37])
def test_cascade_attention_reads_the_prefix_in_one_launch(monkeypatch, num_prefix):
    check_prefix_read_by_one_launch("cpu", monkeypatch, num_prefix)


def test_sessions_over_two_prefixes_read_each_once_with_their_own_bits(
    tiny_checkpoint, monkeypatch
):
    # The exact forwards take the Triton kernel as on CUDA (the fast prefill keeps library
    # attention), and the CPU attention kernel stands aside.
    monkeypatch.setattr(kernels, "_triton_runs", lambda q, invariant, keys_dtype: invariant)
    loaded = load_model(str(tiny_checkpoint("llama")))
    runner = ModelRunner(loaded.config, loaded.weights)
    runner._cpu_kernel = False
    check_two_prefixes_in_one_forward(runner, monkeypatch)
