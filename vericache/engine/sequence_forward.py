"""One forward over sequences: the forward loop's jobs built from their next steps, and what the
forward chose committed back to them.

A draft step of a vericache round or a lossy decode step runs over a sequence's compressed cache;
a verification or a full decode step over its full cache; all of them in one forward of the
forward loop (forward_loop.py). The engine and the long-context engine both run every forward of
their sequences through `SequenceForward.run`; they differ in who begins a round and chooses its
draft length (the engine's own policy, or the long-context engine's scheduler) and in where a
sequence's full KV is kept between verifications.
"""

from __future__ import annotations

import torch

from vericache.engine.engine_config import DraftKVSource, EngineConfig
from vericache.engine.forward_loop import ForwardLoop, Job
from vericache.engine.request import DecodeMode
from vericache.engine.sampling import Verdict, rejection_verdict
from vericache.engine.sequence import Sequence
from vericache.kv.exact import ExactKV
from vericache.model.runner import ModelRunner
from vericache.scheduler.adaptive import MeasuredRoundCosts


class SequenceForward:
    def __init__(self, runner: ModelRunner, config: EngineConfig):
        self.loop = ForwardLoop(runner, config.invariant_full_kv)
        self.draft_kv_source = config.draft_kv_source
        # Timed forwards: what an adaptive draft length weighs, and how a shared forward's time
        # splits between its draft step and its verifications.
        self.round_costs = MeasuredRoundCosts()

    def run(self, compressed_batch: list[Sequence], full_batch: list[Sequence]) -> None:
        """One forward: a step over the compressed caches of `compressed_batch` (draft or lossy
        steps) and one over the full caches of `full_batch` (verifications or full decode steps).
        A vericache sequence in `full_batch` finishes its round."""
        compressed_jobs = [
            Job(
                seq.compressed_cache,
                seq.compressed_input(),
                sampler=seq.sampler(seq.draft_ids),
                keeps_processed=seq.is_rejection_coupled,
                reports_logprobs=seq.mode is DecodeMode.LOSSY,
                constraint=seq.constraint,
                constrained_after=list(seq.draft_ids),
            )
            for seq in compressed_batch
        ]
        full_jobs = [
            Job(
                seq.full_cache,
                seq.full_input(),
                num_logits=1 + len(seq.draft_ids),
                is_full_kv=True,
                sampler=seq.sampler(),
                keeps_processed=seq.is_rejection_coupled,
                reports_logprobs=not seq.is_rejection_coupled,
                constraint=seq.constraint,
                observe=seq.steering.observe if seq.steering is not None else None,
            )
            for seq in full_batch
        ]
        num_verified_before = [seq.full_cache.num_tokens for seq in full_batch]
        elapsed = self.loop.step(compressed_jobs + full_jobs)
        draft_s = self._observe(elapsed, compressed_jobs, full_jobs)
        for seq, job in zip(compressed_batch, compressed_jobs):
            (token,) = job.choices
            if seq.mode is DecodeMode.LOSSY:
                _decode_step(seq, job, draft_s)
                if not seq.is_finished:
                    seq.request.compressor.update(seq.compressed_cache)
            else:
                seq.stats.draft_s += draft_s
                seq.draft_ids.append(token)
                if job.keeps_processed:
                    seq.draft_distributions.append(job.processed[0][0].softmax(-1))
        for seq, job, verified_before in zip(full_batch, full_jobs, num_verified_before):
            if seq.mode is DecodeMode.FULL:
                _decode_step(seq, job, elapsed - draft_s)
            else:
                seq.stats.verify_s += elapsed - draft_s
                if seq.is_rejection_coupled:
                    verified = _rejection_verified(seq, job)
                else:
                    verified = Verdict(job.choices, tuple(job.logprobs))
                self._finish_round(seq, verified, verified_before)

    def _observe(self, elapsed: float, compressed_jobs: list[Job], full_jobs: list[Job]) -> float:
        """Feeds a forward's time to the round costs; returns the part that is the compressed step
        (in a shared forward, estimated from the draft steps timed alone)."""
        if not full_jobs:
            self.round_costs.observe_draft_step(elapsed, len(compressed_jobs))
            return elapsed
        draft_s = min(elapsed, (self.round_costs.draft_step_s or 0.0) * len(compressed_jobs))
        num_tokens = sum(job.num_logits for job in full_jobs)
        self.round_costs.observe_verification(elapsed - draft_s, len(full_jobs), num_tokens)
        return draft_s

    def _finish_round(self, seq: Sequence, verified: Verdict, verified_before: int) -> None:
        seq.finish_round(verified.tokens, verified.logprobs)
        if seq.is_finished:
            return
        # Keep the KV of the accepted tokens; the newest token is fed in the next round.
        num_kept = len(seq.token_ids) - 1
        seq.full_cache.truncate(num_kept)
        compressed = seq.compressed_cache
        if self.draft_kv_source is DraftKVSource.VERIFIER:
            compressed.truncate(verified_before)
            compressed.append_exact(ExactKV.of(seq.full_cache, verified_before, num_kept, False))
        else:
            compressed.truncate(min(compressed.num_tokens, num_kept))
        seq.request.compressor.update(compressed)
        steering = seq.steering
        if steering is not None and steering.round_done():
            seq.stats.changed_per_refresh.append(steering.refresh(compressed, seq.full_cache))


def _decode_step(seq: Sequence, job: Job, elapsed: float) -> None:
    """A single-token step of the full or lossy mode."""
    seq.stats.decode_s += elapsed
    seq.commit_decoded(job.choices, tuple(job.logprobs))


def _rejection_verified(seq: Sequence, job: Job) -> Verdict:
    """The round's tokens under rejection coupling (sampling.rejection_verified)."""
    drafts = seq.draft_distributions
    draft_probs = torch.stack(drafts) if drafts else None  # [num_drafts, V]
    return rejection_verdict(seq.sampler(), seq.draft_ids, draft_probs, job.processed[0])
