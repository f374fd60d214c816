"""A round's verification over a session's full KV, wherever the session lives: on a verifier
beside the store (verifier.py), or on a warm drafter node over its host tier (warm_node.py). One
implementation, so both give a round the same tokens and the same exact KV, bit for bit.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from vericache.engine.constraint import TokenConstraint
from vericache.engine.forward_loop import Job
from vericache.engine.request import TokenLogprob
from vericache.engine.sampling import SequenceSampler, checks_by_rejection, rejection_verdict
from vericache.engine.sequence import num_accepted
from vericache.kv.cache import KVCache
from vericache.kv.exact import ExactKV
from vericache.serve.workers.batching import BatchLoop
from vericache.serve.workers.worker_api import Drafted


@dataclass(frozen=True)
class Verification:
    # [1 + num_drafts] the full-KV choice after each fed token; under rejection coupling, the
    # kept drafts and the token after them
    tokens: tuple[int, ...]
    num_accepted: int  # drafts kept: the cache holds pending + these
    exact: ExactKV  # the KV of pending + accepted drafts, for the drafter's cache
    forward_s: float  # the batch's verification forward
    logprobs: tuple[TokenLogprob, ...] = ()  # of its tokens, where the request asks


def verify_round(
    loop: BatchLoop,
    cache: KVCache,
    pending: tuple[int, ...],
    drafted: Drafted,
    sampler: SequenceSampler | None,
    constraint: TokenConstraint | None = None,
    observe: Callable | None = None,
) -> Verification:
    """One forward over [pending + drafts] with the full KV (batched with the loop's other jobs):
    the full-KV choice after each (under the request's grammar, where it has one: each position's
    mask follows the drafts before it); keeps the KV of pending and the accepted drafts.
    `observe`: the runner's hook on the rows' queries (a steered session's, steered_sessions.py)."""
    drafts = drafted.tokens
    rejects = checks_by_rejection(sampler)
    before = cache.num_tokens
    fed = [*pending, *drafts]
    job = Job(
        cache,
        fed,
        num_logits=len(fed),
        is_full_kv=True,
        sampler=sampler,
        keeps_processed=rejects,
        reports_logprobs=not rejects,
        constraint=constraint,
        observe=observe,
    )
    started = time.perf_counter()
    tokens = loop.run(job)
    forward_s = time.perf_counter() - started
    logprobs = tuple(job.logprobs)
    if rejects:
        target = job.processed[0]  # [1 + len(drafts), V]
        verdict = rejection_verdict(sampler, drafts, drafted.distributions, target)
        tokens, logprobs = verdict.tokens, verdict.logprobs
    accepted = num_accepted(list(drafts), tokens)
    kept = before + len(pending) + accepted
    cache.truncate(kept)  # the rest was the drafts'
    exact = ExactKV.of(cache, before, kept)
    return Verification(tuple(tokens), accepted, exact, forward_s, logprobs)
