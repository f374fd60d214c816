"""The drafter: the worker on a remote GPU, across the slow link from the store.

It fetches a prefix's KV from a verifier's KVTransfer service (kept in an LRU bounded by bytes, so
later requests on the prefix pay no transfer) and decodes greedily over it, in one of three roles:
- draft (VERICACHE): drafts over the compressed KV; before each round the exact KV the verifier
  computed for the tokens committed since replaces the drafts' own, as in the core engine.
- lossy (LOSSY): decodes alone over the compressed KV, which online compressors update each step.
- full (FULL_REMOTE): decodes alone over the full KV it fetched, with the verifier's kernels.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from vericache.engine.calibration import time_draft_step
from vericache.engine.forward_loop import Job
from vericache.errors import InvalidRequestError
from vericache.kv.cache import KVCache
from vericache.kv.compressed import CompressedKV
from vericache.serve.batching import BatchLoop
from vericache.serve.config import DrafterConfig
from vericache.serve.kv_transfer import KVFetcher, KVKind
from vericache.serve.worker import (
    ExactKV,
    SessionNotFoundError,
    WorkResult,
    first_token,
    load_worker_model,
)


class DraftRole(str, enum.Enum):
    DRAFT = "draft"
    LOSSY = "lossy"
    FULL = "full"


# step()'s arguments: session_id, pending, max_tokens, end_ids, exact.
DraftStep = tuple[str, list[int], int, list[int], "ExactKV | None"]


@dataclass
class _Session:
    role: DraftRole
    cache: KVCache


class Drafter:
    def __init__(self, config: DrafterConfig):
        self.config = config
        _, self.runner, self.info = load_worker_model(config)
        self._fetchers: dict[str, KVFetcher] = {}  # by verifier address
        self._sessions: dict[str, _Session] = {}
        self._loop = BatchLoop(self.runner, "drafter-batch")

    def describe(self) -> dict:
        return {"info": self.info}

    def time_draft_step(self) -> float:
        """Seconds of one draft step: a first estimate for a scheduler, which refines it."""
        return time_draft_step(self.runner)

    def open(
        self,
        session_id: str,
        role: str,
        transfer_address: str,
        prefix_id: str,
        prompt_ids: list[int],
        num_prefix_tokens: int,
        capacity: int,
    ) -> WorkResult:
        """Fetches the prefix's KV (an LRU hit costs nothing). Alone (lossy, full), prefills the
        rest of the prompt and returns the first token; drafting waits for the verifier's KV."""
        role = DraftRole(role)
        kind = KVKind.FULL if role is DraftRole.FULL else KVKind.COMPRESSED
        fetched = self._fetcher(transfer_address).fetch(prefix_id, kind)
        if fetched.cache.num_tokens != num_prefix_tokens:
            raise InvalidRequestError(
                f"prefix {prefix_id} holds {fetched.cache.num_tokens} tokens, "
                f"the request says {num_prefix_tokens}"
            )
        cache = fetched.cache.clone(capacity)
        result = WorkResult(link_bytes=fetched.link_bytes, link_s=fetched.seconds)
        if role is not DraftRole.DRAFT:
            suffix = torch.tensor(prompt_ids[num_prefix_tokens:], dtype=torch.long)
            chunk = self.config.prefill_chunk
            result.tokens = [first_token(self.runner.prefill(suffix, cache, chunk_size=chunk))]
            self._update(cache)
        self._sessions[session_id] = _Session(role, cache)
        return result

    def step(
        self,
        session_id: str,
        pending: list[int],
        max_tokens: int,
        end_ids: list[int],
        exact: ExactKV | None = None,
    ) -> WorkResult:
        """Up to `max_tokens` greedy tokens after `pending`, batched with the drafter's other
        requests. `exact`: the verifier's KV of the tokens committed since the last round, which
        replaces what this cache drafted for them."""
        job = self._job(session_id, pending, max_tokens, end_ids, exact)
        return WorkResult(tokens=self._loop.run(job))

    def step_many(self, steps: list[DraftStep]) -> list[WorkResult | None]:
        """`step` for several sessions at once, in one batch from their first forward on: a
        scheduled iteration's draft step (scheduled.py). A session closed meanwhile (its request
        cancelled) gets None; the others step."""
        jobs: list[Job | None] = []
        for step in steps:
            try:
                jobs.append(self._job(*step))
            except SessionNotFoundError:
                jobs.append(None)
        choices = iter(self._loop.run_many([job for job in jobs if job is not None]))
        return [None if job is None else WorkResult(tokens=next(choices)) for job in jobs]

    def _job(
        self,
        session_id: str,
        pending: list[int],
        max_tokens: int,
        end_ids: list[int],
        exact: ExactKV | None,
    ) -> Job:
        session = self._sessions.get(session_id)
        if session is None:
            raise SessionNotFoundError(f"the drafter holds no session {session_id!r}")
        cache = session.cache
        if exact is not None:
            cache.truncate(exact.start)  # drops the drafts: uncommitted, never compressed
            cache.append_exact(exact)
            self._update(cache)
        return Job(
            cache,
            list(pending),
            max_steps=max_tokens,
            end_ids=frozenset(end_ids),
            exact=session.role is DraftRole.FULL,
            after_step=(lambda: self._update(cache)) if session.role is DraftRole.LOSSY else None,
        )

    def batching(self) -> dict:
        """Steps the batch loop ran, and the largest batch one of them held."""
        return {"steps": self._loop.num_steps, "max_batch": self._loop.max_batch}

    def close(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)

    def shutdown(self) -> None:
        self._loop.stop()
        self._sessions.clear()
        for fetcher in self._fetchers.values():
            fetcher.close()
        self._fetchers.clear()

    def _fetcher(self, address: str) -> KVFetcher:
        if address not in self._fetchers:
            self._fetchers[address] = KVFetcher(
                address, self.info.fingerprint, self.config.kv_cache_bytes, self.runner.rope
            )
        return self._fetchers[address]

    @staticmethod
    def _update(cache: KVCache) -> None:
        if isinstance(cache, CompressedKV):
            cache.compressor.update(cache)
