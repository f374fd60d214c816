"""The decoding engine: full, lossy and vericache modes over one model runner.

Each iteration is one batched forward through the forward loop (forward_loop.py): draft steps of
vericache requests and lossy decode steps over their compressed caches (fast kernels), and
verifications and full decode steps over their full caches (batch-invariant kernels), sharing one
read of the weights. A vericache request drafts for up to `draft_len` iterations (or a length
chosen each round, with `adaptive_draft_len`), then verifies in the next: a round of d drafts takes
d + 1 iterations, as in the long-context engine and the schedulers. Rounds begin and end in
`Sequence` (sequence.py), the one implementation every driver shares.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from vericache.compress.context import ModelContext
from vericache.engine.device_memory import full_kv_capacity
from vericache.engine.forward_loop import ForwardLoop, Job, greedy
from vericache.engine.prefix_store import PrefixStore
from vericache.engine.request import DecodeMode, Request, RequestOutput
from vericache.engine.sampling import rejection_verified
from vericache.engine.sequence import Sequence
from vericache.errors import InvalidRequestError
from vericache.kv.cache import KVCache
from vericache.kv.compressed import CompressedKV
from vericache.kv.exact import ExactKV
from vericache.kv.prefixed import shared_clone
from vericache.model.loader import DEFAULT_MODEL, load_model
from vericache.model.runner import DEFAULT_PREFILL_CHUNK, ModelRunner
from vericache.scheduler.adaptive import MeasuredRoundCosts, acceptance_rate, best_draft_len


class DraftKVSource(str, enum.Enum):
    """What the compressed cache holds for tokens once they are committed.

    VERIFIER: the exact KV the verification computed (or the prefill, for the prompt's suffix).
    DRAFTER: the KV the drafter computed itself over its compressed cache.
    Measured with `vericache bench acceptance --draft-kv both` (README: "Draft KV"): exact KV
    accepts more tokens per round, so it is the default.
    """

    VERIFIER = "verifier"
    DRAFTER = "drafter"


@dataclass(frozen=True)
class EngineConfig:
    draft_kv_source: DraftKVSource = DraftKVSource.VERIFIER
    # Batch-invariant kernels for every full-KV decode or verification: greedy vericache output is
    # then bit-identical to full decoding. False trades that guarantee for speed.
    invariant_full_kv: bool = True
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK
    # Full and compressed KV of prompt prefixes kept for reuse (0 turns reuse off).
    prefix_cache_bytes: int = 2 << 30

    def __post_init__(self):
        if self.prefill_chunk < 1 or self.prefix_cache_bytes < 0:
            raise InvalidRequestError("prefill_chunk must be >= 1 and prefix_cache_bytes >= 0")


class Engine:
    def __init__(
        self,
        runner: ModelRunner,
        tokenizer=None,
        config: EngineConfig = EngineConfig(),
        prefix_store: PrefixStore | None = None,
    ):
        self.runner = runner
        self.tokenizer = tokenizer
        self.config = config
        self.model_config = runner.config
        # Shareable between engines over the same runner (e.g. with different configs).
        self.prefix_store = prefix_store or PrefixStore(config.prefix_cache_bytes)
        # Timed forwards, for requests with an adaptive draft length.
        self.round_costs = MeasuredRoundCosts()
        self.loop = ForwardLoop(runner, config.invariant_full_kv)

    @classmethod
    def from_pretrained(
        cls, model: str = DEFAULT_MODEL, dtype="float32", device="cpu", config=EngineConfig()
    ) -> Engine:
        loaded = load_model(model, dtype=dtype, device=device)
        return cls(ModelRunner(loaded.config, loaded.weights, device), loaded.tokenizer, config)

    def generate(self, requests: Iterable[Request]) -> list[RequestOutput]:
        sequences = [self._start(request) for request in requests]
        active = [seq for seq in sequences if not seq.is_finished]
        while active:
            self.step(active)
            active = [seq for seq in active if not seq.is_finished]
        return [self._output(seq) for seq in sequences]

    def step(self, active: list[Sequence]) -> None:
        """One iteration: one forward over every sequence's next step (a draft step or a
        verification of a vericache round, a full or lossy decode step)."""
        planned = _planned_verify_steps(active)
        for seq in active:
            if seq.mode is DecodeMode.VERICACHE and seq.draft_target is None:
                num_drafts = seq.begin_round(self._draft_len(seq, planned))
                planned.add(num_drafts)  # this round verifies that many steps from now
        compressed_batch = [seq for seq in active if seq.needs_compressed_forward]
        full_batch = [seq for seq in active if seq.needs_full_forward]
        self._run_forward(compressed_batch, full_batch)

    def _draft_len(self, seq: Sequence, planned: set[int]) -> int:
        """planned: steps from now (0: this one) that already run a full-KV forward."""
        request = seq.request
        if not request.adaptive_draft_len:
            return request.draft_len
        stats = seq.stats
        alpha = acceptance_rate(stats.drafted_per_round, stats.accepted_per_round)
        costs = self.round_costs.round_costs()
        # A round of d drafts verifies d steps from now.
        return best_draft_len(alpha, costs, 1, request.draft_len, planned)

    def _run_forward(self, compressed_batch: list[Sequence], full_batch: list[Sequence]) -> None:
        """One forward: a step over the compressed caches of `compressed_batch` (draft or lossy
        steps) and one over the full caches of `full_batch` (verifications or full decode steps),
        through the forward loop."""
        compressed_jobs = [
            Job(
                seq.compressed_cache,
                seq.compressed_input(),
                sampler=seq.sampler(seq.draft_ids),
                keeps_distributions=seq.rejects,
            )
            for seq in compressed_batch
        ]
        full_jobs = [
            Job(
                seq.full_cache,
                seq.full_input(),
                num_logits=1 + len(seq.draft_ids),
                exact=True,
                sampler=seq.sampler(),
                keeps_distributions=seq.rejects,
            )
            for seq in full_batch
        ]
        num_verified_before = [seq.full_cache.num_tokens for seq in full_batch]
        elapsed = self.loop.step(compressed_jobs + full_jobs)
        draft_s = self._observe_forward(elapsed, compressed_jobs, full_jobs)
        for seq, job in zip(compressed_batch, compressed_jobs):
            (token,) = job.choices
            if seq.mode is DecodeMode.LOSSY:
                self._decode_step(seq, token, draft_s)
                if not seq.is_finished:
                    seq.request.compressor.update(seq.compressed_cache)
            else:
                seq.stats.draft_s += draft_s
                seq.draft_ids.append(token)
                if job.keeps_distributions:
                    seq.draft_distributions.append(job.distributions[0][0])
        for seq, job, verified_before in zip(full_batch, full_jobs, num_verified_before):
            if seq.mode is DecodeMode.FULL:
                self._decode_step(seq, job.choices[0], elapsed - draft_s)
            else:
                seq.stats.verify_s += elapsed - draft_s
                verified = _rejection_verified(seq, job) if seq.rejects else job.choices
                self._finish_round(seq, verified, verified_before)

    def _observe_forward(self, elapsed: float, compressed_jobs, full_jobs) -> float:
        """Feeds a forward's time to the round costs; returns the part that is the compressed step
        (in a shared forward, estimated from the draft steps timed alone)."""
        if not full_jobs:
            self.round_costs.observe_draft_step(elapsed, len(compressed_jobs))
            return elapsed
        draft_s = min(elapsed, (self.round_costs.draft_step_s or 0.0) * len(compressed_jobs))
        num_tokens = sum(job.num_logits for job in full_jobs)
        self.round_costs.observe_verification(elapsed - draft_s, len(full_jobs), num_tokens)
        return draft_s

    @staticmethod
    def _decode_step(seq: Sequence, token: int, elapsed: float) -> None:
        """A single-token step of the full or lossy mode."""
        seq.stats.decode_s += elapsed
        seq.commit_decoded([token])

    def _finish_round(self, seq: Sequence, verified: list[int], verified_before: int) -> None:
        seq.finish_round(verified)
        if seq.is_finished:
            return
        # Keep the KV of the accepted tokens; the newest token is fed in the next round.
        num_kept = len(seq.token_ids) - 1
        seq.full_cache.truncate(num_kept)
        compressed = seq.compressed_cache
        if self.config.draft_kv_source is DraftKVSource.VERIFIER:
            compressed.truncate(verified_before)
            compressed.append_exact(ExactKV.of(seq.full_cache, verified_before, num_kept, False))
        else:
            compressed.truncate(min(compressed.num_tokens, num_kept))
        seq.request.compressor.update(compressed)

    def _start(self, request: Request) -> Sequence:
        max_positions = self.model_config.max_position_embeddings
        if len(request.prompt_ids) >= max_positions:
            raise InvalidRequestError(
                f"the prompt has {len(request.prompt_ids)} tokens; the model's context is "
                f"{max_positions}, and at least one must remain for output"
            )
        vocab_size = self.model_config.vocab_size
        if not all(0 <= token < vocab_size for token in request.prompt_ids):
            raise InvalidRequestError(f"prompt token ids must lie in [0, {vocab_size})")
        seq = Sequence.start(
            request, self.model_config.eos_token_ids, max_positions, self.tokenizer
        )
        logits = self._prefill(seq)[-1:]
        sampler = seq.sampler()
        (first,) = greedy([logits]) if sampler is None else [sampler.sample(logits)]
        seq.stats.prefill_s = time.perf_counter() - seq.started_at
        seq.commit(first)
        return seq

    def _prefill(self, seq: Sequence) -> torch.Tensor:
        """Fills the caches the mode needs; returns the logits that choose the first token."""
        request = seq.request
        # At least one token follows the prefix, so that its logits choose the first output.
        split = min(request.num_prefix_tokens, len(request.prompt_ids) - 1)
        prefix_ids, suffix = request.prompt_ids[:split], id_tensor(request.prompt_ids[split:])
        capacity = full_kv_capacity(request, self.model_config.max_position_embeddings)
        full, compressed = self._prefix_caches(prefix_ids, seq.mode, request.compressor, capacity)
        seq.full_cache, seq.compressed_cache = full, compressed
        if seq.mode is DecodeMode.FULL:
            return self._prefill_tokens(suffix, full)
        if seq.mode is DecodeMode.LOSSY:
            # The lossy baseline computes the user turn over its compressed KV, like any
            # compressed-cache server would.
            logits = self._prefill_tokens(suffix, compressed)
        else:
            logits = self._prefill_tokens(suffix, full)
            if self.config.draft_kv_source is DraftKVSource.VERIFIER:
                prompt_kv = ExactKV.of(full, split, len(request.prompt_ids), copy=False)
                compressed.append_exact(prompt_kv)
            else:
                self._prefill_tokens(suffix, compressed, num_logits=0)
        request.compressor.update(compressed)
        return logits

    def _prefix_caches(
        self, prefix_ids: tuple[int, ...], mode: DecodeMode, compressor, capacity: int
    ) -> tuple[KVCache | None, CompressedKV | None]:
        """The request's own caches over its prefix: the prefix store's full KV (room for
        `capacity` tokens; none for LOSSY) and compressed KV (none for FULL), each read in place
        by every request on the prefix, which holds its own tokens alone (kv/prefixed.py)."""
        full = None
        if mode is not DecodeMode.LOSSY:
            full = shared_clone(self.prefix_kv(prefix_ids), capacity)
        compressed = None
        if mode is not DecodeMode.FULL:
            compressed = shared_clone(self.compressed_prefix_kv(prefix_ids, compressor), 0)
        return full, compressed

    def compressed_prefix_kv(self, prefix_ids: tuple[int, ...], compressor) -> CompressedKV:
        """A prefix's KV compressed once per compressor, then reused. Shared: clone it to edit."""
        return self.prefix_store.lookup(
            (prefix_ids, compressor),
            lambda: compressor.compress(self.prefix_kv(prefix_ids), self.model_context(prefix_ids)),
        )

    def model_context(self, prefix_ids: tuple[int, ...]) -> ModelContext:
        """What a compressor may run on the model while compressing this prefix."""
        return ModelContext(self.runner, prefix_ids, self.tokenizer)

    def prefix_kv(self, prefix_ids: tuple[int, ...]) -> KVCache:
        """The full KV of a prefix, prefilled once and then reused. Shared: clone it to edit."""

        def prefill() -> KVCache:
            cache = self.runner.new_cache(capacity=len(prefix_ids))
            if prefix_ids:
                self._prefill_tokens(id_tensor(prefix_ids), cache, num_logits=0)
            return cache

        return self.prefix_store.lookup(prefix_ids, prefill)

    def _prefill_tokens(self, token_ids: torch.Tensor, cache: KVCache, num_logits: int = 1):
        invariant = self.config.invariant_full_kv and cache.is_full
        return self.runner.prefill(
            token_ids, cache, num_logits, self.config.prefill_chunk, invariant=invariant
        )

    def _output(self, seq: Sequence) -> RequestOutput:
        return RequestOutput(
            request_id=seq.request.request_id,
            prompt_ids=list(seq.request.prompt_ids),
            token_ids=seq.output_ids,
            text=seq.stop_checker.output_text(seq.output_ids),
            finish_reason=seq.finish_reason,
            stats=seq.stats,
            seed=seq.seed,
        )


def _rejection_verified(seq: Sequence, job: Job) -> list[int]:
    """The round's tokens under rejection coupling (sampling.rejection_verified)."""
    drafts = seq.draft_distributions
    draft_probs = torch.stack(drafts) if drafts else None
    return rejection_verified(seq.sampler(), seq.draft_ids, draft_probs, job.distributions[0])


def _planned_verify_steps(active: list[Sequence]) -> set[int]:
    """Steps from now (0: this one) in which a full-KV forward is due: verifications of rounds
    under way, or every step while a full-mode sequence decodes."""
    if any(seq.mode is DecodeMode.FULL for seq in active):
        return set(range(max(seq.request.draft_len for seq in active) + 1))
    return {
        seq.draft_target - len(seq.draft_ids)
        for seq in active
        if seq.mode is DecodeMode.VERICACHE and seq.draft_target is not None
    }


def id_tensor(token_ids) -> torch.Tensor:
    """Token ids as the model runner takes them: int64 [T]."""
    return torch.tensor(list(token_ids), dtype=torch.long)
