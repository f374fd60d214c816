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
from vericache.kernels import triton_invariant_attention, triton_kv_table  # noqa: E402
from vericache.kernels.triton_kv_table import TableEntry  # noqa: E402
from vericache.kv.cache import DenseLayerKV  # noqa: E402
from vericache.kv.prefixed import shared_clone  # noqa: E402
from vericache.model import kernels  # noqa: E402
from vericache.model.loader import load_model  # noqa: E402
from vericache.model.runner import ModelRunner, SequenceInput  # noqa: E402

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


# Static steps (model/static_step.py): the KV store and attention through tables


@pytest.mark.parametrize("num_new", [1, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_table_kernels_give_each_cache_its_own_launchs_bits(dtype, num_new):
    generator = torch.Generator().manual_seed(num_new)
    num_kv_heads, group, head_dim = 2, 3, 64
    caches, twins = [], []
    for resident in (3, 40, 70):
        keys, values = torch.randn(2, resident, num_kv_heads, head_dim, generator=generator)
        layer = DenseLayerKV.from_tensors(keys.to(dtype), values.to(dtype), torch.arange(resident))
        caches.append(layer)
        twins.append(layer.clone())
    num_rows = len(caches) * num_new
    keys, values = torch.randn(2, num_rows, num_kv_heads, head_dim, generator=generator).to(dtype)
    positions = torch.arange(num_rows) + 100
    table = torch.tensor(
        [
            TableEntry(k.data_ptr(), v.data_ptr(), p.data_ptr(), k.stride(0), first)
            for k, v, p, first in (layer.reserve(num_new) for layer in caches)
        ],
        dtype=torch.int64,
    )
    q = torch.randn(num_rows, num_kv_heads * group, head_dim, generator=generator).to(dtype)
    like = caches[0].keys_values()[0]
    stored = _stored_by_table(caches, twins, table, keys, values, positions, num_new)
    out = triton_kv_table.attention(q, table, num_new, like, prefixed=False)
    for rows, twin in stored:
        expected = triton_invariant_attention.invariant_attention(
            q[rows], *twin.keys_values(), twin.num_slots
        )
        assert torch.equal(out[rows], expected)


def _stored_by_table(layers, twins, table, keys, values, positions, num_new):
    """Stores each layer's num_new new rows of keys, values [S * n, H, D] through `table` (its
    entries reserved already), appends them to each twin, checks the two hold the same bits, and
    returns each layer's rows and twin."""
    row_seq = torch.arange(len(layers)).repeat_interleave(num_new).to(torch.int32)
    row_offset = torch.arange(num_new).repeat(len(layers)).to(torch.int32)
    triton_kv_table.store_kv(keys, values, positions, table, row_seq, row_offset)
    stored = []
    for index, (layer, twin) in enumerate(zip(layers, twins)):
        rows = slice(index * num_new, (index + 1) * num_new)
        twin.append(keys[rows], values[rows], positions[rows])
        state, twin_state = layer.to_state().tensors, twin.to_state().tensors
        assert state.keys() == twin_state.keys()
        for name, tensor in state.items():
            assert torch.equal(tensor, twin_state[name]), name
        stored.append((rows, twin))
    return stored


def test_a_static_step_through_tables_has_the_dynamic_forwards_bits(tiny_checkpoint, monkeypatch):
    """The CUDA static path's logic (tables, padding, groups) on CPU, without capture."""
    monkeypatch.setattr(kernels, "_triton_runs", lambda q, invariant, keys_dtype: invariant)
    loaded = load_model(str(tiny_checkpoint("llama")))
    dynamic = ModelRunner(loaded.config, loaded.weights, static_shapes=False)
    static = ModelRunner(loaded.config, loaded.weights, static_shapes=True)
    static.static.tables = True
    dynamic._cpu_kernel = static._cpu_kernel = False
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 512, (40 + 9 * i,), generator=generator) for i in range(4)]
    results = []
    for runner in (dynamic, static):
        # Two sessions of their own, two over one shared prefix (of 70 tokens: its last block
        # straddles into theirs).
        prefix = runner.new_cache()
        runner.prefill(torch.arange(3, 73), prefix, invariant=True)
        caches = [runner.new_cache(), runner.new_cache()]
        caches += [shared_clone(prefix, capacity=400) for _ in range(2)]
        for ids, cache in zip(prompts, caches):
            runner.prefill(ids, cache, invariant=True)
        logits, before = [], static.static.num_forwards
        for rows in ([1, 1, 1, 1], [4, 1, 4, 1], [3, 4, 4, 6]):  # decode steps, verifications
            batch = [
                SequenceInput(torch.arange(3, 3 + n), cache, n) for n, cache in zip(rows, caches)
            ]
            logits += runner.forward(batch, invariant=True)
        # A lone exact token (a spare zero row on CPU, which no table row serves).
        logits += runner.forward([SequenceInput(torch.tensor([5]), caches[0], 1)], invariant=True)
        assert static.static.num_forwards - before == (4 if runner is static else 0)
        results.append((logits, caches))
    for mine, reference in zip(*(logits for logits, _ in results)):
        assert torch.equal(mine, reference)
    for mine, reference in zip(*(caches for _, caches in results)):
        assert mine.to_state().equals(reference.to_state())


