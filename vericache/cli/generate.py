"""`vericache generate`: one request, in this process (modes full, lossy, vericache) or on a
server (`--server HOST:PORT`; modes vericache, full_local, full_remote, lossy)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from vericache.compress import COMPRESSORS, build_compressor
from vericache.engine.engine import DraftKVSource, Engine, EngineConfig
from vericache.engine.prompt import build_chat_prompt
from vericache.engine.request import DecodeMode, Request, RequestOutput, SamplingParams
from vericache.errors import InvalidRequestError
from vericache.model.loader import DEFAULT_MODEL, DTYPES


def add_parser(commands) -> None:
    parser = commands.add_parser("generate", help="decode one prompt (full, lossy or vericache)")
    parser.add_argument(
        "--context-file", type=Path, help="text put in the system turn (the prefix)"
    )
    parser.add_argument("--prompt", required=True, help="the user turn")
    parser.add_argument("--mode", choices=[*IN_PROCESS_MODES, *SERVER_MODES], default="vericache")
    parser.add_argument("--server", help="HOST:PORT of a `vericache serve` API")
    parser.add_argument("--prefix-id", help="a registered prefix (with --server)")
    parser.add_argument(
        "--compressor", default="streamingllm", help=f"one of {sorted(COMPRESSORS)}"
    )
    parser.add_argument("--ratio", type=float, help="compression ratio (token dropping)")
    parser.add_argument("--bits", type=int, help="bits per value (quantization)")
    parser.add_argument("--draft-len", type=int, default=30, help="draft tokens per round (x)")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument(
        "--model", default=DEFAULT_MODEL, help="embedded model name or checkpoint dir"
    )
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--draft-kv", choices=[s.value for s in DraftKVSource], default="verifier")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(handler=run)


IN_PROCESS_MODES = [m.value for m in DecodeMode]
SERVER_MODES = ["full_local", "full_remote"]  # and lossy, vericache


def build_request(args, tokenizer) -> Request:
    context = args.context_file.read_text() if args.context_file is not None else None
    mode = DecodeMode(args.mode)
    compressor = None
    if mode is not DecodeMode.FULL:
        compressor = build_compressor(args.compressor, ratio=args.ratio, bits=args.bits)
    if tokenizer is None:
        raise InvalidRequestError(f"model {args.model} has no tokenizer; text prompts need one")
    prompt = build_chat_prompt(tokenizer, context, args.prompt)
    params = SamplingParams(max_new_tokens=args.max_tokens, stop=tuple(args.stop))
    return Request(
        prompt.token_ids, prompt.num_prefix_tokens, params, mode, compressor, args.draft_len
    )


def output_json(args, request: Request, out: RequestOutput) -> dict:
    return {
        "model": args.model,
        "mode": request.mode.value,
        "compressor": request.compressor.label if request.compressor else None,
        "draft_len": request.draft_len,
        "prompt_tokens": len(request.prompt_ids),
        "prefix_tokens": request.num_prefix_tokens,
        "text": out.text,
        "token_ids": out.token_ids,
        "finish_reason": out.finish_reason,
        "stats": out.stats.as_dict(),
        "timing": out.stats.timing_dict(),
    }


def check_device(name: str) -> None:
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise InvalidRequestError(f"unknown device {name!r}") from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InvalidRequestError(f"device {name!r} asked for, but CUDA is not available")


def run(args) -> int:
    if args.server:
        return run_on_server(args)
    if args.mode in SERVER_MODES or args.prefix_id:
        raise InvalidRequestError("--mode full_local/full_remote and --prefix-id need --server")
    # Check the cheap things before loading the model.
    check_device(args.device)
    if args.mode != DecodeMode.FULL.value:
        build_compressor(args.compressor, ratio=args.ratio, bits=args.bits)
    SamplingParams(max_new_tokens=args.max_tokens, stop=tuple(args.stop))
    if args.context_file is not None and not args.context_file.is_file():
        raise InvalidRequestError(f"context file {args.context_file} does not exist")
    config = EngineConfig(draft_kv_source=DraftKVSource(args.draft_kv))
    engine = Engine.from_pretrained(args.model, args.dtype, args.device, config)
    request = build_request(args, engine.tokenizer)
    (out,) = engine.generate([request])
    if args.json:
        print(json.dumps(output_json(args, request, out)))
        return 0
    print(out.text)
    stats = out.stats
    print(
        f"[{request.mode.value}] {len(out.token_ids)} tokens, {stats.tokens_per_s:.1f} tokens/s, "
        f"{stats.rounds} rounds, {stats.mean_accepted_per_round:.1f} accepted per round, "
        f"finish: {out.finish_reason}"
    )
    return 0


def run_on_server(args) -> int:
    from vericache.client import Client

    if args.context_file is not None:
        raise InvalidRequestError(
            "with --server, register the context once (`vericache prefix put FILE`) and pass "
            "--prefix-id"
        )
    mode = "full_local" if args.mode == DecodeMode.FULL.value else args.mode
    with Client(args.server) as client:
        stream = client.stream(
            args.prompt, prefix_id=args.prefix_id, mode=mode, max_tokens=args.max_tokens,
            stop=args.stop, draft_len=args.draft_len,
        )  # fmt: skip
        with stream:
            for delta in stream:
                if not args.json:
                    print(delta, end="", flush=True)
            result = stream.result()
    if args.json:
        output = {"mode": mode, "prefix_id": args.prefix_id, "text": result.text}
        output |= {"token_ids": result.token_ids, "finish_reason": result.finish_reason}
        print(json.dumps(output | {"stats": result.stats}))
        return 0
    stats = result.stats
    print(
        f"\n[{mode}] {stats['num_tokens']} tokens, {stats['tokens_per_s']:.1f} tokens/s, "
        f"{stats['rounds']} rounds, {stats['mean_accepted_per_round']:.1f} accepted per round, "
        f"{stats['link_bytes']} link bytes, finish: {result.finish_reason}"
    )
    return 0
