"""The codec benchmark's plumbing on a small random cache (the real run is `vericache bench codec`;
`vericache kv-size` on the embedded model is tested in test_codec.py)."""

from __future__ import annotations

import torch

from vericache.bench import codec as codec_bench
from vericache.kv.cache import DenseLayerKV, KVCache


def random_full_cache(num_tokens=300, num_layers=2, heads=2, head_dim=32) -> KVCache:
    generator = torch.Generator().manual_seed(0)
    positions = torch.arange(num_tokens, dtype=torch.int32)
    layers = []
    for _ in range(num_layers):
        keys, values = torch.randn(2, num_tokens, heads, head_dim, generator=generator)
        layers.append(DenseLayerKV.from_tensors(keys.bfloat16(), values.bfloat16(), positions))
    return KVCache(layers, num_tokens)


def test_measures_summarizes_and_plots(tmp_path):
    full = random_full_cache()
    labels = ["kivi-4bit", "kivi-2bit", "streamingllm-4x", "snapkv-4x", "nosuch-4x"]
    measured = codec_bench.measure_caches(full, labels, None, "sha256:test", repeats=1)
    assert measured["full_bf16_bytes"] == 2 * 2 * 2 * 300 * 2 * 32
    records = measured["records"]
    assert list(records) == ["full", "kivi-4bit", "kivi-2bit", "streamingllm-4x"]
    # snapkv scores tokens with the model (no context here); nosuch is not registered.
    assert set(measured["skipped"]) == {"snapkv-4x", "nosuch-4x"}
    summary = codec_bench.summarize(measured, context_tokens=300)
    fractions = summary["wire_fraction"]
    assert fractions["kivi-2bit"] < fractions["kivi-4bit"] < fractions["full"] < 1
    assert fractions["streamingllm-4x"] < 0.25
    assert summary["min_encode_mb_s"] == min(summary["encode_mb_s"].values()) > 0
    assert set(summary["meets_target"]) == {
        "kivi-4bit_wire<=1/4.5",
        "kivi-2bit_wire<=1/8",
        "token_dropping_4x_wire<=1/4.2",
        "encode>=200MB/s",
        "decode>=200MB/s",
    }
    assert summary["meets_target"]["token_dropping_4x_wire<=1/4.2"] is True
    codec_bench.plot({"summary": summary}, tmp_path / "codec.png")
    assert (tmp_path / "codec.png").stat().st_size > 1000


def test_default_labels_cover_every_token_dropping_compressor():
    labels = codec_bench.default_labels(quick=False)
    assert labels[:4] == ["kivi-8bit", "kivi-4bit", "kivi-2bit", "streamingllm-4x"]
    assert all(label.endswith("-4x") for label in labels[4:-2])
    assert labels[-2:] == ["kvquant-4bit", "kvquant-2bit"]
    assert "kivi-4bit" in codec_bench.default_labels(quick=True)
