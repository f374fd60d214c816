"""The remote-prefix benchmark's in-process reference: what the full-KV half of the same requests
costs the engine itself.

The same requests as the served stream (the same prompt ids the coordinator builds from a text
prefix and a user turn) run one at a time through the in-process `Engine`, on one thread, for each
draft length. Alone, a request's verification runs in a forward of its own, as on the distributed
verifier when no other verification is due: its engine forward loop's CPU seconds of full-KV rows
are what verification costs. To them comes the prefill of each prompt after its prefix over the
full KV, which the verifier also runs when it opens a request. Per output token, that is the CPU
the distributed verifier is held to (`verifier_overhead`): what it spends beyond it is serving.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

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
        prefill_cpu_s = sum(_suffix_prefill_cpu_s(engine, request) for request in requests)
        per_token, outputs = {}, None
        for draft_len in spec.draft_lens:
            before = engine.loop.exact_cpu_s
            finished = []
            for request in requests:
                finished += engine.generate([dataclasses.replace(request, draft_len=draft_len)])
            num_tokens = sum(len(out.token_ids) for out in finished)
            verify_cpu_s = engine.loop.exact_cpu_s - before
            per_token[str(draft_len)] = (verify_cpu_s + prefill_cpu_s) / num_tokens
            outputs = [out.token_ids for out in finished]
            print(f"[remote-prefix] engine x={draft_len}: {per_token[str(draft_len)]:.4f} s/token")
    finally:
        torch.set_num_threads(threads)
    return {
        "full_kv_cpu_s_per_token": per_token,
        "suffix_prefill_cpu_s": prefill_cpu_s,
        "outputs": outputs,
    }


def _suffix_prefill_cpu_s(engine: Engine, request: Request) -> float:
    """The CPU seconds of the prompt's prefill after its prefix, over the prefix's full KV."""
    split = request.num_prefix_tokens
    cache = engine.prefix_kv(request.prompt_ids[:split]).clone(len(request.prompt_ids))
    suffix = torch.tensor(request.prompt_ids[split:], dtype=torch.long)
    started = time.thread_time()
    engine.runner.prefill(suffix, cache, num_logits=1, chunk_size=engine.config.prefill_chunk)
    return time.thread_time() - started


def _requests(tokenizer, prefixes: list[dict], jobs, spec) -> list[Request]:
    compressor = compressor_from_label(spec.compressor)
    text_by_id = {prefix["prefix_id"]: prefix["text"] for prefix in prefixes}
    params = SamplingParams(max_new_tokens=spec.max_tokens)
    requests = []
    for prefix_id, prompt in jobs:
        ids = build_chat_prompt(tokenizer, text_by_id[prefix_id], prompt)
        request = Request(ids.token_ids, ids.num_prefix_tokens, params, compressor=compressor)
        requests.append(request)
    return requests


def engine_reference(runs: list[dict]) -> dict:
    """The in-process reference over its runs: per draft length, the mean CPU s per token, and
    the runs themselves. The runs are apart in time: how far they differ is how far this
    machine's speed drifts over a run, the noise floor of `verifier_overhead`."""
    lens = runs[0]["full_kv_cpu_s_per_token"]
    per_run = [run["full_kv_cpu_s_per_token"] for run in runs]
    return {
        "full_kv_cpu_s_per_token": {x: statistics.mean(r[x] for r in per_run) for x in lens},
        "full_kv_cpu_s_per_token_by_run": per_run,
        "suffix_prefill_cpu_s_by_run": [run["suffix_prefill_cpu_s"] for run in runs],
        "outputs": runs[0]["outputs"],
        "outputs_agree": all(run["outputs"] == runs[0]["outputs"] for run in runs),
    }
