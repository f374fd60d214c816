"""Agent sessions turn after turn over one shared prefix: what the workers' turn cache
(serve/workers/turn_cache.py) saves, against the same workers keeping no finished turn.

An agent calls the API once per step, and each call repeats the one before: the conversation so
far, the tool's output, the next instruction. Here S sessions run at once over one registered
prefix (a standard-library module, the repository an agent works in: the system turn), each T
turns in sequence, through the OpenAI-compatible chat API as an agent framework calls it: turn t's
messages are turn t-1's, its answer (an assistant message) and a user message with a tool output
(a slice of another standard-library module, `--tool-tokens` tokens) and the next instruction
(CONTEXT_PROMPTS in turn). Greedy, streamed, on fresh Ray workers per serve (one thread each: a
worker stands for one GPU; one verifier, one drafter); the time to the first token is the
client's. Cells: each mode (FULL_LOCAL,
VERICACHE at x = `--draft-len`, FULL_REMOTE) with the turn cache on (`--turn-cache-bytes`) and off
(0), served in turn, `--repeats` times each: the median with the smallest and largest.

Summary:
- later_ttft_off_over_on: by mode, the mean time to the first token of turns 2..T without the turn
  cache over with it (the prompt's prefill after the prefix is what a kept turn spares);
- tokens_per_s_on_over_off: by mode, the stream's output tokens/s with it over without it (the
  sessions' wall time, their turns' prefills and decoding all in);
- cached_share: by mode, the share of turns 2..T's prompt tokens after the prefix whose KV a kept
  turn held (`Result.stats["cached_tokens"]` less the prefix's);
- identical: every turn's tokens equal with and without it, in every mode and serve.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from vericache.bench.common import environment
from vericache.bench.serving import ray_server, ray_session
from vericache.bench.workloads import CONTEXT_PROMPTS, code_contexts
from vericache.client import Client
from vericache.model.loader import DEFAULT_MODEL, load_tokenizer, resolve_model_dir
from vericache.serve.config import CoordinatorConfig, DrafterConfig, VerifierConfig
from vericache.serve.launch.server import HttpSettings

MODES = ("full_local", "vericache", "full_remote")
MODEL_ID = "agent-turns"


def add_arguments(parser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--sessions", type=int, help="sessions at once (3; quick 2)")
    parser.add_argument("--turns", type=int, help="turns per session (5; quick 3)")
    parser.add_argument("--max-tokens", type=int, help="output tokens per turn (48; quick 24)")
    parser.add_argument("--prefix-tokens", type=int, help="the prefix's tokens (2000; quick 1200)")
    parser.add_argument("--tool-tokens", type=int, help="a tool output's tokens (400; quick 200)")
    parser.add_argument("--draft-len", type=int, default=8, help="VERICACHE's x")
    parser.add_argument("--repeats", type=int, help="serves per cell (3; quick 1)")
    parser.add_argument("--turn-cache-bytes", type=int, default=1 << 30)
    parser.add_argument("--modes", default=",".join(MODES), help="of " + ",".join(MODES))


@dataclass(frozen=True)
class Setup:
    sessions: int
    turns: int
    max_tokens: int
    prefix_tokens: int
    tool_tokens: int
    draft_len: int
    repeats: int
    turn_cache_bytes: int
    modes: tuple[str, ...]


def setup(args) -> Setup:
    def pick(value, full, quick):
        return value if value is not None else (quick if args.quick else full)

    return Setup(
        sessions=pick(args.sessions, 3, 2),
        turns=pick(args.turns, 5, 3),
        max_tokens=pick(args.max_tokens, 48, 24),
        prefix_tokens=pick(args.prefix_tokens, 2000, 1200),
        tool_tokens=pick(args.tool_tokens, 400, 200),
        draft_len=args.draft_len,
        repeats=pick(args.repeats, 3, 1),
        turn_cache_bytes=args.turn_cache_bytes,
        modes=tuple(m for m in args.modes.split(",") if m),
    )


@dataclass(frozen=True)
class Workload:
    system: str  # the prefix's text: the conversations' system turn
    prefix_id: str
    num_prefix_tokens: int
    tool_outputs: tuple[str, ...]  # one per turn after the first, per session in turn


def run(args) -> dict:
    spec = setup(args)
    tokenizer = load_tokenizer(resolve_model_dir(args.model))
    size = spec.prefix_tokens
    prefix, *tools = code_contexts(
        tokenizer, size, size + 200, 1 + spec.sessions * (spec.turns - 1), truncate=True
    )
    tool_outputs = tuple(_cut(tool.text, tokenizer, spec.tool_tokens) for tool in tools)
    cells: dict[str, list[dict]] = {}
    with ray_session(1), tempfile.TemporaryDirectory() as directory:
        root = Path(directory)
        with _server(args.model, root, spec, spec.turn_cache_bytes) as server:
            with Client(server.target) as client:
                # Registered as a chat system turn: it leads every conversation's tokens.
                prefix_id = client.put_prefix(prefix.text, compressor="snapkv", ratio=4)
                num_prefix = client.get_prefix(prefix_id).num_tokens
        work = Workload(prefix.text, prefix_id, num_prefix, tool_outputs)
        for _ in range(spec.repeats):
            for mode in spec.modes:
                for budget in (spec.turn_cache_bytes, 0):
                    sample = _serve_once(args.model, root, spec, work, mode, budget)
                    name = _cell_name(mode, budget)
                    print(f"[agent-turns] {name}: {sample['tokens_per_s']:.2f} tokens/s")
                    cells.setdefault(name, []).append(sample)
    return {
        "benchmark": "agent-turns",
        "summary": summarize(cells, spec),
        "config": {**asdict(spec), "model": args.model, "quick": args.quick},
        "environment": environment(),
        "prefix": {"name": prefix.name, "num_tokens": num_prefix},
        "tools": [tool.name for tool in tools],
        "cells": {name: _cell_record(samples) for name, samples in cells.items()},
    }


def _cut(text: str, tokenizer, num_tokens: int) -> str:
    """The text of `text`'s first `num_tokens` tokens."""
    return tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)[:num_tokens])


