"""`vericache generate`: one request, in this process (modes full, lossy, vericache) or on a
server (`--server HOST:PORT`; modes auto, vericache, full_local, full_remote, lossy; the server
chooses, `auto`, where none is given). `--long-context`
runs it in long-context mode (Pipeline 1: compressed KV on the device, full KV in host memory,
loaded for each verification) within `--memory-budget`, over a link of `--pcie-bandwidth`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from vericache.cli.prefix import add_connection_arguments, connection_options
from vericache.compress import COMPRESSORS, build_compressor
from vericache.compress.base import STORAGE_DTYPES
from vericache.engine.engine import DraftKVSource, Engine, EngineConfig
from vericache.engine.link import parse_bandwidth, parse_size
from vericache.engine.long_context import LongContextEngine
from vericache.engine.long_context_config import LongContextConfig
from vericache.engine.prompt import build_chat_prompt
from vericache.engine.request import (
    COUPLINGS,
    STEERED_PREFIX_TOKENS,
    DecodeMode,
    Request,
    RequestOutput,
    SamplingParams,
)
from vericache.errors import InvalidRequestError
from vericache.model.loader import DEFAULT_MODEL, DTYPES


def add_parser(commands) -> None:
    parser = commands.add_parser("generate", help="decode one prompt (full, lossy or vericache)")
    parser.add_argument(
        "--context-file", type=Path, help="text put in the system turn (the prefix)"
    )
    parser.add_argument("--prompt", required=True, help="the user turn")
    parser.add_argument(
        "--mode", choices=[*IN_PROCESS_MODES, *SERVER_MODES],
        help="in this process: vericache (default), full or lossy; with --server: the server's "
        "default (auto, where a prefix is given) or one named",
    )  # fmt: skip
    parser.add_argument("--server", help="HOST:PORT of a `vericache serve` API")
    parser.add_argument("--prefix-id", help="a registered prefix (with --server)")
    add_connection_arguments(parser)
    parser.add_argument(
        "--compressor",
        default="streamingllm",
        help=f"one of {sorted(COMPRESSORS)}, or a dropper+quantizer such as snapkv+kivi",
    )
    parser.add_argument("--ratio", type=float, help="compression ratio (token dropping)")
    parser.add_argument("--bits", type=int, help="bits per value (quantization)")
    parser.add_argument(
        "--compressed-dtype",
        choices=sorted(STORAGE_DTYPES),
        help="16-bit storage of the kept tokens (token dropping; default: the model's dtype)",
    )
    parser.add_argument(
        "--steer-every",
        type=int,
        help="vericache over snapkv, pyramidkv or kvzip: the verifier refreshes the drafter's kept "
        f"prefix positions every K rounds (0: never; default: every round over a prefix of "
        f"{STEERED_PREFIX_TOKENS} tokens or more)",
    )
    parser.add_argument(
        "--draft-len",
        type=parse_draft_len,
        default=30,
        help=f"draft tokens per round (x), or {AUTO_DRAFT_LEN!r}: chosen each round from the "
        f"acceptance so far and the measured costs, up to {ADAPTIVE_MAX_DRAFT_LEN}",
    )
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument(
        "--model", default=DEFAULT_MODEL, help="embedded model name or checkpoint dir"
    )
    add_sampling_arguments(parser)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--draft-kv", choices=[s.value for s in DraftKVSource], default="verifier")
    parser.add_argument(
        "--static-shapes",
        choices=("auto", "on", "off"),
        default="auto",
        help="decode steps over static buffers, in CUDA graphs on CUDA (auto: on CUDA only)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    add_long_context_arguments(parser)
    parser.set_defaults(handler=run)


def add_sampling_arguments(parser) -> None:
    """Sampling as vLLM's parameters define it (temperature 0: greedy)."""
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0, help="0: no limit")
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument("--presence-penalty", type=float, default=0.0)
    parser.add_argument("--seed", type=int, help="sampling seed (drawn and reported if not given)")
    parser.add_argument(
        "--coupling",
        choices=COUPLINGS,
        default="seeded",
        help="seeded: the output is full decoding's sample for the seed; rejection: the "
        "model's distribution, another sample",
    )


