"""BFCL function calls by the embedded model: what lossy compressed-KV decoding breaks, what
VeriCache keeps, and what the call grammar costs.

Cases: the first BFCL cases of the `simple_python` and `multiple` categories (half each), their
functions as OpenAI tools (bench/workloads.py), rendered as the server renders them (the default
format: the catalogue at the end of the system turn, which is the prefix, compressed by SnapKV 4x
for `vericache` and `lossy`). Each case runs with tool_choice `auto` (free text, calls read from
`<tool_call>` blocks) and `required` (decoded under the grammar of one call of a listed function,
engine/constraint.py), in `full`, `vericache` and `lossy`, greedy, in one batch per cell.

Per cell: `valid_call_rate`, the share of replies holding a call whose function is listed and
whose arguments validate against its schema; `identical_to_full`, the share of replies with
full decoding's tokens (VeriCache's must be all); tokens/s; `mask_share`, the share of the
cell's decode time (its wall time after the prompts' prefills) spent computing the grammar's
masks. `constraint_cost` is the `required full` cell's mask share (target <= 0.10): the
constraint's own cost per output token. `constrained_over_free_tokens_per_s` sets that cell's
tokens/s against `auto full`'s, reported only: the two decode other outputs (short calls that end
early against free text).
"""

from __future__ import annotations

import json
import time

import jsonschema

from vericache.bench.common import compressor_from_label, environment, progress, pyplot
from vericache.bench.workloads import ToolCase, bfcl_tool_cases
from vericache.engine.constraint import TokenConstraint
from vericache.engine.engine import Engine, EngineConfig
from vericache.engine.prompt import build_conversation
from vericache.engine.request import DecodeMode, Request, SamplingParams
from vericache.model.loader import DEFAULT_MODEL
from vericache.serve.api_types import ChatTurn, FunctionTool
from vericache.serve.front.tools import (
    HermesToolParser,
    conversation_turns,
    parse_output,
    tool_call_constraint,
)

SYSTEM = "You are a helpful assistant that calls functions."
MODES = (DecodeMode.FULL, DecodeMode.VERICACHE, DecodeMode.LOSSY)
CHOICES = ("auto", "required")
TARGETS = {"vericache_identical_rate": 1.0, "constraint_cost": 0.10}