def _cell_name(mode: str, turn_cache_bytes: int) -> str:
    return f"{mode} {'kept' if turn_cache_bytes else 'none'}"


def _server(model: str, root: Path, spec: Setup, turn_cache_bytes: int):
    verifier = VerifierConfig(model=model, root=root, turn_cache_bytes=turn_cache_bytes)
    drafter = DrafterConfig(model=model, turn_cache_bytes=turn_cache_bytes)
    config = CoordinatorConfig(default_draft_len=spec.draft_len)
    return ray_server(verifier, drafter, 1, config, HttpSettings(0, MODEL_ID))


def _serve_once(model, root, spec: Setup, work: Workload, mode: str, budget: int) -> dict:
    """The sessions served at once on fresh workers: each turn's tokens, TTFT, prompt and
    cached tokens, and the stream's wall time."""
    import httpx

    with _server(model, root, spec, budget) as server, httpx.Client(timeout=600) as http:
        url = f"http://{server.host}:{server.http_port}/v1/chat/completions"
        options = {"mode": mode, "prefix_id": work.prefix_id, "draft_len": spec.draft_len}

        def session(index: int) -> list[dict]:
            tools = work.tool_outputs[index * (spec.turns - 1) :]
            messages = [{"role": "system", "content": work.system}]
            messages.append({"role": "user", "content": CONTEXT_PROMPTS[0]})
            turns = []
            for turn in range(spec.turns):
                body = {
                    "model": MODEL_ID, "messages": messages, "max_tokens": spec.max_tokens,
                    "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
                    "return_token_ids": True, "vericache": options,
                }  # fmt: skip
                answer, record = _streamed(http, url, body, work.num_prefix_tokens)
                turns.append(record)
                if turn + 1 == spec.turns:
                    return turns
                instruction = CONTEXT_PROMPTS[(turn + 1) % len(CONTEXT_PROMPTS)]
                tool = f"Tool output:\n{tools[turn]}\n\n{instruction}"
                messages = [
                    *messages,
                    {"role": "assistant", "content": answer},
                    {"role": "user", "content": tool},
                ]
            return turns

        started = time.perf_counter()
        with ThreadPoolExecutor(spec.sessions) as pool:
            sessions = list(pool.map(session, range(spec.sessions)))
        wall_s = time.perf_counter() - started
    num_tokens = sum(len(t["token_ids"]) for turns in sessions for t in turns)
    return {"wall_s": wall_s, "tokens_per_s": num_tokens / wall_s, "sessions": sessions}


