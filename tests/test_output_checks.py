"""The usability checks behind `vericache bench lossy-quality`, and its summary and plot."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest

from vericache.bench import lossy_quality
from vericache.bench.output_checks import code_parses, tool_calls

CALL = '[{"name": "cd", "arguments": {"folder": "docs"}}, {"name": "ls", "arguments": {}}]'


@pytest.mark.parametrize(
    "text, expected",
    [
        (CALL, [("cd", frozenset({"folder"})), ("ls", frozenset())]),
        ("Sure: " + CALL + " done.", [("cd", frozenset({"folder"})), ("ls", frozenset())]),
        ("[]", []),
        ("no call here", None),
        ('[{"name": "cd", "arguments": {"folder": "docs"}', None),  # cut short
        ('[{"arguments": {}}]', None),  # no name
        ('[{"name": "cd", "arguments": [1]}]', None),  # arguments not an object
        ("see [1] then " + CALL, None),  # the first JSON list is not a call list
    ],
)
def test_tool_calls(text, expected):
    assert tool_calls(text) == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ("```python\ndef f(x):\n    return x\n```", True),
        ("Here:\n```python\ndef f(x):\n    return x\n", True),  # fence never closed
        ("```python\ndef f(x:\n```", False),
        ("def f():\n    pass\n", True),
        ("", None),
    ],
)
def test_code_parses(text, expected):
    assert code_parses(text) == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ('```python\ndef f(x):\n    print("cut', True),  # the cut line is dropped
        ("def f(x):\n    return g(x,\n    y", True),  # an open call is not yet an error
        ("def f(x:\n    return x\n    y", False),  # an error before the cut
        ("one line only", None),
    ],
)
def test_truncated_code_needs_only_a_valid_beginning(text, expected):
    assert code_parses(text, truncated=True) == expected


def _out(ids, text="", finish_reason="stop"):
    return SimpleNamespace(token_ids=ids, text=text, finish_reason=finish_reason)


def test_rows_compare_usable_outputs_only_where_full_kv_was_usable(tmp_path):
    prompts = [("tools", None), ("tools", None), ("code", None), ("code", None), ("math", None)]
    full = [_out([1], CALL), _out([2], "nothing"), _out([3], "def f(): pass"),
            _out([4], "def f(:"), _out([5])]  # fmt: skip
    lossy = [_out([9], CALL.replace("folder", "dir")), _out([2], "nothing"),
             _out([8], "def f(:"), _out([4], "def f(:"), _out([5])]  # fmt: skip
    row = lossy_quality._row(prompts, full, lossy, full, [[0.0, 0.2], [0.4], [], [], []])
    assert row["identical_share"] == pytest.approx(3 / 5)
    assert row["vericache_identical_share"] == 1.0
    assert (row["tool_call_share"], row["num_tool_calls"]) == (0.0, 1)  # argument key changed
    assert (row["code_parse_share"], row["num_code"]) == (0.0, 1)
    assert row["kl_by_position"] == pytest.approx([0.2, 0.2])
    args = argparse.Namespace(quick=True, model="m", draft_len=30)
    result = lossy_quality._result({"snapkv-4x": row}, args, max_tokens=2, num_prompts=5)
    assert result["summary"]["identical_share"] == {"snapkv-4x": pytest.approx(0.6)}
    lossy_quality.plot(result, tmp_path / "quality.png")
    assert (tmp_path / "quality.png").stat().st_size > 1000


def test_kl_is_zero_for_an_uncompressed_prefix(tiny_engine):
    from vericache.compress import StreamingLLM

    engine = tiny_engine()
    prompt = SimpleNamespace(token_ids=list(range(3, 60)), num_prefix_tokens=40)
    kl = lossy_quality._kl_by_position(engine, prompt, [7, 8, 9], StreamingLLM(ratio=1))
    assert kl == pytest.approx([0.0] * 3, abs=1e-9)
    kl = lossy_quality._kl_by_position(engine, prompt, [7, 8, 9], StreamingLLM(ratio=8))
    assert len(kl) == 3 and max(kl) > 1e-4