def add_arguments(parser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--cases", type=int, help="BFCL cases, half simple, half multiple (100)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--draft-len", type=int, default=8)
    parser.add_argument("--compressor", default="snapkv-4x")


def run(args) -> dict:
    num_cases = args.cases or (10 if args.quick else 100)
    cases = bfcl_tool_cases("simple_python", num_cases // 2)
    cases += bfcl_tool_cases("multiple", num_cases - len(cases))
    engine = Engine.from_pretrained(args.model, config=EngineConfig(prefix_cache_bytes=4 << 30))
    cells, outputs = {}, {}
    for choice in progress(CHOICES, "tool_choice"):
        for mode in MODES:
            requests = [_request(engine, case, mode, choice, args) for case in cases]
            with _MaskTimer() as masks:
                started = time.perf_counter()
                done = engine.generate(requests)
                wall_s = time.perf_counter() - started
            decode_s = wall_s - sum(out.stats.prefill_s for out in done)
            outputs[choice, mode] = done
            num_tokens = sum(len(out.token_ids) for out in done)
            cells[f"{choice} {mode.value}"] = {
                "choice": choice,
                "mode": mode.value,
                "valid_call_rate": _share(_is_valid_call(o.text, c) for o, c in zip(done, cases)),
                "identical_to_full": _share(
                    out.token_ids == full.token_ids
                    for out, full in zip(done, outputs[choice, DecodeMode.FULL])
                ),
                "tokens_per_s": num_tokens / wall_s,
                "output_tokens": num_tokens,
                "wall_s": wall_s,
                "decode_s": decode_s,
                "mask_s": masks.seconds,
                "mask_share": masks.seconds / decode_s if decode_s > 0 else 0.0,
            }
    return {
        "benchmark": "tool-calls",
        "config": {"cases": len(cases), "max_tokens": args.max_tokens,
                   "draft_len": args.draft_len, "compressor": args.compressor},
        "cells": cells,
        "cases": [case.case_id for case in cases],
        "summary": summary(cells),
        "environment": environment(),
    }  # fmt: skip


def summary(cells: dict) -> dict:
    rate: dict[str, dict[str, float]] = {}
    for cell in cells.values():
        rate.setdefault(cell["mode"], {})[cell["choice"]] = cell["valid_call_rate"]
    identical = min(
        cell["identical_to_full"] for cell in cells.values() if cell["mode"] == "vericache"
    )
    # The constraint's own cost: the share of constrained decoding's time spent on masks. The
    # tokens/s of constrained over free decoding is reported beside it, but the two decode other
    # outputs (short calls that end early against free text), so it does not price the mask.
    cost = cells["required full"]["mask_share"]
    speed = cells["required full"]["tokens_per_s"] / cells["auto full"]["tokens_per_s"]
    return {
        "valid_call_rate": rate,
        "vericache_identical_rate": identical,
        "lossy_identical_rate": {
            choice: cells[f"{choice} lossy"]["identical_to_full"] for choice in CHOICES
        },
        "constraint_cost": cost,
        "constrained_over_free_tokens_per_s": speed,
        "targets": TARGETS,
        "meets_targets": identical >= TARGETS["vericache_identical_rate"]
        and cost <= TARGETS["constraint_cost"],
    }


def _request(engine: Engine, case: ToolCase, mode: DecodeMode, choice: str, args) -> Request:
    tools = tuple(FunctionTool(**tool["function"]) for tool in case.tools)
    turns = (ChatTurn("system", SYSTEM), ChatTurn("user", case.question))
    messages, schemas = conversation_turns(engine.tokenizer, turns, tools)
    prompt = build_conversation(engine.tokenizer, messages, schemas)
    constraint = None
    if choice == "required":
        constraint = tool_call_constraint(tools, HermesToolParser(), parallel=False)
    compressor = None if mode is DecodeMode.FULL else compressor_from_label(args.compressor)
    return Request(
        prompt.token_ids, prompt.num_prefix_tokens, SamplingParams(args.max_tokens), mode,
        compressor, args.draft_len, request_id=case.case_id, constraint=constraint,
    )  # fmt: skip


class _MaskTimer:
    """Seconds spent in `TokenConstraint.masks` while open (every mask goes through it)."""

    def __enter__(self):
        self.seconds = 0.0
        self._masks = TokenConstraint.masks

        def timed(constraint, *args):
            started = time.perf_counter()
            try:
                return self._masks(constraint, *args)
            finally:
                self.seconds += time.perf_counter() - started

        TokenConstraint.masks = timed
        return self

    def __exit__(self, *exc) -> None:
        TokenConstraint.masks = self._masks


def _is_valid_call(text: str, case: ToolCase) -> bool:
    """A call of a listed function whose arguments validate against its schema."""
    calls = parse_output(HermesToolParser(), text).calls
    functions = {tool["function"]["name"]: tool["function"] for tool in case.tools}
    if not calls:
        return False
    for call in calls:
        function = functions.get(call.name)
        if function is None:
            return False
        try:
            jsonschema.validate(json.loads(call.arguments), function.get("parameters", {}))
        except jsonschema.ValidationError:
            return False
    return True


def _share(flags) -> float:
    flags = list(flags)
    return sum(flags) / len(flags) if flags else 0.0


def plot(result: dict, path) -> None:
    plt = pyplot()
    cells = result["cells"]
    names = list(cells)
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.bar(names, [cells[n]["valid_call_rate"] for n in names], color="tab:blue")
    ax.set_ylabel("valid calls")
    ax.set_ylim(0, 1.05)
    ax.set_title(f"BFCL calls, {result['config']['cases']} cases (embedded model)")
    plt.xticks(rotation=30, ha="right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