def _streamed(http, url: str, body: dict, num_prefix_tokens: int) -> tuple[str, dict]:
    """One streamed chat completion: its text, and the turn's record (its tokens, the client's
    time to the first token, its prompt's tokens after the prefix and those a kept turn held)."""
    started = time.perf_counter()
    first_at, texts, token_ids, usage = None, [], [], None
    with http.stream("POST", url, json=body) as reply:
        if reply.status_code != 200:
            raise RuntimeError(f"the server answered {reply.status_code}: {reply.read()}")
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            if "error" in chunk:
                raise RuntimeError(f"the stream failed: {chunk['error']['message']}")
            usage = chunk.get("usage") or usage
            for choice in chunk["choices"]:
                if choice.get("token_ids") and first_at is None:
                    first_at = time.perf_counter()
                token_ids += choice.get("token_ids", [])
                texts.append(choice["delta"].get("content") or "")
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    return "".join(texts), {
        "token_ids": token_ids,
        "ttft_s": (first_at or time.perf_counter()) - started,
        "after_prefix": usage["prompt_tokens"] - num_prefix_tokens,
        "reused": cached - num_prefix_tokens,
    }


def _cell_record(samples: list[dict]) -> dict:
    rates = [s["tokens_per_s"] for s in samples]
    later = [statistics.mean(_later(s, "ttft_s")) for s in samples]
    return {
        "tokens_per_s": statistics.median(rates),
        "tokens_per_s_range": [min(rates), max(rates)],
        "later_ttft_s": statistics.median(later),
        "later_ttft_s_range": [min(later), max(later)],
        "samples": samples,
    }


def _later(sample: dict, key: str) -> list[float]:
    """`key` of every session's turns 2..T."""
    return [turn[key] for turns in sample["sessions"] for turn in turns[1:]]


def summarize(cells: dict[str, list[dict]], spec: Setup) -> dict:
    ttft, rate, share, identical = {}, {}, {}, True
    for mode in spec.modes:
        kept = cells[_cell_name(mode, spec.turn_cache_bytes)]
        none = cells[_cell_name(mode, 0)]
        ttft[mode] = _median_ratio(none, kept, lambda s: statistics.mean(_later(s, "ttft_s")))
        rate[mode] = _median_ratio(kept, none, lambda s: s["tokens_per_s"])
        reused = sum(sum(_later(s, "reused")) for s in kept)
        after = sum(sum(_later(s, "after_prefix")) for s in kept)
        share[mode] = reused / after if after else 0.0
        identical &= all(_tokens(s) == _tokens(none[0]) for s in kept + none)
    return {
        "later_ttft_off_over_on": ttft,
        "tokens_per_s_on_over_off": rate,
        "cached_share": share,
        "identical": identical,
    }


def _median_ratio(over: list[dict], under: list[dict], value) -> float:
    """The median over serves of value(over's i-th) / value(under's i-th): each pair served one
    after the other, on the same machine minutes."""
    return statistics.median(value(a) / value(b) for a, b in zip(over, under))


def _tokens(sample: dict) -> list[list[list[int]]]:
    return [[turn["token_ids"] for turn in turns] for turns in sample["sessions"]]


def plot(result: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary, config = result["summary"], result["config"]
    modes = list(summary["later_ttft_off_over_on"])
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, label in (
        (axes[0], "later_ttft_s", "time to first token, turns 2..T (s)"),
        (axes[1], "tokens_per_s", "output tokens/s of the stream"),
    ):
        for offset, kept in ((-0.2, "kept"), (0.2, "none")):
            cells = [result["cells"][f"{mode} {kept}"] for mode in modes]
            values = [cell[key] for cell in cells]
            low = [v - cell[f"{key}_range"][0] for v, cell in zip(values, cells)]
            high = [cell[f"{key}_range"][1] - v for v, cell in zip(values, cells)]
            positions = [i + offset for i in range(len(modes))]
            name = "turn cache" if kept == "kept" else "none"
            ax.bar(positions, values, 0.4, yerr=[low, high], capsize=3, label=name)
        ax.set_xticks(range(len(modes)), modes)
        ax.set_ylabel(label)
        ax.legend()
    fig.suptitle(
        f"{config['sessions']} agent sessions x {config['turns']} turns over one prefix "
        f"({result['prefix']['num_tokens']} tokens), {config['tool_tokens']}-token tool outputs; "
        "median of serves, bars: range",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
