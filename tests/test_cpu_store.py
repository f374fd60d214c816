"""The batched KV store (kernels/cpu_store.cpp): the same cache bits as appending
sequence by sequence, and the runner's use of it in a forward."""

from __future__ import annotations

import shutil

import pytest
import torch

from vericache.compress import build_compressor
from vericache.kernels import cpu_attention
from vericache.kv.cache import DenseLayerKV
from vericache.model.loader import load_model
from vericache.model.runner import ModelRunner, SequenceInput

pytestmark = pytest.mark.skipif(
    shutil.which("c++") is None, reason="the kernel is compiled on first use: needs a C++ compiler"
)

NUM_KV_HEADS, HEAD_DIM = 3, 64


def resident_layer(num_slots: int, dtype: torch.dtype) -> DenseLayerKV:
    layer = DenseLayerKV(NUM_KV_HEADS, HEAD_DIM, dtype, "cpu", capacity=num_slots + 2)
    keys = torch.randn(num_slots, NUM_KV_HEADS, HEAD_DIM)
    layer.append(keys, keys * 2, torch.arange(num_slots))
    return layer


def assert_same_layer(got: DenseLayerKV, want: DenseLayerKV) -> None:
    assert got.num_slots == want.num_slots
    for got_tensor, want_tensor in zip(got.keys_values(), want.keys_values()):
        assert torch.equal(got_tensor[: got.num_slots], want_tensor[: want.num_slots])
    assert torch.equal(got.positions(), want.positions())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_stores_the_bits_an_append_writes(dtype):
    torch.manual_seed(0)
    # New rows as the runner has them: strided views into one projection output [N, 3 * H * D].
    projected = torch.randn(9, 3 * NUM_KV_HEADS * HEAD_DIM) * 50
    keys, values, _ = (t.view(9, NUM_KV_HEADS, HEAD_DIM) for t in projected.chunk(3, dim=-1))
    positions = torch.arange(100, 109)
    # (resident slots, first row, new tokens): the store grows the second layer past its capacity,
    # and rows 4 and 5 belong to no store (a sequence whose layer is not dense).
    spans = [(5, 0, 1), (30, 1, 3), (0, 6, 3)]
    stored = [resident_layer(n, dtype) for n, _, _ in spans]
    appended = [layer.clone(capacity=layer.capacity) for layer in stored]
    stores = [(*layer.reserve(n), row, n) for layer, (_, row, n) in zip(stored, spans)]
    cpu_attention.store_kv(keys, values, positions, stores)
    for layer, (_, row, n) in zip(appended, spans):
        layer.append(keys[row : row + n], values[row : row + n], positions[row : row + n])
    for got, want in zip(stored, appended):
        assert_same_layer(got, want)


def test_rejects_stores_it_cannot_serve():
    layer = resident_layer(4, torch.float32)
    keys = torch.randn(2, NUM_KV_HEADS, HEAD_DIM)
    positions = torch.arange(2)
    key_buffer, value_buffer, position_buffer, start = layer.reserve(0)
    capacity = key_buffer.shape[1]
    with pytest.raises(RuntimeError, match="capacity"):
        store = (key_buffer, value_buffer, position_buffer, capacity - 1, 0, 2)
        cpu_attention.store_kv(keys, keys, positions, [store])
    with pytest.raises(RuntimeError, match="past new_keys"):
        cpu_attention.store_kv(keys, keys, positions, [(*layer.reserve(0), 1, 2)])
    with pytest.raises(RuntimeError, match="float32"):
        store = (key_buffer, value_buffer, position_buffer, start, 0, 2)
        cpu_attention.store_kv(keys.double(), keys.double(), positions, [store])
    with pytest.raises(RuntimeError, match="int64"):
        store = (key_buffer, value_buffer, position_buffer, start, 0, 2)
        cpu_attention.store_kv(keys, keys, positions.int(), [store])
    with pytest.raises(RuntimeError, match=r"\[Hkv, capacity, D\]"):
        store = (key_buffer[:2], value_buffer, position_buffer, start, 0, 2)
        cpu_attention.store_kv(keys, keys, positions, [store])


def test_runner_stores_dense_layers_in_one_call_and_appends_the_rest(tiny_checkpoint, monkeypatch):
    loaded = load_model(str(tiny_checkpoint("llama")))
    runner = ModelRunner(loaded.config, loaded.weights)
    assert runner._cpu_kernel
    prompt = torch.randint(3, 500, (40,))
    full = runner.new_cache()
    runner.prefill(prompt, full)
    # A full cache, a bfloat16 token-dropped cache and a quantized one (not dense: appended).
    compressors = [
        build_compressor("streamingllm", ratio=2, dtype="bfloat16"),
        build_compressor("kivi"),
    ]
    caches = [full] + [compressor.compress(full, None) for compressor in compressors]
    reference = [cache.clone() for cache in caches]
    new_tokens = [torch.randint(3, 500, (n,)) for n in (5, 1, 1)]

    def forward(caches):
        return runner.forward(
            [SequenceInput(t, cache, fast_attention=True) for t, cache in zip(new_tokens, caches)]
        )

    calls = []
    real = cpu_attention.store_kv
    monkeypatch.setattr(cpu_attention, "store_kv", lambda *a: calls.append(len(a[3])) or real(*a))
    logits = forward(caches)
    assert calls == [2] * loaded.config.num_layers
    # Without the store every layer appends on its own: the same caches, bit for bit.
    monkeypatch.setattr(DenseLayerKV, "is_dense", False)
    expected = forward(reference)
    for got, want in zip(logits, expected):
        assert torch.equal(got, want)
    for cache, want_cache in zip(caches[:2], reference[:2]):
        for got, want in zip(cache.layers, want_cache.layers):
            assert_same_layer(got, want)
