"""bench tool-calls' summary and its valid-call check, on records made here."""

from __future__ import annotations

from vericache.bench import tool_calls
from vericache.bench.workloads import ToolCase

CASE = ToolCase(
    "c",
    "Weather?",
    (
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}},
                    "required": ["city"],
                },
            },
        },
    ),
)


def test_a_valid_call_names_a_listed_function_with_arguments_its_schema_takes():
    good = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    assert tool_calls._is_valid_call(good, CASE)
    assert not tool_calls._is_valid_call("It is sunny.", CASE)  # no call
    unknown = good.replace("get_weather", "get_time")
    assert not tool_calls._is_valid_call(unknown, CASE)
    missing = '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'
    assert not tool_calls._is_valid_call(missing, CASE)


def _cell(choice, mode, valid, identical, tokens_per_s, mask_share=0.0):
    return {
        "choice": choice, "mode": mode, "valid_call_rate": valid,
        "identical_to_full": identical, "tokens_per_s": tokens_per_s, "mask_share": mask_share,
    }  # fmt: skip


def test_the_summary_holds_vericache_to_full_and_prices_the_constraint():
    cells = {
        "auto full": _cell("auto", "full", 0.1, 1.0, 100.0),
        "auto vericache": _cell("auto", "vericache", 0.1, 1.0, 90.0),
        "auto lossy": _cell("auto", "lossy", 0.0, 0.2, 120.0),
        "required full": _cell("required", "full", 1.0, 1.0, 80.0, mask_share=0.3),
        "required vericache": _cell("required", "vericache", 1.0, 0.95, 70.0),
        "required lossy": _cell("required", "lossy", 0.9, 0.5, 95.0),
    }
    summary = tool_calls.summary(cells)
    assert summary["valid_call_rate"]["lossy"] == {"auto": 0.0, "required": 0.9}
    assert summary["vericache_identical_rate"] == 0.95  # the least over its cells
    assert summary["constraint_cost"] == 0.3  # the share of decoding spent on masks
    assert summary["constrained_over_free_tokens_per_s"] == 0.8
    assert not summary["meets_targets"]
