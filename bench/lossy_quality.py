"""What lossy compressed-KV decoding loses, against full-KV decoding of the same prompts.

Per compressor: the share of `lossy` outputs identical to `full`; of the prompts whose full-KV
output is a well-formed tool call, the share whose lossy call also parses and names the same
functions with the same argument keys; of the code prompts whose full-KV code parses
(`ast.parse`; for an output cut by the token budget, all but its last line must be a valid
beginning of a program), the share whose lossy code does; and the divergence
KL(full || lossy) of the next-token distributions at each output position, both teacher-forced
along the full-KV output (the compressed cache then holds the prefix compressed once; online
evictions during decoding are not replayed). `vericache` rows decode the same prompts and must
be 100% identical. SmolLM2-135M rarely answers the BFCL prompts with a JSON call, so the tool-call
share is often undefined (null) on the embedded model.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from vericache.bench.common import (
    compressor_from_label,
    compressor_labels,
    environment,
    progress,
    pyplot,
)
from vericache.bench.output_checks import code_parses, tool_calls
from vericache.bench.workloads import standard_workloads
from vericache.engine.engine import Engine, EngineConfig
from vericache.engine.prompt import build_chat_prompt
from vericache.engine.request import DecodeMode, Request, SamplingParams
from vericache.model.loader import DEFAULT_MODEL

KL_FLOOR = 1e-6


def add_arguments(parser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--compressors", help="labels, `all` or `all-4x` (default; quick: 3)")
    parser.add_argument("--max-tokens", type=int, help="output tokens per request (96; quick 48)")
    parser.add_argument("--draft-len", type=int, default=30)


def run(args) -> dict:
    max_tokens = args.max_tokens or (48 if args.quick else 96)
    default = "streamingllm-4x,snapkv-4x,kivi-4bit" if args.quick else "all-4x"
    labels = compressor_labels(args.compressors or default)
    engine = Engine.from_pretrained(args.model, config=EngineConfig(prefix_cache_bytes=16 << 30))
    prompts = [
        (workload.kind, build_chat_prompt(engine.tokenizer, workload.context, prompt))
        for workload in standard_workloads(engine.tokenizer, args.quick)
        for prompt in workload.prompts
    ]
    params = SamplingParams(max_new_tokens=max_tokens)
    full = engine.generate([_request(p, params, DecodeMode.FULL) for _, p in prompts])
    rows = {}
    for label in progress(labels, "compressors"):
        compressor = compressor_from_label(label)
        lossy = engine.generate(
            [_request(p, params, DecodeMode.LOSSY, compressor) for _, p in prompts]
        )
        vericache = engine.generate(
            [
                _request(p, params, DecodeMode.VERICACHE, compressor, args.draft_len)
                for _, p in prompts
            ]
        )
        kl = [
            _kl_by_position(engine, p, ref.token_ids, compressor)
            for (_, p), ref in zip(prompts, full)
        ]
        rows[label] = _row(prompts, full, lossy, vericache, kl)
        print(
            f"[lossy-quality] {label}: identical {rows[label]['identical_share']:.2f}", flush=True
        )
    return _result(rows, args, max_tokens, len(prompts))


def _request(prompt, params, mode, compressor=None, draft_len=30) -> Request:
    return Request(prompt.token_ids, prompt.num_prefix_tokens, params, mode, compressor, draft_len)


@torch.no_grad()
def _kl_by_position(engine, prompt, output_ids: list[int], compressor) -> list[float]:
    """KL(full || compressed) of the next-token distribution at each output position."""
    if not output_ids:
        return []
    split = min(prompt.num_prefix_tokens, len(prompt.token_ids) - 1)
    prefix_ids = tuple(prompt.token_ids[:split])
    fed = torch.tensor([*prompt.token_ids[split:], *output_ids[:-1]], dtype=torch.long)
    prefix_kv = engine.prefix_kv(prefix_ids)
    compressed = engine.compressed_prefix_kv(prefix_ids, compressor).clone()
    full_logits = engine.runner.prefill(fed, prefix_kv.clone(), num_logits=len(output_ids))
    lossy_logits = engine.runner.prefill(fed, compressed, num_logits=len(output_ids))
    full_log_p = torch.log_softmax(full_logits.double(), dim=-1)  # [n, vocab]
    lossy_log_p = torch.log_softmax(lossy_logits.double(), dim=-1)
    kl = (full_log_p.exp() * (full_log_p - lossy_log_p)).sum(dim=-1)
    return kl.clamp_min(0).tolist()


def _row(prompts, full, lossy, vericache, kl) -> dict:
    identical = [a.token_ids == b.token_ids for a, b in zip(full, lossy)]
    tools, code = [], []
    for (kind, _), ref, out in zip(prompts, full, lossy):
        if kind == "tools" and tool_calls(ref.text):
            tools.append(tool_calls(out.text) == tool_calls(ref.text))
        if kind == "code" and code_parses(ref.text, ref.finish_reason == "length"):
            code.append(bool(code_parses(out.text, out.finish_reason == "length")))
    by_position = defaultdict(list)
    for values in kl:
        for position, value in enumerate(values):
            by_position[position].append(value)
    kl_curve = [sum(v) / len(v) for _, v in sorted(by_position.items())]
    return {
        "identical_share": sum(identical) / len(identical),
        "vericache_identical_share": sum(
            a.token_ids == b.token_ids for a, b in zip(full, vericache)
        )
        / len(full),
        "tool_call_share": _share(tools),
        "num_tool_calls": len(tools),
        "code_parse_share": _share(code),
        "num_code": len(code),
        "mean_kl": sum(kl_curve) / len(kl_curve) if kl_curve else None,
        "kl_by_position": kl_curve,
    }


def _share(flags: list[bool]) -> float | None:
    return sum(flags) / len(flags) if flags else None


def _result(rows: dict, args, max_tokens: int, num_prompts: int) -> dict:
    summary = {
        "identical_share": {label: row["identical_share"] for label, row in rows.items()},
        "vericache_identical_share": {
            label: row["vericache_identical_share"] for label, row in rows.items()
        },
        "tool_call_share": {label: row["tool_call_share"] for label, row in rows.items()},
        "code_parse_share": {label: row["code_parse_share"] for label, row in rows.items()},
        "mean_kl": {label: row["mean_kl"] for label, row in rows.items()},
    }
    return {
        "benchmark": "lossy-quality",
        "summary": summary,
        "config": {
            "max_tokens": max_tokens,
            "num_prompts": num_prompts,
            "quick": args.quick,
            "model": args.model,
            "draft_len": args.draft_len,
        },
        "environment": environment(),
        "rows": rows,
    }


def plot(result: dict, path) -> None:
    plt = pyplot()
    fig, (kl_axis, share_axis) = plt.subplots(1, 2, figsize=(12, 4))
    for label, row in result["rows"].items():
        # A log axis shows KL across orders of magnitude; exact agreement sits on the floor.
        kl_axis.plot([max(value, KL_FLOOR) for value in row["kl_by_position"]], label=label)
    kl_axis.set(
        title="KL(full || lossy) by output position",
        xlabel="output position",
        ylabel=f"KL (nats; floor {KL_FLOOR:g})",
        yscale="log",
    )
    kl_axis.legend(fontsize=8)
    labels = list(result["rows"])
    lossy = [result["summary"]["identical_share"][label] for label in labels]
    exact = [result["summary"]["vericache_identical_share"][label] for label in labels]
    x = range(len(labels))
    share_axis.bar([i - 0.2 for i in x], lossy, width=0.4, label="lossy")
    share_axis.bar([i + 0.2 for i in x], exact, width=0.4, label="vericache")
    share_axis.set_xticks(list(x), labels, rotation=45, ha="right", fontsize=8)
    share_axis.set(title="outputs identical to full KV", ylim=(0, 1.05))
    share_axis.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
