"""The agent-turns benchmark's plumbing without a server: its settings, the summary of its cells
(ratios with and without the turn cache, the share of later prompts reused, exactness) and the
plot."""

from __future__ import annotations

import pytest

from vericache.bench import agent_turns
from vericache.cli.bench import parse_benchmark_args


def _setup(*argv: str) -> agent_turns.Setup:
    return agent_turns.setup(parse_benchmark_args("agent-turns", list(argv))[1])


def test_quick_shrinks_the_sessions_and_explicit_values_win():
    assert parse_benchmark_args("agent-turns", [])[0] is agent_turns
    quick, full = _setup("--quick"), _setup()
    assert quick.turns < full.turns and quick.tool_tokens < full.tool_tokens
    assert full.modes == agent_turns.MODES
    assert _setup("--quick", "--turns", "4", "--modes", "full_local").turns == 4
    assert _setup("--modes", "full_local").modes == ("full_local",)


def _sample(ttft_later: float, rate: float, reused: int, tokens=(1, 2)) -> dict:
    first = {"token_ids": list(tokens), "ttft_s": 0.1, "after_prefix": 20, "reused": 0}
    later = {"token_ids": list(tokens), "ttft_s": ttft_later, "after_prefix": 200, "reused": reused}
    return {"tokens_per_s": rate, "wall_s": 1.0, "sessions": [[first, later], [first, later]]}


def _cells(kept_tokens=(1, 2)) -> dict:
    return {
        "full_local kept": [_sample(0.5, 12.0, 150, kept_tokens), _sample(0.6, 11.0, 150)],
        "full_local none": [_sample(1.0, 10.0, 0), _sample(1.5, 10.0, 0)],
    }


def test_the_summary_sets_each_serve_against_the_one_beside_it():
    summary = agent_turns.summarize(_cells(), _setup("--modes", "full_local"))
    assert summary["later_ttft_off_over_on"]["full_local"] == pytest.approx((2.0 + 2.5) / 2)
    assert summary["tokens_per_s_on_over_off"]["full_local"] == pytest.approx((1.2 + 1.1) / 2)
    assert summary["cached_share"]["full_local"] == pytest.approx(0.75)
    assert summary["identical"]


def test_one_differing_turn_is_not_identical():
    summary = agent_turns.summarize(_cells(kept_tokens=(1, 3)), _setup("--modes", "full_local"))
    assert not summary["identical"]


def test_the_plot_is_written(tmp_path):
    spec = _setup("--modes", "full_local")
    cells = _cells()
    result = {
        "summary": agent_turns.summarize(cells, spec),
        "config": {"sessions": 2, "turns": 2, "tool_tokens": 400},
        "prefix": {"num_tokens": 2000},
        "cells": {name: agent_turns._cell_record(samples) for name, samples in cells.items()},
    }
    path = tmp_path / "agent_turns.png"
    agent_turns.plot(result, path)
    assert path.stat().st_size > 10_000
