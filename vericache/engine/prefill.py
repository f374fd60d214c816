"""Starting a sequence: its request checked against the model, the caches its mode needs
prefilled, its first token chosen.

The engine and the long-context engine both start their sequences with a `SequenceStarter`. They
differ only in where a request's KV over its prompt prefix comes from (a `PrefixCaches`,
prefix_caches.py); `Prefiller` runs every prefill of either on the model the same way, so a
prefix's full KV is the same bits whichever source made it.
"""

from __future__ import annotations

import time
from typing import Protocol

import torch

from vericache.compress.base import Compressor
from vericache.compress.context import ModelContext
from vericache.compress.steering import KeptSetSteering
from vericache.engine.constraint import TokenConstraint
from vericache.engine.device_memory import full_kv_capacity
from vericache.engine.engine_config import DraftKVSource, EngineConfig
from vericache.engine.forward_loop import choose_first
from vericache.engine.request import DecodeMode, Request
from vericache.engine.sequence import Sequence
from vericache.errors import InvalidRequestError
from vericache.kv.cache import KVCache
from vericache.kv.compressed import CompressedKV
from vericache.kv.exact import ExactKV
from vericache.model.runner import ModelRunner


class Prefiller:
    """Prefills on one model runner in `prefill_chunk`-token chunks, full KV with the
    batch-invariant kernels (unless the config gives that up)."""

    def __init__(self, runner: ModelRunner, tokenizer, config: EngineConfig):
        self.runner = runner
        self.tokenizer = tokenizer
        self.config = config

    def prefill(self, token_ids: torch.Tensor, cache: KVCache, num_logits: int = 1) -> torch.Tensor:
        """token_ids: [T]; returns the logits [num_logits, V] of the last `num_logits` tokens."""
        invariant = self.config.invariant_full_kv and cache.is_full
        return self.runner.prefill(
            token_ids, cache, num_logits, self.config.prefill_chunk, invariant=invariant
        )

    def prefill_prefix(self, prefix_ids: tuple[int, ...], capacity: int) -> KVCache:
        """A new full cache with room for `capacity` tokens, holding the prefix's KV."""
        cache = self.runner.new_cache(capacity=capacity)
        if prefix_ids:
            self.prefill(id_tensor(prefix_ids), cache, num_logits=0)
        return cache

    def model_context(self, prefix_ids: tuple[int, ...]) -> ModelContext:
        """What a compressor may run on the model while compressing this prefix."""
        return ModelContext(self.runner, prefix_ids, self.tokenizer)


class PrefixCaches(Protocol):
    def caches(
        self, prefix_ids: tuple[int, ...], mode: DecodeMode, compressor: Compressor, capacity: int
    ) -> tuple[KVCache | None, CompressedKV | None]:
        """A request's own caches over its prompt prefix: full KV with room for `capacity`
        tokens (none for LOSSY) and compressed KV (none for FULL), each for it alone to edit."""


class SequenceStarter:
    def __init__(self, prefiller: Prefiller, prefixes: PrefixCaches):
        self.prefiller = prefiller
        self.prefixes = prefixes
        self.model_config = prefiller.runner.config

    def start(self, request: Request) -> Sequence:
        """The request's sequence, prefilled, with its first output token committed."""
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
            request, self.model_config.eos_token_ids, max_positions, self.prefiller.tokenizer
        )
        if request.constraint is not None:
            end_ids = frozenset(seq.stop_checker.end_ids)
            seq.constraint = TokenConstraint.build(
                request.constraint, self.prefiller.tokenizer, vocab_size, end_ids
            )
        first = choose_first(self._prefill(seq), seq.sampler(), seq.constraint)
        if request.steer_every:
            split = min(request.num_prefix_tokens, len(request.prompt_ids) - 1)
            seq.steering = KeptSetSteering.of(
                request.steer_every, seq.compressed_cache, split, request.compressor
            )
            seq.stats.kept_entries = seq.steering.num_kept_entries
        seq.stats.prefill_s = time.perf_counter() - seq.started_at
        seq.commit([first.token_id], first.logprobs)
        return seq

    def _prefill(self, seq: Sequence) -> torch.Tensor:
        """Fills the caches the mode needs; returns the logits that choose the first token."""
        request, prefill = seq.request, self.prefiller.prefill
        # At least one token follows the prefix, so that its logits choose the first output.
        split = min(request.num_prefix_tokens, len(request.prompt_ids) - 1)
        prefix_ids, suffix = request.prompt_ids[:split], id_tensor(request.prompt_ids[split:])
        capacity = full_kv_capacity(request, self.model_config.max_position_embeddings)
        full, compressed = self.prefixes.caches(prefix_ids, seq.mode, request.compressor, capacity)
        seq.full_cache, seq.compressed_cache = full, compressed
        if seq.mode is DecodeMode.FULL:
            return prefill(suffix, full)
        if seq.mode is DecodeMode.LOSSY:
            # The lossy baseline computes the user turn over its compressed KV, like any
            # compressed-cache server would.
            logits = prefill(suffix, compressed)
        else:
            logits = prefill(suffix, full)
            if self.prefiller.config.draft_kv_source is DraftKVSource.VERIFIER:
                prompt_kv = ExactKV.of(full, split, len(request.prompt_ids), copy=False)
                compressed.append_exact(prompt_kv)
            else:
                prefill(suffix, compressed, num_logits=0)
        request.compressor.update(compressed)
        return logits


def id_tensor(token_ids) -> torch.Tensor:
    """Token ids as the model runner takes them: int64 [T]."""
    return torch.tensor(list(token_ids), dtype=torch.long)
