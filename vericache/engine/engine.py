"""The decoding engine: full, lossy and vericache modes over one model runner.

Each iteration is one batched forward through the forward loop (forward_loop.py): draft steps of
vericache requests and lossy decode steps over their compressed caches (fast kernels), and
verifications and full decode steps over their full caches (batch-invariant kernels), sharing one
read of the weights. A vericache request drafts for up to `draft_len` iterations (or a length
chosen each round, with `adaptive_draft_len`), then verifies in the next: a round of d drafts takes
d + 1 iterations, as in the long-context engine and the schedulers. Rounds begin and end in
`Sequence` (sequence.py), the one implementation every driver shares.

The engine composes the parts that the long-context engine composes too: a `SequenceStarter`
(prefill.py), which prefills each request here over the prefix store's shared KV
(`SharedPrefixes`, prefix_caches.py), and a `SequenceForward` (sequence_forward.py), which runs
each iteration's forward and commits what it chose. What it adds is its own policy: the draft
length of each round it begins.
"""

from __future__ import annotations

from collections.abc import Iterable

from vericache.compress.base import Compressor
from vericache.compress.context import ModelContext
from vericache.engine.engine_config import DraftKVSource, EngineConfig
from vericache.engine.prefill import Prefiller, SequenceStarter
from vericache.engine.prefix_caches import SharedPrefixes
from vericache.engine.prefix_store import PrefixStore
from vericache.engine.request import DecodeMode, Request, RequestOutput
from vericache.engine.sequence import Sequence
from vericache.engine.sequence_forward import SequenceForward
from vericache.kv.cache import KVCache
from vericache.kv.compressed import CompressedKV
from vericache.model.loader import DEFAULT_MODEL, load_model
from vericache.model.runner import ModelRunner
from vericache.scheduler.adaptive import acceptance_rate, best_draft_len

# The engine's names, with its config (engine_config.py).
__all__ = ["DraftKVSource", "Engine", "EngineConfig"]


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
        prefiller = Prefiller(runner, tokenizer, config)
        self.prefixes = SharedPrefixes(prefiller, self.prefix_store)
        self.starter = SequenceStarter(prefiller, self.prefixes)
        self.forward = SequenceForward(runner, config)

    @classmethod
    def from_pretrained(
        cls, model: str = DEFAULT_MODEL, dtype="float32", device="cpu", config=EngineConfig()
    ) -> Engine:
        loaded = load_model(model, dtype=dtype, device=device)
        runner = ModelRunner(loaded.config, loaded.weights, device, config.static_shapes)
        return cls(runner, loaded.tokenizer, config)

    def generate(self, requests: Iterable[Request]) -> list[RequestOutput]:
        sequences = [self.starter.start(request) for request in requests]
        active = [seq for seq in sequences if not seq.is_finished]
        while active:
            self.step(active)
            active = [seq for seq in active if not seq.is_finished]
        return [seq.output() for seq in sequences]

    def step(self, active: list[Sequence]) -> None:
        """One iteration: one forward over every sequence's next step (a draft step or a
        verification of a vericache round, a full or lossy decode step)."""
        planned = _planned_verify_steps(active)
        for seq in active:
            if seq.mode is DecodeMode.VERICACHE and seq.num_drafts is None:
                num_drafts = seq.begin_round(self._draft_len(seq, planned))
                planned.add(num_drafts)  # this round verifies that many steps from now
        compressed_batch = [seq for seq in active if seq.needs_compressed_forward]
        full_batch = [seq for seq in active if seq.needs_full_forward]
        self.forward.run(compressed_batch, full_batch)

    def _draft_len(self, seq: Sequence, planned: set[int]) -> int:
        """planned: steps from now (0: this one) that already run a full-KV forward."""
        request = seq.request
        if not request.adaptive_draft_len:
            return request.draft_len
        stats = seq.stats
        alpha = acceptance_rate(stats.drafted_per_round, stats.accepted_per_round)
        costs = self.forward.round_costs.round_costs()
        # A round of d drafts verifies d steps from now.
        return best_draft_len(alpha, costs, 1, request.draft_len, planned)

    def compressed_prefix_kv(
        self, prefix_ids: tuple[int, ...], compressor: Compressor
    ) -> CompressedKV:
        """A prefix's KV compressed once per compressor, then reused. Shared: clone it to edit."""
        return self.prefixes.compressed_prefix_kv(prefix_ids, compressor)

    def prefix_kv(self, prefix_ids: tuple[int, ...]) -> KVCache:
        """The full KV of a prefix, prefilled once and then reused. Shared: clone it to edit."""
        return self.prefixes.prefix_kv(prefix_ids)

    def model_context(self, prefix_ids: tuple[int, ...]) -> ModelContext:
        """What a compressor may run on the model while compressing this prefix."""
        return self.prefixes.prefiller.model_context(prefix_ids)


def _planned_verify_steps(active: list[Sequence]) -> set[int]:
    """Steps from now (0: this one) in which a full-KV forward is due: verifications of rounds
    under way, or every step while a full-mode sequence decodes."""
    if any(seq.mode is DecodeMode.FULL for seq in active):
        return set(range(max(seq.request.draft_len for seq in active) + 1))
    return {
        seq.num_drafts - len(seq.draft_ids)
        for seq in active
        if seq.mode is DecodeMode.VERICACHE and seq.num_drafts is not None
    }