def sampling_params(args) -> SamplingParams:
    return SamplingParams(
        max_new_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        seed=args.seed,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        coupling=args.coupling,
        stop=tuple(args.stop),
    )


def _sampling_keywords(params: SamplingParams) -> dict:
    """The client's sampling keywords (vericache.client.Sampling) for `params`."""
    keywords = {
        "temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
        "min_p": params.min_p, "repetition_penalty": params.repetition_penalty,
        "presence_penalty": params.presence_penalty, "coupling": params.coupling,
    }  # fmt: skip
    return keywords if params.seed is None else keywords | {"seed": params.seed}


def add_long_context_arguments(parser) -> None:
    parser.add_argument(
        "--long-context",
        action="store_true",
        help="compressed KV on the device, full KV in host memory, loaded for each verification",
    )
    parser.add_argument(
        "--memory-budget",
        help="device memory for weights and KV with --long-context, e.g. 2GiB (default: all)",
    )
    parser.add_argument(
        "--pcie-bandwidth",
        help="host-to-device bandwidth the full-KV loads are held to with --long-context, e.g. "
        "8GB/s (emulates PCIe on CPU; default: as fast as the copy goes)",
    )


def long_context_config(args, pcie_alone: bool = False) -> LongContextConfig | None:
    """The long-context options (of generate and serve), checked; None without --long-context.
    `pcie_alone`: --pcie-bandwidth means something without --long-context too (serve's
    verifiers hold their store loads to it)."""
    if not args.long_context:
        if args.memory_budget or (args.pcie_bandwidth and not pcie_alone):
            raise InvalidRequestError("--memory-budget and --pcie-bandwidth need --long-context")
        return None
    return LongContextConfig(
        memory_budget_bytes=parse_size(args.memory_budget) if args.memory_budget else None,
        link_bytes_per_s=parse_bandwidth(args.pcie_bandwidth) if args.pcie_bandwidth else None,
    )


AUTO_DRAFT_LEN = "auto"
ADAPTIVE_MAX_DRAFT_LEN = 48  # the longest draft `--draft-len auto` may choose


def parse_draft_len(text: str) -> int | str:
    if text == AUTO_DRAFT_LEN:
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be a whole number or {AUTO_DRAFT_LEN!r}, got {text!r}"
        ) from None


IN_PROCESS_MODES = [m.value for m in DecodeMode]
SERVER_MODES = ["auto", "full_local", "full_remote"]  # and lossy, vericache


def build_request_compressor(args):
    return build_compressor(
        args.compressor, ratio=args.ratio, bits=args.bits, dtype=args.compressed_dtype
    )


def build_request(args, tokenizer) -> Request:
    context = args.context_file.read_text() if args.context_file is not None else None
    mode = DecodeMode(args.mode)
    compressor = None
    if mode is not DecodeMode.FULL:
        compressor = build_request_compressor(args)
    if tokenizer is None:
        raise InvalidRequestError(f"model {args.model} has no tokenizer; text prompts need one")
    prompt = build_chat_prompt(tokenizer, context, args.prompt)
    params = sampling_params(args)
    is_adaptive = args.draft_len == AUTO_DRAFT_LEN
    draft_len = ADAPTIVE_MAX_DRAFT_LEN if is_adaptive else args.draft_len
    return Request(
        prompt.token_ids,
        prompt.num_prefix_tokens,
        params,
        mode,
        compressor,
        draft_len,
        adaptive_draft_len=is_adaptive,
        steer_every=args.steer_every,
    )


def output_json(args, request: Request, out: RequestOutput) -> dict:
    return {
        "model": args.model,
        "mode": request.mode.value,
        "compressor": request.compressor.label if request.compressor else None,
        "draft_len": AUTO_DRAFT_LEN if request.adaptive_draft_len else request.draft_len,
        "steer_every": request.steer_every,
        "prompt_tokens": len(request.prompt_ids),
        "prefix_tokens": request.num_prefix_tokens,
        "text": out.text,
        "token_ids": out.token_ids,
        "finish_reason": out.finish_reason,
        "seed": out.seed,
        "stats": out.stats.as_dict(),
        "timing": out.stats.timing_dict(),
    }


