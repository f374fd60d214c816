"""`vericache kv-size`: the bytes of one prefix's KV: full (bf16), resident after compression, and
encoded for the wire by the KV codec (vericache/kv/codec.py); c, the compressed KV's share of the
full KV's bytes (the wire's over bf16), for any compressor or composition (`snapkv+kivi`)."""

from __future__ import annotations

import json
from pathlib import Path

from vericache.compress import COMPRESSORS, build_compressor
from vericache.engine.engine import Engine
from vericache.engine.prompt import build_chat_prompt
from vericache.errors import InvalidRequestError
from vericache.kv.codec import decode_bytes, encode_bytes, model_fingerprint
from vericache.model.loader import DEFAULT_MODEL, DTYPES

FULL = "full"  # --compressor value for the uncompressed KV


def add_parser(commands) -> None:
    parser = commands.add_parser(
        "kv-size", help="KV bytes of a prefix: full, resident, on the wire"
    )
    parser.add_argument(
        "--context-file", type=Path, required=True, help="text put in the system turn (the prefix)"
    )
    parser.add_argument(
        "--compressor",
        required=True,
        help=f"one of {sorted(COMPRESSORS)}, a dropper+quantizer composition, or {FULL!r}",
    )
    parser.add_argument("--ratio", type=float, help="compression ratio (token dropping)")
    parser.add_argument("--bits", type=int, help="bits per value (quantization)")
    parser.add_argument("--model", default=DEFAULT_MODEL, help="embedded model name or checkpoint")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16", help="model dtype")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(handler=run)


def run(args) -> int:
    # The cheap checks first, before the model loads.
    if not args.context_file.is_file():
        raise InvalidRequestError(f"context file {args.context_file} does not exist")
    compressor = None
    if args.compressor != FULL:
        compressor = build_compressor(args.compressor, ratio=args.ratio, bits=args.bits)
    elif args.ratio is not None or args.bits is not None:
        raise InvalidRequestError(f"--compressor {FULL} takes neither --ratio nor --bits")
    engine = Engine.from_pretrained(args.model, args.dtype)
    if engine.tokenizer is None:
        raise InvalidRequestError(f"model {args.model} has no tokenizer; text contexts need one")
    prompt = build_chat_prompt(engine.tokenizer, args.context_file.read_text(), "")
    prefix = tuple(prompt.token_ids[: prompt.num_prefix_tokens])
    if not prefix:
        raise InvalidRequestError(
            f"context file {args.context_file} is empty: no prefix to measure"
        )
    full = engine.prefix_kv(prefix)
    cache = full if compressor is None else engine.compressed_prefix_kv(prefix, compressor)
    state = cache.to_state()
    fingerprint = model_fingerprint(engine.model_config, args.model)
    wire = encode_bytes(state, fingerprint)
    full_bf16 = engine.model_config.kv_bytes_per_token(2) * len(prefix)
    resident = full.nbytes if compressor is None else cache.resident_bytes
    report = {
        "model": args.model,
        "dtype": args.dtype,
        "label": FULL if compressor is None else compressor.label,
        "compressor": state.compressor,
        "context_file": str(args.context_file),
        "num_tokens": len(prefix),
        "full_bf16_bytes": full_bf16,
        "full_bytes": full.nbytes,  # in the model dtype
        "resident_bytes": resident,
        "wire_bytes": len(wire),
        "resident_fraction": resident / full_bf16,
        "wire_fraction": len(wire) / full_bf16,
        "c": len(wire) / full_bf16,  # what the drafter reads and the link carries, per full byte
        "round_trip_exact": decode_bytes(wire, fingerprint).equals(state),
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(
        f"{report['label']}: {len(prefix)} prefix tokens, full KV {full_bf16:,} bytes in bf16, "
        f"resident {resident:,} bytes, wire {len(wire):,} bytes "
        f"(c = {len(wire) / full_bf16:.4f}: 1/{full_bf16 / len(wire):.2f} of the bf16 full KV)"
    )
    return 0
