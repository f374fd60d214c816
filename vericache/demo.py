"""`make demo`: the embedded model over a real standard-library module, in the three modes.

The module goes in the system turn (the shared prefix, prefilled once and compressed once), a
coding request in the user turn. Full decoding is the reference; lossy decoding over the
compressed KV drifts from it; vericache matches it token for token at a fraction of the cost of
each full-KV step.
"""

from __future__ import annotations

import argparse

from vericache.bench.common import compressor_from_label
from vericache.bench.workloads import code_contexts
from vericache.engine.engine import Engine
from vericache.engine.prompt import build_chat_prompt
from vericache.engine.request import DecodeMode, Request, SamplingParams

PROMPT = "Write a short example that uses the main functions of the module above."
RUNS = [
    (DecodeMode.FULL, None),
    (DecodeMode.LOSSY, "streamingllm-4x"),
    (DecodeMode.VERICACHE, "streamingllm-4x"),
    (DecodeMode.VERICACHE, "kivi-4bit"),
]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--draft-len", type=int, default=30)
    args = parser.parse_args(argv)

    print("Loading the embedded model (converted once into $VERICACHE_CACHE)...")
    engine = Engine.from_pretrained()
    context = code_contexts(engine.tokenizer, 3000, 4000, count=1)[0]
    prompt = build_chat_prompt(engine.tokenizer, context.text, PROMPT)
    print(
        f"Context: {context.name} from the standard library, {len(prompt.token_ids)} prompt tokens"
    )
    print(f"Prompt: {PROMPT}\n")
    params = SamplingParams(max_new_tokens=args.max_tokens)

    rows, reference = [], None
    for mode, label in RUNS:
        compressor = compressor_from_label(label) if label else None
        request = Request(
            prompt.token_ids, prompt.num_prefix_tokens, params, mode, compressor, args.draft_len
        )
        (out,) = engine.generate([request])
        reference = reference or out
        rows.append((mode, label, out, out.token_ids == reference.token_ids))
        print(f"--- {mode.value} {label or ''}: {out.text[:240]!r}\n")
    print(_table(rows))


def _table(rows) -> str:
    header = (
        f"{'mode':<10} {'compressor':<16} {'prefill s':>9} {'tokens/s':>9} "
        f"{'accepted/round':>15} {'tokens/round':>13}  equals full"
    )
    lines = [header, "-" * len(header)]
    for mode, label, out, identical in rows:
        stats = out.stats
        accepted = f"{stats.mean_accepted_per_round:.1f}" if mode is DecodeMode.VERICACHE else "-"
        per_round = f"{stats.tokens_per_round:.1f}" if mode is DecodeMode.VERICACHE else "1.0"
        lines.append(
            f"{mode.value:<10} {label or '-':<16} {stats.prefill_s:>9.1f} "
            f"{stats.tokens_per_s:>9.1f} {accepted:>15} {per_round:>13}  "
            f"{'yes' if identical else 'NO'}"
        )
    lines.append(
        "\nprefill s: later runs reuse the prefix's KV (prefilled and compressed once). "
        "vericache must equal full; lossy need not."
    )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