def check_device(name: str) -> None:
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise InvalidRequestError(f"unknown device {name!r}") from exc
    if device.type != "cuda":
        return
    if not torch.cuda.is_available():
        raise InvalidRequestError(f"device {name!r} asked for, but CUDA is not available")
    num_devices = torch.cuda.device_count()
    if device.index is not None and device.index >= num_devices:
        raise InvalidRequestError(
            f"device {name!r} asked for, but CUDA has {num_devices} device(s)"
        )


def run(args) -> int:
    if args.mode is None and not args.server:
        args.mode = DecodeMode.VERICACHE.value
    long_context = long_context_config(args)
    is_engine_mode = args.mode in (DecodeMode.VERICACHE.value, DecodeMode.FULL.value)
    if long_context is not None and (args.server or not is_engine_mode):
        raise InvalidRequestError("--long-context runs --mode vericache or full, in this process")
    if args.draft_len == AUTO_DRAFT_LEN and args.server:
        raise InvalidRequestError(f"--draft-len {AUTO_DRAFT_LEN} runs in this process")
    params = sampling_params(args)  # bad values are refused before anything loads
    if args.server:
        return run_on_server(args, params)
    if args.mode in SERVER_MODES or args.prefix_id:
        raise InvalidRequestError(
            "--mode auto/full_local/full_remote and --prefix-id need --server"
        )
    # Check the cheap things before loading the model.
    check_device(args.device)
    if args.mode != DecodeMode.FULL.value:
        build_request_compressor(args)
    if args.context_file is not None and not args.context_file.is_file():
        raise InvalidRequestError(f"context file {args.context_file} does not exist")
    engine = build_engine(args, long_context)
    try:
        request = build_request(args, engine.tokenizer)
        (out,) = engine.generate([request])
    finally:
        if long_context is not None:
            engine.close()
    if args.json:
        output = output_json(args, request, out)
        if long_context is not None:
            output["long_context"] = engine.stats.as_dict()
        print(json.dumps(output))
        return 0
    print(out.text)
    stats = out.stats
    print(
        f"[{request.mode.value}] {len(out.token_ids)} tokens, {stats.tokens_per_s:.1f} tokens/s, "
        f"{stats.rounds} rounds, {stats.mean_accepted_per_round:.1f} accepted per round, "
        f"finish: {out.finish_reason}"
    )
    if long_context is not None:
        print_long_context_summary(engine)
    return 0


def build_engine(args, long_context: LongContextConfig | None) -> Engine | LongContextEngine:
    static_shapes = {"auto": None, "on": True, "off": False}[args.static_shapes]
    config = EngineConfig(draft_kv_source=DraftKVSource(args.draft_kv), static_shapes=static_shapes)
    if long_context is None:
        return Engine.from_pretrained(args.model, args.dtype, args.device, config)
    return LongContextEngine.from_pretrained(
        args.model, args.dtype, args.device, config, long_context
    )


def print_long_context_summary(engine: LongContextEngine) -> None:
    lc = engine.stats
    print(
        f"[long-context] {lc.num_loads} full-KV loads ({lc.load_bytes:,} bytes), "
        f"{lc.num_late_loads} late ({lc.stall_s:.3f} s waited), device memory peak "
        f"{lc.peak_device_bytes:,} of {engine.memory.budget_bytes:,} bytes"
    )


def run_on_server(args, params: SamplingParams) -> int:
    from vericache.client import Client

    if args.context_file is not None:
        raise InvalidRequestError(
            "with --server, register the context once (`vericache prefix put FILE`) and pass "
            "--prefix-id"
        )
    mode = "full_local" if args.mode == DecodeMode.FULL.value else args.mode
    with Client(args.server, **connection_options(args)) as client:
        stream = client.stream(
            args.prompt, prefix_id=args.prefix_id, mode=mode, max_tokens=args.max_tokens,
            stop=args.stop, draft_len=args.draft_len, steer_every=args.steer_every,
            **_sampling_keywords(params),
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
