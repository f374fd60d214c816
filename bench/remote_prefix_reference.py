"""The remote-prefix benchmark's in-process reference: what the full-KV half of the same requests
costs the engine itself, measured beside each served sample.

The same requests as the served stream (the same prompt ids the coordinator builds from a text
prefix and a user turn) run one at a time through the in-process `Engine`, on one thread. Alone, a
request's verification runs in a forward of its own, as on the distributed verifier when no other
verification is due: its engine forward loop's CPU seconds of full-KV rows are what verification
costs. To them comes the prefill of each prompt after its prefix over the full KV, which the
verifier also runs when it opens a request. Per output token, that is the CPU the distributed
verifier is held to (`verifier_overhead`): what it spends beyond it is serving.

This machine's speed drifts by a third within an hour, so one reference for a whole run cannot
tell 1.3 from 1.4. The reference is therefore measured again right after every VERICACHE cell's
samples, at that cell's draft length, and the cell's samples are set against it: they are a few
minutes apart, and what the machine does over a few minutes mostly cancels. (A reference after
every sample, a minute apart, would cancel more, but it decodes the whole stream one request at a
time and costs about twice its sample, doubling the sweep.)
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch

from vericache.bench.common import compressor_from_label
from vericache.engine.engine import Engine
from vericache.engine.prompt import build_chat_prompt
from vericache.engine.request import Request, SamplingParams


@dataclass(frozen=True)
class ReferenceRun:
    """One measurement of the stream's requests in the in-process engine at one draft length."""

    draft_len: int
    cpu_s_per_token: float  # (verification forwards + suffix prefills) CPU s / output tokens
    suffix_prefill_cpu_s: float  # the prefills of every prompt after its prefix, summed
    outputs: tuple[tuple[int, ...], ...]  # each request's output tokens, in stream order

    def record(self) -> dict:
        """What a served sample keeps of its reference (the outputs are checked, not kept)."""
        return {
            "draft_len": self.draft_len,
            "cpu_s_per_token": self.cpu_s_per_token,
            "suffix_prefill_cpu_s": self.suffix_prefill_cpu_s,
        }


class EngineReference:
    """The in-process engine, built once (prefix KV prefilled on first use), measuring the
    stream's requests whenever a served sample asks."""

    def __init__(self, model: str, prefixes: list[dict], jobs, spec):
        self.engine = Engine.from_pretrained(model)
        self.requests = _requests(self.engine.tokenizer, prefixes, jobs, spec)

    def measure(self, draft_len: int) -> ReferenceRun:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # as each served worker runs
        try:
            prefill_cpu_s = sum(self._suffix_prefill_cpu_s(r) for r in self.requests)
            before = self.engine.loop.exact_cpu_s
            finished = []
            for request in self.requests:
                one = dataclasses.replace(request, draft_len=draft_len)
                finished += self.engine.generate([one])
            verify_cpu_s = self.engine.loop.exact_cpu_s - before
        finally:
            torch.set_num_threads(threads)
        num_tokens = sum(len(out.token_ids) for out in finished)
        per_token = (verify_cpu_s + prefill_cpu_s) / num_tokens
        print(f"[remote-prefix] engine x={draft_len}: {per_token:.4f} s/token")
        outputs = tuple(tuple(out.token_ids) for out in finished)
        return ReferenceRun(draft_len, per_token, prefill_cpu_s, outputs)

    def _suffix_prefill_cpu_s(self, request: Request) -> float:
        """The CPU seconds of the prompt's prefill after its prefix, over the prefix's full KV."""
        engine, split = self.engine, request.num_prefix_tokens
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


def reference_spread(cells: list[dict]) -> dict[str, list[float]]:
    """Per draft length, the lowest and highest reference measured over the run: how far this
    machine's speed moved, which the paired ratios cancel."""
    by_len: dict[str, list[float]] = {}
    for cell in cells:
        for sample in cell["samples"]:
            if "reference" in sample:
                run = sample["reference"]
                by_len.setdefault(str(run["draft_len"]), []).append(run["cpu_s_per_token"])
    return {x: [min(values), max(values)] for x, values in sorted(by_len.items())}
