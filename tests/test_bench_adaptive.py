"""The adaptive benchmark's summary and plot on hand-made runs."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest

from vericache.bench import adaptive
from vericache.compress import StreamingLLM
from vericache.engine.request import RequestStats


def _output(token_ids, drafted, accepted):
    stats = RequestStats(drafted_per_round=drafted, accepted_per_round=accepted)
    return SimpleNamespace(token_ids=token_ids, stats=stats)


def test_summary_compares_adaptive_with_the_best_static_run(tmp_path):
    item = {
        "kind": "code",
        "context": "textwrap.py",
        "prompt": SimpleNamespace(token_ids=(1, 2, 3)),
        "compressor": StreamingLLM(ratio=4),
    }
    samples = {"4": [40.0, 44.0], "8": [50.0, 48.0], "adaptive": [52.0, 51.0]}
    outputs = {
        "4": [_output([5, 6], [4], [1])],
        "8": [_output([5, 6], [8], [1])],
        "adaptive": [_output([5, 7], [3, 6], [3, 2])],
    }
    args = argparse.Namespace(model="m", compressors="streamingllm-4x", quick=True)
    result = adaptive._result(args, [item], [[5, 6]], samples, outputs, [4, 8], 2, 2)
    summary = result["summary"]
    assert summary["best_static_draft_len"] == 8
    assert summary["adaptive_over_best_static"] == pytest.approx(51.5 / 49.0)
    assert summary["identical"] is False  # the adaptive run's output differs
    assert summary["tokens_per_s"] == {"static_4": 42.0, "static_8": 49.0, "adaptive": 51.5}
    assert result["rounds"]["adaptive"]["code/streamingllm-4x"]["mean_draft_len"] == 4.5
    adaptive.plot(result, tmp_path / "adaptive.png")
    assert (tmp_path / "adaptive.png").stat().st_size > 0


def test_workload_mixes_long_contexts_with_short_math_chats(monkeypatch):
    code = SimpleNamespace(name="textwrap.py", text="code")
    tools = SimpleNamespace(name="MathAPI", context="tools", questions=("q",))
    monkeypatch.setattr(adaptive, "code_contexts", lambda *args, count: [code] * count)
    monkeypatch.setattr(adaptive, "tool_contexts", lambda *args, count: [tools] * count)
    monkeypatch.setattr(adaptive, "humaneval_prompts", lambda count: ["def f():"] * count)
    monkeypatch.setattr(
        adaptive, "build_chat_prompt", lambda tokenizer, context, question: (context, question)
    )
    engine = SimpleNamespace(tokenizer=None)
    args = argparse.Namespace(
        compressors="streamingllm-4x,snapkv-8x", context_tokens=3000, math_prompts=None, quick=False
    )
    workload = adaptive._workload(engine, args, num_contexts=1)
    kinds = [(item["kind"], item["compressor"].label) for item in workload]
    assert kinds.count(("math", "snapkv-8x")) == 2 and kinds.count(("code", "snapkv-8x")) == 1
    math_prompts = {item["prompt"] for item in workload if item["kind"] == "math"}
    assert math_prompts == {(adaptive.MATH_CONTEXT, p.prompt) for p in adaptive.MATH_PROBLEMS[:2]}