@pytest.mark.parametrize("num_sms", [4, 64], ids=["one-split", "splits-some-empty"])
@pytest.mark.parametrize("num_new", [1, 3])
def test_packed_table_attention_is_each_kivi_layers_attention(
    tiny_checkpoint, monkeypatch, num_new, num_sms
):
    """Drafts over KIVI's packed codes in a static step: the store into each residual, and the
    packed kernel through the table (its splits fixed: with many, some past every slot), against
    each layer's own attention."""
    from vericache.compress import KIVI
    from vericache.model.static_step import _entry

    monkeypatch.setattr(triton_kv_table, "_num_sms", lambda device: num_sms)
    loaded = load_model(str(tiny_checkpoint("llama")))
    runner = ModelRunner(loaded.config, loaded.weights, static_shapes=False)
    generator = torch.Generator().manual_seed(num_new)
    layers, twins = [], []
    for length in (30, 57, 90):  # a residual of 6, 1 and 2 slots after 24, 56, 88 packed
        cache = runner.new_cache()
        runner.prefill(torch.randint(3, 512, (length,), generator=generator), cache)
        layer = KIVI(bits=4, group_size=8, residual_length=8).compress(cache).layers[0]
        layers.append(layer)
        twins.append(layer.clone())
    num_kv_heads, head_dim = loaded.config.num_kv_heads, loaded.config.head_dim
    num_rows = len(layers) * num_new
    keys, values = torch.randn(2, num_rows, num_kv_heads, head_dim, generator=generator)
    positions = torch.arange(num_rows) + 200
    table = torch.tensor([_entry(layer, num_new) for layer in layers], dtype=torch.int64)
    q = torch.randn(num_rows, loaded.config.num_heads, head_dim, generator=generator)
    like = layers[0].residual.keys_values()[0]
    stored = _stored_by_table(layers, twins, table, keys, values, positions, num_new)
    out = triton_kv_table.packed_attention(q, table, num_new, like, bits=4, group_size=8)
    for rows, twin in stored:
        torch.testing.assert_close(out[rows], twin.attend(q[rows]), atol=1e-5, rtol=1e-5)


def test_draft_steps_over_kivi_through_tables_follow_the_dynamic_forward(tiny_checkpoint):
    """Whole static draft steps over KIVI caches (fast rows: close, not bit for bit), three of
    them and a padding sequence in a bucket of four."""
    from tests.test_static_forward import kivi_draft_sources, kivi_draft_steps

    loaded = load_model(str(tiny_checkpoint("llama")))
    dynamic = ModelRunner(loaded.config, loaded.weights, static_shapes=False)
    static = ModelRunner(loaded.config, loaded.weights, static_shapes=True)
    static.static.tables = True
    sources = kivi_draft_sources(dynamic)
    results = [kivi_draft_steps(runner, sources) for runner in (dynamic, static)]
    assert static.static.num_forwards == 3
    for mine, reference in zip(*(logits for logits, _ in results)):
        torch.testing.assert_close(mine, reference, atol=1e-4, rtol=1e-4)
    for mine, reference in zip(*(caches for _, caches in results)):
        assert [layer.num_slots for layer in mine.layers] == [
            layer.num_slots for layer in reference.layers
        ]
        assert torch.equal(mine.layers[1].positions(), reference.layers[1].positions())
