"""The remote-prefix benchmark's in-process reference: what the full-KV half of the same requests
costs the engine itself, measured beside each served sample.

The same requests as the served stream (the same prompt ids the coordinator builds from a text
prefix and a user turn) run one at a time through the in-process `Engine`, on one thread. Alone, a
request's verification runs in a forward of its own, as on the distributed verifier when no other
verification is due: its engine forward loop's CPU seconds of full-KV rows are what verification
costs. To them comes the prefill of each prompt after its prefix over the full KV, which the
verifier also runs when it opens a request. Per output token, that is the CPU the distributed
verifier is held to (`verifier_overhead`): what it spends beyond it is serving.

This machine's speed drifts, and moves by a fifth from one sample to the next, so a reference
measured before or after a cell's samples cannot tell 1.3 from 1.4. The reference is therefore
measured in parts beside the samples: after a cell's i-th of n samples, the i-th of n slices of
the stream's requests (every n-th request), at that cell's draft length. The parts together are
one reference over the whole stream, spread over the same minutes as the samples it is set
against, so what the machine does over them cancels, at no more cost than one reference.
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
    """The in-process engine's cost of some of the stream's requests at one draft length."""

    draft_len: int
    verify_cpu_s: float  # the verification forwards' CPU s (full-KV rows)
    suffix_prefill_cpu_s: float  # the prefills of each prompt after its prefix, summed
    num_tokens: int  # output tokens
    outputs: tuple[tuple[int, tuple[int, ...]], ...]  # (index in the stream, output tokens)

    @property
    def cpu_s_per_token(self) -> float:
        return (self.verify_cpu_s + self.suffix_prefill_cpu_s) / max(1, self.num_tokens)

    @classmethod
    def combined(cls, parts: list[ReferenceRun]) -> ReferenceRun:
        """Parts over slices of one stream as one run over all of it."""
        return cls(
            parts[0].draft_len,
            sum(part.verify_cpu_s for part in parts),
            sum(part.suffix_prefill_cpu_s for part in parts),
            sum(part.num_tokens for part in parts),
            tuple(sorted(output for part in parts for output in part.outputs)),
        )

    def stream_outputs(self) -> list[list[int]]:
        """The outputs in stream order."""
        return [list(tokens) for _, tokens in sorted(self.outputs)]

    def record(self, parts: list[ReferenceRun]) -> dict:
        """What a cell keeps of its reference (the outputs are checked, not kept)."""
        return {
            "draft_len": self.draft_len,
            "cpu_s_per_token": self.cpu_s_per_token,
            "suffix_prefill_cpu_s": self.suffix_prefill_cpu_s,
            "parts_cpu_s_per_token": [part.cpu_s_per_token for part in parts],
        }


class EngineReference:
    """The in-process engine, built once (prefix KV prefilled on first use), measuring slices of
    the stream's requests whenever a served sample asks."""

    def __init__(self, model: str, prefixes: list[dict], jobs, spec):
        self.engine = Engine.from_pretrained(model)
        self.requests = _requests(self.engine.tokenizer, prefixes, jobs, spec)

    def measure(self, draft_len: int, part: int = 0, parts: int = 1) -> ReferenceRun:
        """Requests part, part + parts, part + 2 parts, ... of the stream, one at a time."""
        indices = range(part, len(self.requests), parts)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # as each served worker runs
        try:
            prefill_cpu_s = sum(self._suffix_prefill_cpu_s(self.requests[i]) for i in indices)
            before = self.engine.forward.loop.exact_cpu_s
            outputs = []
            for index in indices:
                one = dataclasses.replace(self.requests[index], draft_len=draft_len)
                (finished,) = self.engine.generate([one])
                outputs.append((index, tuple(finished.token_ids)))
            verify_cpu_s = self.engine.forward.loop.exact_cpu_s - before
        finally:
            torch.set_num_threads(threads)
        num_tokens = sum(len(tokens) for _, tokens in outputs)
        run = ReferenceRun(draft_len, verify_cpu_s, prefill_cpu_s, num_tokens, tuple(outputs))
        print(f"[remote-prefix] engine x={draft_len} ({part + 1}/{parts}): "
              f"{run.cpu_s_per_token:.4f} s/token")  # fmt: skip
        return run

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
        # Unsteered, as the cells it is the reference of are served.
        request = Request(
            ids.token_ids, ids.num_prefix_tokens, params, compressor=compressor, steer_every=0
        )
        requests.append(request)
    return requests
