"""Long-context decoding on CUDA (skipped without it): pinned host KV, loads on a copy stream,
compressed KV parked in host memory until admitted, output equal to full decoding."""

from __future__ import annotations

import pytest
import torch

from tests.compressor_table import pick, row_id
from tests.test_long_context import make_requests
from vericache.compress import KIVI
from vericache.engine.device_memory import full_kv_bytes
from vericache.engine.engine import Engine
from vericache.engine.host_kv import HostKV, KVLoader, move_compressed
from vericache.engine.long_context import LongContextEngine
from vericache.engine.long_context_config import LongContextConfig
from vericache.engine.request import DecodeMode
from vericache.model.loader import load_model
from vericache.model.runner import ModelRunner

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.fixture(scope="module")
def runner(tiny_checkpoint):
    loaded = load_model(str(tiny_checkpoint("llama")), device="cuda")
    return ModelRunner(loaded.config, loaded.weights, "cuda")


@pytest.mark.parametrize("compressor", pick("streamingllm", "kivi"), ids=row_id)
def test_long_context_equals_full_on_cuda(runner, compressor):
    expected = [out.token_ids for out in Engine(runner).generate(make_requests(DecodeMode.FULL))]
    requests = make_requests(DecodeMode.VERICACHE, compressor, 6)
    full_bytes = full_kv_bytes(requests[0], runner.config, 4)
    budget = runner.weights.nbytes + 5 * full_bytes
    for link in (None, 50e6):  # the PCIe as it is, and a slow emulated link
        with LongContextEngine(runner, None, long_context=LongContextConfig(budget, link)) as lc:
            outputs = lc.generate(requests)
            assert [out.token_ids for out in outputs] == expected
            assert lc.stats.peak_device_bytes <= budget and lc.stats.max_running > 4


def test_pinned_host_kv_loads_on_a_copy_stream(runner):
    cache = runner.new_cache(capacity=2048)
    runner.prefill(torch.arange(1500, device="cuda") % 500 + 3, cache, num_logits=0)
    host = HostKV.from_cache(cache, capacity=2048, pin=True)
    assert all(keys.is_pinned() for keys in host.keys)
    loader = KVLoader("cuda")
    try:
        loaded = loader.start(host).wait()
    finally:
        loader.close()
    assert loaded.cache.device.type == "cuda" and loaded.cache.is_full
    for layer, copy in zip(cache.layers, loaded.cache.layers):
        assert torch.equal(layer.keys_values()[0][:1500], copy.keys_values()[0][:1500])
        assert torch.equal(layer.keys_values()[1][:1500], copy.keys_values()[1][:1500])


def test_compressed_kv_moves_between_host_and_device(runner):
    cache = runner.new_cache()
    runner.prefill(torch.arange(300, device="cuda") % 500 + 3, cache, num_logits=0)
    compressed = KIVI(bits=2, group_size=8).compress(cache)
    parked = move_compressed(compressed, "cpu")
    assert parked.device.type == "cpu"
    back = move_compressed(parked, "cuda", runner.rope)
    assert back.device.type == "cuda" and back.to_state().equals(compressed.to_state())
