"""Benchmark plumbing on small inputs: labels, aggregation, tables, plots, step timing."""

from __future__ import annotations

import argparse

import pytest
import torch

from vericache.bench import acceptance, decode_speed
from vericache.bench.common import compressor_from_label, compressor_labels, progress
from vericache.compress import COMPRESSORS, KIVI, StreamingLLM
from vericache.errors import InvalidRequestError
from vericache.model.loader import load_model
from vericache.model.runner import ModelRunner


def test_compressor_labels_round_trip():
    assert compressor_from_label("streamingllm-4x") == StreamingLLM(ratio=4)
    assert compressor_from_label("kivi-2bit") == KIVI(bits=2)
    assert compressor_from_label("streamingllm-4x-bf16") == StreamingLLM(ratio=4, dtype="bfloat16")
    for label in ("streamingllm-4x", "streamingllm-2.5x", "kivi-8bit", "snapkv-4x-fp16"):
        assert compressor_from_label(label).label == label
    for bad in ("kivi4", "snapkv-4x-int8", "kivi-4bit-bf16"):
        with pytest.raises(InvalidRequestError):
            compressor_from_label(bad)


def _record(kind, label, draft_len, drafted, accepted, source="verifier"):
    return {
        "kind": kind,
        "compressor": label,
        "draft_len": draft_len,
        "draft_kv": source,
        "identical": True,
        "drafted_per_round": drafted,
        "accepted_per_round": accepted,
    }


def test_acceptance_counts_only_full_rounds_in_the_headline(tmp_path):
    records = [
        _record("code", "kivi-4bit", 30, [30, 30, 12], [30, 10, 12]),
        _record("code", "kivi-4bit", 30, [30], [20]),
        _record("tools", "kivi-4bit", 30, [30, 5], [0, 5]),
        _record("code", "streamingllm-4x", 30, [30, 30], [17, 18]),
    ]
    args = argparse.Namespace(
        draft_kv="verifier", quick=True, draft_lens=[30], model="m", dtype="float32"
    )
    labels = ["kivi-4bit", "streamingllm-4x"]
    result = acceptance._result(records, labels, args, max_tokens=64, num_prompts=3)
    cell = result["table"]["verifier"]["code"]["kivi-4bit"][30]
    assert cell["mean_accepted_per_full_round"] == pytest.approx(20.0)  # (30 + 10 + 20) / 3
    assert cell["mean_accepted_per_round"] == pytest.approx(18.0)  # (30 + 10 + 12 + 20) / 4
    assert cell["acceptance_rate"] == pytest.approx(72 / 102)
    assert result["summary"]["x30"] == {
        "kivi-4bit": pytest.approx(20.0),
        "streamingllm-4x": pytest.approx(17.5),
    }
    assert result["summary"]["x30_tools"] == {"kivi-4bit": 0.0}
    best = result["summary"]["best_4x_x30"]
    assert best["code"] == {"label": "kivi-4bit", "x30": pytest.approx(20.0)}
    assert result["summary"]["meets_target"] is False  # tools: the best 4x accepts 0
    assert acceptance._meets_target({"code": best["code"], "tools": None}) is None
    assert acceptance._meets_target({"code": best["code"], "tools": best["code"]}) is True
    assert "| code | kivi-4bit | 20.0 |" in result["table_markdown"]
    acceptance.plot(result, tmp_path / "acceptance.png")
    assert (tmp_path / "acceptance.png").stat().st_size > 1000


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


def test_progress_passes_items_through_and_takes_updates():
    # Silent here (stderr is not a terminal under pytest), and transparent.
    assert list(progress(range(4), "items")) == [0, 1, 2, 3]
    with progress(description="tokens", total=10, unit="tok") as bar:
        bar.update(4)
        assert bar.disable
