"""Benchmark plumbing on small inputs: labels, aggregation, tables, plots, step timing."""

from __future__ import annotations

import pytest
import torch

from vericache.bench import decode_speed
from vericache.bench.common import compressor_from_label, compressor_labels, progress
from vericache.compress import COMPRESSORS, KIVI, StreamingLLM
from vericache.errors import InvalidRequestError
from vericache.model.loader import load_model
from vericache.model.runner import ModelRunner


def test_compressor_labels_round_trip():
    assert compressor_from_label("streamingllm-4x") == StreamingLLM(ratio=4)
    assert compressor_from_label("kivi-2bit") == KIVI(bits=2)
    assert compressor_from_label("streamingllm-4x-bf16") == StreamingLLM(ratio=4, dtype="bfloat16")
    labels = ("streamingllm-4x", "streamingllm-2.5x", "kivi-8bit", "snapkv-4x-fp16")
    for label in (*labels, "snapkv-8x+kivi-4bit", "kvzip-2x+kvquant-2bit"):
        assert compressor_from_label(label).label == label
    bad_labels = ("kivi4", "snapkv-4x-int8", "kivi-4bit-bf16", "snapkv-4x+kivi-4bit+kivi-2bit")
    for bad in (*bad_labels, "kivi-4bit+snapkv-4x", "snapkv-4x-bf16+kivi-4bit"):
        with pytest.raises(InvalidRequestError):
            compressor_from_label(bad)


def test_compressor_labels_cover_the_registry_at_each_strength():
    labels = compressor_labels("all")
    assert len(labels) == 3 * len(COMPRESSORS)
    assert {"snapkv-2x", "h2o-8x", "kivi-8bit", "kvquant-2bit", "kvzip-4x"} <= set(labels)
    assert compressor_labels("all-4x") == [label for label in labels if "-4" in label]
    assert [compressor_from_label(label).label for label in labels] == labels
    assert compressor_labels("tova-2x,kivi-4bit") == ["tova-2x", "kivi-4bit"]


def test_step_timing_restores_the_caches(tiny_checkpoint):
    loaded = load_model(str(tiny_checkpoint("llama")))
    runner = ModelRunner(loaded.config, loaded.weights)
    caches = [runner.new_cache() for _ in range(2)]
    for cache in caches:
        runner.prefill(torch.randint(3, 512, (50,)), cache, num_logits=0)
    keys_before = caches[0].layers[0].keys_values()[0].clone()
    assert decode_speed.time_steps(runner, caches, steps=3, invariant=False) > 0
    assert decode_speed.time_verification(runner, caches[0], 5, repeats=2) > 0
    assert [cache.num_tokens for cache in caches] == [50, 50]
    assert torch.equal(caches[0].layers[0].keys_values()[0], keys_before)


def test_static_runners_time_their_dynamic_steps_beside(tiny_checkpoint):
    loaded = load_model(str(tiny_checkpoint("llama")))
    runner = ModelRunner(loaded.config, loaded.weights, static_shapes=True)
    full = runner.new_cache()
    runner.prefill(torch.randint(3, 512, (300,)), full, num_logits=0)
    before = runner.static.num_forwards
    dynamic = decode_speed.dynamic_step_costs(runner, full, steps=2)
    assert runner.static.num_forwards == before and runner.static is not None  # all dynamic
    assert set(dynamic) == {"full_invariant", "draft_streamingllm-4x", "verify_31_tokens"}
    step_ms = {"full_invariant": 2.0, "draft_streamingllm-4x": 1.0}
    summary = decode_speed._static_summary(step_ms, 3.0, dict(dynamic, full_invariant=4.0))
    assert summary["static_over_dynamic_full_step"] == 0.5
    assert decode_speed._static_summary(step_ms, 3.0, None) == {}


def test_progress_passes_items_through_and_takes_updates():
    # Silent here (stderr is not a terminal under pytest), and transparent.
    assert list(progress(range(4), "items")) == [0, 1, 2, 3]
    with progress(description="tokens", total=10, unit="tok") as bar:
        bar.update(4)
        assert bar.disable


def test_the_tiny_step_counts_one_host_wait_and_its_operators(tmp_path):
    """decode-speed --tiny: a draft step waits for nothing, its whole draft once (its tokens), a
    verification once; a layer costs the same operators whatever the depth, so two layers' count
    less one layer's is one layer's."""
    from vericache.bench.decode_speed_tiny import counted_syncs, time_steps, tiny_model
    from vericache.engine.engine import Engine, EngineConfig

    with counted_syncs() as counts:
        torch.ones(3).tolist()
        int(torch.ones(()))
    assert counts == {"tolist": 1, "__int__": 1}
    engines = [Engine.from_pretrained(str(tiny_model(tmp_path / f"l{n}", n))) for n in (1, 2, 3)]
    steps = [time_steps(engine, "draft", 1) for engine in engines]
    assert [step["syncs"] for step in steps] == [0, 0, 0]
    assert [step["syncs_to_done"] for step in steps] == [1, 1, 1]
    assert time_steps(engines[0], "verify", 1)["syncs"] == 1
    one, two, three = (step["operators"] for step in steps)
    assert three - two == two - one > 0
    # A full decode step's operators per layer (bench/README.md gives them by kind); 179 before
    # the forward gathered its rotation once, turned queries and keys in one operator and carried
    # one spare row for a lone row's products.
    full_steps = [time_steps(engine, "full", 1)["operators"] for engine in engines[:2]]
    assert full_steps[1] - full_steps[0] <= 112
    assert steps[1]["host_us_quartiles"][0] <= steps[1]["host_us"] > 0
    # Static forwards stage their inputs without reading a tensor's values on the host.
    config = EngineConfig(static_shapes=True)
    static = Engine.from_pretrained(str(tmp_path / "l2"), config=config)
    assert time_steps(static, "draft", 1)["syncs"] == 0
    assert time_steps(static, "verify", 1)["syncs"] == 1
    assert static.runner.static.num_forwards > 0
