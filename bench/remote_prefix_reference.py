"""The remote-prefix benchmark's in-process reference: what verification costs the engine itself.

The same requests as the served stream (the same prompt ids the coordinator builds from a text
prefix and a user turn), `concurrency` at a time, through the in-process `Engine` on one thread,
for each draft length. The engine's forward loop counts the CPU seconds of its forwards and the
full-KV rows' share of them (split by tokens fed, since drafts and verifications share forwards):
per output token, that share is the verification cost the distributed verifier is held to.
"""

from __future__ import annotations

import dataclasses

import torch

from vericache.bench.common import compressor_from_label
from vericache.engine.engine import Engine
from vericache.engine.prompt import build_chat_prompt
from vericache.engine.request import Request, SamplingParams


def engine_verification(model: str, prefixes: list[dict], jobs, spec) -> dict:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each served worker runs
    try:
        engine = Engine.from_pretrained(model)
        requests = _requests(engine.tokenizer, prefixes, jobs, spec)
        per_token, outputs = {}, None
        for draft_len in spec.draft_lens:
            before = engine.loop.exact_cpu_s
            finished = []
            for start in range(0, len(requests), spec.concurrency):
                wave = requests[start : start + spec.concurrency]
                finished += engine.generate(
                    [dataclasses.replace(request, draft_len=draft_len) for request in wave]
                )
            num_tokens = sum(len(out.token_ids) for out in finished)
            per_token[str(draft_len)] = (engine.loop.exact_cpu_s - before) / num_tokens
            outputs = [out.token_ids for out in finished]
            print(f"[remote-prefix] engine x={draft_len}: {per_token[str(draft_len)]:.4f} s/token")
    finally:
        torch.set_num_threads(threads)
    return {"exact_cpu_s_per_token": per_token, "outputs": outputs}


def _requests(tokenizer, prefixes: list[dict], jobs, spec) -> list[Request]:
    compressor = compressor_from_label(spec.compressor)
    text_by_id = {prefix["prefix_id"]: prefix["text"] for prefix in prefixes}
    params = SamplingParams(max_new_tokens=spec.max_tokens)
    requests = []
    for prefix_id, prompt in jobs:
        ids = build_chat_prompt(tokenizer, text_by_id[prefix_id], prompt)
        requests.append(
            Request(ids.token_ids, ids.num_prefix_tokens, params, compressor=compressor)
        )
    return requests
