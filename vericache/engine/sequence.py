"""Per-request decoding state.

A cache is owed every token of the sequence past its `num_tokens` (vLLM v1's "no phases, only
debts"): prefill, a decode step, a draft step and a verification all feed `token_ids[cache.
num_tokens:]`, plus the current draft for a verification.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from vericache.engine.request import DecodeMode, Request, RequestStats
from vericache.engine.stops import StopChecker
from vericache.kv.cache import KVCache
from vericache.kv.compressed import CompressedKV


@dataclass
class Sequence:
    request: Request
    stop_checker: StopChecker
    token_ids: list[int]  # prompt + committed output
    full_cache: KVCache | None = None
    compressed_cache: CompressedKV | None = None
    draft_ids: list[int] = field(default_factory=list)  # this round's drafts, not yet verified
    draft_target: int | None = None  # drafts wanted this round; None between rounds
    finish_reason: str | None = None
    stats: RequestStats = field(default_factory=RequestStats)
    started_at: float = field(default_factory=time.perf_counter)

    @property
    def mode(self) -> DecodeMode:
        return self.request.mode

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def needs_compressed_forward(self) -> bool:
        """A draft step (vericache) or a decode step (lossy) this iteration."""
        if self.mode is DecodeMode.LOSSY:
            return True
        if self.mode is not DecodeMode.VERICACHE:
            return False
        ended = bool(self.draft_ids) and self.draft_ids[-1] in self.stop_checker.end_ids
        return len(self.draft_ids) < self.draft_target and not ended

    @property
    def needs_full_forward(self) -> bool:
        """Full mode decodes every iteration; a vericache round verifies once its drafts are in."""
        if self.is_finished or self.mode is DecodeMode.LOSSY:
            return False
        return self.mode is DecodeMode.FULL or not self.needs_compressed_forward

    def compressed_input(self) -> list[int]:
        if self.draft_ids:
            return self.draft_ids[-1:]
        return self.token_ids[self.compressed_cache.num_tokens :]

    def full_input(self) -> list[int]:
        return self.token_ids[self.full_cache.num_tokens :] + self.draft_ids

    def commit(self, tokens: list[int]) -> int:
        """Appends output tokens one at a time until a stop condition fires; returns how many."""
        for count, token in enumerate(tokens, start=1):
            self.token_ids.append(token)
            self.stats.num_output_tokens += 1
            reason = self.stop_checker.finish_reason(self.output_ids, len(self.token_ids))
            if reason is not None:
                self.finish(reason)
                return count
        return len(tokens)

    def finish(self, reason: str) -> None:
        self.finish_reason = reason
        self.stats.total_s = time.perf_counter() - self.started_at
        self.full_cache = self.compressed_cache = None  # release memory now
