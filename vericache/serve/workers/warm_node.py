"""A drafter node that verifies its own sessions: its host tier, and the sessions it verifies.

A drafter drafts over compressed KV; every round's verification needs the full KV, which lives
beside the store. Once a DRAFT session has opened on a prefix, the node streams that prefix's full
KV over the link into its host tier (`WarmNode.tier`: one copy per prefix within
`DrafterConfig.host_tier_bytes`, the least recently used unpinned one out first). The link carries
the stream only while no other transfer waits (`ThrottledLink`, background), so compressed
fetches and the rounds' exact KV go first. The codec's digests are checked on arrival, as every
fetch's are: a stream that arrives damaged is fetched once more, then the node stays cold for that
prefix, and nothing damaged is ever held. A stream is bounded: a prefix larger than the tier is
never streamed, one past `host_tier_timeout_s` ends, and one whose prefix is deleted meanwhile is
ended by the sender (kv_transfer.py).

Once the copy is complete, the node is warm for the prefix (`Drafted.is_warm`), and the coordinator
moves the session's verification here between two rounds (rounds.py). `open` prefills the
session's history after the prefix over the tier's copy: with batch-invariant kernels, the same
bits the central verifier's rounds gave it. From then on each round drafts and verifies on this
node (`Drafter.local_round`), and the exact KV of the committed tokens goes into the draft cache in
place: no link bytes per round, and the central verifier serves only the sessions of cold nodes.
Verifications read the full KV where the tier holds it (host memory; on CPU, the device's own).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from vericache.engine.constraint import TokenConstraint
from vericache.engine.forward_loop import FirstToken, choose_first
from vericache.engine.sampling import SequenceSampler
from vericache.kv.cache import KVCache
from vericache.kv.pool import BufferPool
from vericache.kv.prefixed import shared_clone
from vericache.kv.shared_prefix import HeldPrefix, SharedPrefixes
from vericache.model.runner import ModelRunner
from vericache.serve.workers.batching import BatchLoop
from vericache.serve.workers.kv_transfer import KVFetcher, KVKind
from vericache.serve.workers.turn_cache import TurnCache, TurnTokens
from vericache.serve.workers.verification import Verification, verify_round
from vericache.serve.workers.worker import SessionNotFoundError
from vericache.serve.workers.worker_api import Drafted

log = logging.getLogger(__name__)


@dataclass
class _LocalSession:
    cache: KVCache  # over `prefix`, read in place
    prefix: HeldPrefix[KVCache]  # the tier's copy, pinned until the session closes
    prefix_id: str
    history: TurnTokens  # its tokens after the prefix, kept with its KV as it closes
    first: FirstToken | None = None  # the prefill's choice after the prompt, where asked for
    reused_tokens: int = 0  # of its history after the prefix, those a kept turn held


class WarmNode:
    def __init__(
        self,
        runner: ModelRunner,
        loop: BatchLoop,
        budget_bytes: int,
        buffers: BufferPool,
        prefill_chunk: int,
        timeout_s: float,
        turns: TurnCache,
    ):
        self.tier: SharedPrefixes[KVCache] = SharedPrefixes(budget_bytes)
        # The node's finished turns (its FULL sessions' too): a session that verified here keeps
        # its full KV after the prefix as it closes, and one that opens here reuses a kept turn.
        self._turns = turns
        self._runner = runner
        self._loop = loop  # the drafter's: its drafts and these verifications share forwards
        self._buffers = buffers
        self._prefill_chunk = prefill_chunk
        self._timeout_s = timeout_s
        self._streaming: set[str] = set()  # prefix ids on their way into the tier
        self._sessions: dict[str, _LocalSession] = {}
        self._lock = threading.Lock()

    # --- The host tier --------------------------------------------------------------------------

    def stream(self, prefix_id: str, nbytes: int, fetcher: KVFetcher, proofs: tuple) -> None:
        """Starts streaming the prefix's full KV (`nbytes`) into the tier (`fetcher`, whose
        copies are the tier's), unless the tier holds it, it is on its way, or it is larger than
        the whole tier."""
        with self._lock:
            if prefix_id in self._streaming or self.is_warm(prefix_id):
                return
            if nbytes > self.tier.budget_bytes:
                log.info("host tier: prefix %s is larger than the tier, stays cold", prefix_id)
                return
            self._streaming.add(prefix_id)
        args = (prefix_id, nbytes, fetcher, proofs)
        threading.Thread(target=self._stream, args=args, name="host-tier", daemon=True).start()

    def _stream(self, prefix_id: str, nbytes: int, fetcher: KVFetcher, proofs: tuple) -> None:
        try:
            fetched = fetcher.fetch(
                prefix_id, KVKind.FULL, proofs, background=True, nbytes=nbytes,
                timeout_s=self._timeout_s,
            )  # fmt: skip
            self.tier.release(fetched.held)  # kept unpinned: the tier's to evict
            log.info("host tier: prefix %s is warm (%d bytes)", prefix_id, fetched.link_bytes)
        except Exception as error:  # noqa: BLE001 - the node stays cold; central verifies
            log.warning("host tier: prefix %s stays cold (%s)", prefix_id, type(error).__name__)
        finally:
            with self._lock:
                self._streaming.discard(prefix_id)

    def warm_prefixes(self) -> frozenset[str]:
        """The prefixes whose full KV the tier holds."""
        return frozenset(prefix_id for prefix_id, _ in self.tier.keys())

    def is_warm(self, prefix_id: str) -> bool:
        """Whether the tier holds the prefix's full KV, complete and checked."""
        return self.tier.holds((prefix_id, KVKind.FULL))

    # --- Sessions it verifies -------------------------------------------------------------------

    def open(
        self,
        session_id: str,
        prefix_id: str,
        history: tuple[int, ...],
        capacity: int,
        wants_first_token: bool = False,
        sampler: SequenceSampler | None = None,
        constraint: TokenConstraint | None = None,
    ) -> _LocalSession | None:
        """The session's full KV over the tier's copy of its prefix: the history after the
        prefix (the longest leading run a kept turn holds copied, the rest prefilled: the central
        verifier's bits, by batch invariance), and, where wanted, the prefill's choice after it
        (by `sampler`; None: greedy). None where the tier no longer holds the prefix (evicted
        since it said it was warm)."""
        held = self.tier.acquire_held((prefix_id, KVKind.FULL))
        if held is None:
            return None
        try:
            cache = shared_clone(held.cache, capacity, self._buffers)
            after_prefix = history[held.cache.num_tokens :]
            # A kept turn never holds the last token: its prefill gives the first token's logits.
            reused = self._turns.reuse_into(prefix_id, after_prefix, cache)
            session = _LocalSession(cache, held, prefix_id, TurnTokens(after_prefix))
            session.reused_tokens = reused
            logits = self._runner.prefill(
                torch.tensor(after_prefix[reused:], dtype=torch.long), cache,
                num_logits=int(wants_first_token), chunk_size=self._prefill_chunk,
            )  # fmt: skip
            if wants_first_token:
                session.first = choose_first(logits, sampler, constraint)
                session.history.commit([session.first.token_id])
        except BaseException:
            self.tier.release(held)
            raise
        with self._lock:
            self._sessions[session_id] = session
        return session

    def verify(
        self,
        session_id: str,
        pending: tuple[int, ...],
        drafted: Drafted,
        sampler: SequenceSampler | None,
        constraint: TokenConstraint | None = None,
        observe: Callable | None = None,
    ) -> Verification:
        """The round's verification (verification.py), as a verifier beside the store runs it
        (`observe`: the runner's hook on its queries, a steered session's)."""
        session = self._session(session_id)
        num_prefix = session.prefix.cache.num_tokens
        session.history.feed(session.cache.num_tokens - num_prefix, pending)
        try:
            done = verify_round(
                self._loop, session.cache, pending, drafted, sampler, constraint, observe
            )
        except BaseException:
            session.history.forget()  # what its cache holds now is not known
            raise
        session.history.commit(done.tokens[: done.num_accepted + 1])  # the rest: rejected
        return done

    def full_cache(self, session_id: str) -> KVCache:
        """The full KV of a session the node verifies (over its tier's copy of the prefix)."""
        return self._session(session_id).cache

    def _session(self, session_id: str) -> _LocalSession:
        with self._lock:
            session = self._sessions.get(session_id)
        if session is None:
            raise SessionNotFoundError(f"the drafter verifies no session {session_id!r}")
        return session

    def close(self, session_id: str) -> None:
        """Keeps the session's full KV after its prefix as a finished turn, then drops it and
        unpins its prefix (kept in the tier)."""
        with self._lock:
            session = self._sessions.pop(session_id, None)
        if session is not None:
            cache, num_prefix = session.cache, session.prefix.cache.num_tokens
            session.history.keep_cache(self._turns, session.prefix_id, cache, num_prefix)
            cache.release(self._buffers)
            self.tier.release(session.prefix)
