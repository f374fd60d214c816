"""The typed worker interface: what the coordinator may ask a verifier or a drafter, and the records
that cross with each call.

`VerifierAPI` and `DrafterAPI` are the protocols the coordinator calls (handles.py implements both,
in this process or over Ray); each method has a namesake on the worker class (`Verifier`,
`Drafter`) taking the same records, so a call can be followed from the gRPC handler to the forward
that serves it. A round makes at most two calls: one `DrafterAPI.draft` (a whole draft, carrying
the exact KV of the previous round's committed tokens) and one `VerifierAPI.verify`. A scheduled
round makes its verifier call before the drafts exist: `DrafterAPI.draft_ahead` hands back the
draft call's answer by reference (`DraftAnswer`), which the verifier waits for itself.

Token lists cross as tuples; KV as `ExactKV` (per layer [n, Hkv, D]). A sampled request's calls
carry its `SequenceSampler` (parameters, seed, prompt and output so far): the noise at a position
comes from (seed, position), so drafter and verifier draw the same wherever they run.
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from vericache.compress.kept_set import KeptSetRefresh
from vericache.engine.link import LinkSpec
from vericache.engine.request import GrammarState, TokenLogprob
from vericache.engine.sampling import SequenceSampler
from vericache.kv.exact import ExactKV
from vericache.kv.shared_prefix import PrefixCacheStats
from vericache.serve.store.catalog import PrefixKey, PrefixRecord, StoredKind
from vericache.sim.profiles import ModelProfile


@dataclass(frozen=True)
class ModelInfo:
    """What the coordinator needs to know about the model the workers serve."""

    model: str
    fingerprint: str
    max_positions: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    full_kv_bytes_per_token: int  # a token's full KV in a cache slot (PrefixRecord.full_kv_bytes)
    # The arithmetic its forwards run: device kind, its model or vector width, and dtype. Two
    # workers give a forward the same bits only where these match (kernels are batch-invariant
    # on one kind of device, not across kinds).
    numerics: str = ""
    # Its shape for the cost model (`mode: auto`'s prior, path_costs.py), and its weights'
    # element size on the device.
    shape: ModelProfile | None = None
    weight_element_size: int = 2
    # The memory its forwards stream weights and KV from: its CPU machine's, or its GPU's. Workers
    # of one memory system slow each other down (a profile's `co_runner_slowdown`): auto prices
    # that. "": not known, shared with none.
    memory_system: str = ""


@dataclass(frozen=True)
class WorkerStartup:
    """Seconds a worker took to start, by stage: what a restarted worker costs before it serves
    again (with its process's start and imports, which the coordinator sees in the whole)."""

    model_s: float  # the weights onto the device (converted once, on a machine's first use)
    kernels_s: float  # the runner and its kernels (loaded; built only where no process has)
    rest_s: float  # the rest of the worker: its store and catalog, buffers, services
    process: str = ""  # which process started: a new one after a restart

    @property
    def total_s(self) -> float:
        return self.model_s + self.kernels_s + self.rest_s


@dataclass(frozen=True)
class VerifierInfo:
    model: ModelInfo
    transfer_address: str  # the KVTransfer service drafters fetch prefixes' KV from
    weights_bytes: int
    slot_bytes: int  # one token of full KV in a cache slot, positions included
    resident_bytes: int  # the budget of full KV kept on the device across sessions
    startup: WorkerStartup
    prefix_cache: PrefixCacheStats  # its shared copies of prefixes' full KV, now
    link: LinkSpec = LinkSpec()  # toward its drafters
    turn_cache_bytes: int = 0  # its finished turns' KV budget, device and host (turn_cache.py)


@dataclass(frozen=True)
class DrafterInfo:
    model: ModelInfo
    startup: WorkerStartup
    prefix_cache: PrefixCacheStats  # its copies of the prefixes' KV it fetched, now
    # The prefixes whose full KV its host tier holds: it verifies their sessions itself.
    warm_prefixes: frozenset[str] = frozenset()
    host_tier: PrefixCacheStats | None = None  # its host tier, where it has one (warm_node.py)
    turn_cache_bytes: int = 0  # its FULL sessions' kept turns' budget, device and host
    # The prefixes whose full KV its device holds (fetched for FULL sessions): a FULL_REMOTE
    # request over one of them fetches nothing.
    full_prefixes: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Traffic:
    """Bytes a call moved over the slow link and from the full-KV store, and the time taken."""

    link_bytes: int = 0
    link_s: float = 0.0
    store_bytes: int = 0
    store_s: float = 0.0
    # Stored data the worker found failing its check (and rebuilt) since its previous report.
    corruptions: tuple[StoredKind, ...] = ()

    def __add__(self, other: Traffic) -> Traffic:
        return Traffic(
            self.link_bytes + other.link_bytes,
            self.link_s + other.link_s,
            self.store_bytes + other.store_bytes,
            self.store_s + other.store_s,
            self.corruptions + other.corruptions,
        )


class DraftRole(str, enum.Enum):
    """What a drafter session does with the KV it fetched."""

    DRAFT = "draft"  # VERICACHE: drafts over the compressed KV
    LOSSY = "lossy"  # LOSSY: decodes alone over the compressed KV
    FULL = "full"  # FULL_REMOTE: decodes alone over the full KV, with the verifier's kernels


# -- sessions ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class OpenVerifier:
    session_id: str
    prompt_ids: tuple[int, ...]  # [num_prompt_tokens]
    prefix_id: str | None  # None: no prefix
    capacity: int  # cache slots to reserve
    for_drafter: bool  # hand the prompt's exact KV after the prefix to a drafter
    sampler: SequenceSampler | None = None  # None: greedy
    grammar: GrammarState | None = None  # a constrained request's grammar and output so far
    # Rounds between refreshes of the drafter's kept set (compress/steering.py); 0: never.
    steer_every: int = 0


@dataclass(frozen=True)
class VerifierOpened:
    first_token: int  # the choice after the prompt
    exact: ExactKV | None  # the prompt's exact KV after the prefix, when for a drafter
    link_delay_s: float  # until `exact` has crossed the link to the drafters
    traffic: Traffic
    forward_s: float = 0.0  # the batch's verification forward, without waiting for loads
    # Prompt tokens after the prefix whose KV a finished turn kept (turn_cache.py): not prefilled.
    reused_tokens: int = 0
    logprobs: tuple[TokenLogprob, ...] = ()  # [1] the first token's, where the request asks


@dataclass(frozen=True)
class OpenDrafter:
    session_id: str
    role: DraftRole
    transfer_address: str  # the verifier's KVTransfer service
    prefix_id: str
    prompt_ids: tuple[int, ...]  # [num_prompt_tokens]
    num_prefix_tokens: int
    capacity: int  # cache slots to reserve
    fetch_grant: str = ""  # the coordinator's permission to fetch this prefix's KV (DrafterHandle)
    sampler: SequenceSampler | None = None  # None: greedy
    # A DRAFT session on a node that could verify it: it may stream the prefix's full KV into
    # the node's host tier, with this permission (DrafterHandle).
    warms_host_tier: bool = False
    host_tier_grant: str = ""
    grammar: GrammarState | None = None  # a constrained request's grammar and output so far


@dataclass(frozen=True)
class DrafterOpened:
    first_token: int | None  # decoding alone (LOSSY, FULL); None when drafting
    traffic: Traffic
    # FULL: prompt tokens after the prefix whose KV a finished turn kept (turn_cache.py).
    reused_tokens: int = 0
    logprobs: tuple[TokenLogprob, ...] = ()  # [1] the first token's, where there is one and asked


@dataclass(frozen=True)
class DraftCall:
    """One round's whole draft."""

    session_id: str
    pending: tuple[int, ...]  # committed tokens the cache has not been fed: [the newest]
    num_drafts: int  # draft up to this many tokens (0: only take in `exact`)
    end_ids: frozenset[int]  # stop drafting after one of these
    exact: ExactKV | None  # the verifier's KV of the tokens committed since the last draft
    sampler: SequenceSampler | None = None  # None: greedy
    # Emulated links only: seconds from sending the call until it reaches the drafter (the
    # link's latency, and the time `exact` takes to cross its bandwidth); 0 on a real network.
    arrives_in_s: float = 0.0
    grammar: GrammarState | None = None  # a constrained request's grammar and output so far
    # The verifier's refresh of the session's kept set, to take in before drafting (where intact
    # and made for the set it holds; else dropped).
    kept_set: KeptSetRefresh | None = None


@dataclass(frozen=True)
class Drafted:
    tokens: tuple[int, ...]  # [<= num_drafts]
    step_s: float  # seconds per draft step this call took, its batch-mates included
    # Rejection coupling only: what each draft was drawn from, for the verifier's test; only the
    # drafted rows cross.
    distributions: torch.Tensor | None = None  # [len(tokens), V] float32
    # The node holds the session's prefix's full KV in its host tier: it can verify the
    # session's rounds itself from the next round on (`DrafterAPI.open_local`).
    is_warm: bool = False
    # The kept set the session drafted over (`KeptSetRefresh.version`; 0: its prefix's own), for
    # the verifier's next refresh; None: not said.
    kept_set_version: int | None = None


@dataclass(frozen=True)
class OpenLocal:
    """Puts a DRAFT session's verification on its warm drafter node: from its start (no central
    verifier at all), or between two rounds. The coordinator asks only a node whose arithmetic
    is the central verifier's (`ModelInfo.numerics`): the node's verifications then give the
    same bits."""

    session_id: str
    history: tuple[int, ...]  # [prompt + committed tokens but the newest]
    exact: ExactKV | None  # the central verifier's KV of the last round's committed tokens
    sampler: SequenceSampler | None = None  # of the token after `history`; None: greedy
    needs_first_token: bool = False  # nothing committed yet: the prompt's prefill chooses it
    grammar: GrammarState | None = None  # a constrained request's grammar and output so far
    # Rounds between refreshes of the session's kept set, now planned and applied on the node
    # from its host tier's full KV (no link bytes); 0: never.
    steer_every: int = 0


@dataclass(frozen=True)
class LocalOpened:
    is_local: bool  # False: the node's host tier no longer holds the prefix; nothing changed
    first_token: int | None = None  # the choice after the prompt, where asked for
    reused_tokens: int = 0  # of the history after the prefix, those a kept turn held
    logprobs: tuple[TokenLogprob, ...] = ()  # [1] the first token's, where there is one and asked


@dataclass(frozen=True)
class LocalRoundCall:
    """One round drafted and verified on the drafter node."""

    session_id: str
    pending: tuple[int, ...]  # [the newest committed token]
    num_drafts: int  # draft up to this many tokens (0: verify `pending` alone)
    end_ids: frozenset[int]
    sampler: SequenceSampler | None = None  # None: greedy
    grammar: GrammarState | None = None  # a constrained request's grammar and output so far


@dataclass(frozen=True)
class LocalRound:
    drafts: tuple[int, ...]  # [<= num_drafts]
    tokens: tuple[int, ...]  # the verification's choice after pending and each accepted draft
    num_accepted: int
    forward_s: float  # the verification forward
    logprobs: tuple[TokenLogprob, ...] = ()  # of its tokens, where the request asks


class DraftAnswer(Protocol):
    """A draft call's answer, by reference: the verifier waits for it on its own side, so the
    drafts need no call of their own to reach it (handles.py: a future in this process, a Ray
    object reference across processes). Raises the draft call's error."""

    def wait(self, timeout_s: float) -> Drafted | None:  # None: not answered yet
        ...


@dataclass(frozen=True)
class DraftInFlight:
    """A draft call made by `DrafterAPI.draft_ahead`: its answer, here and for the verifier."""

    drafted: Awaitable[Drafted]  # for the coordinator
    answer: DraftAnswer  # for the verifier: `VerifyCall.drafts`


@dataclass(frozen=True)
class VerifyCall:
    """One round's verification. A scheduled round makes it as soon as its full KV is to be
    loaded, while the drafter still drafts: it carries the load (`load_first`) and the draft
    call's answer by reference, so a round costs one verifier call, whatever loads it needs."""

    session_id: str
    pending: tuple[int, ...]  # [the newest committed token]
    drafts: tuple[int, ...] | DraftAnswer  # [num_drafts], or the draft call's answer to come
    load_first: bool = False  # bring the full KV onto the device while the drafts come
    sampler: SequenceSampler | None = None  # None: greedy
    grammar: GrammarState | None = None  # a constrained request's grammar and output so far
    # Whether a draft call follows this round, where the coordinator says (only one carries a
    # kept-set refresh): the drafts the next round could make were this one to commit nothing
    # (its budget's and context's), and the request's end ids.
    drafts_after: int | None = None
    end_ids: tuple[int, ...] = ()

    def is_followed_by_drafts(self, committed: Sequence[int]) -> bool:
        """Whether a round with drafts follows this one once it commits `committed` (a stop
        string may end the request too, unseen here)."""
        if self.drafts_after is not None and self.drafts_after - len(committed) < 1:
            return False
        return not any(token in self.end_ids for token in committed)


@dataclass(frozen=True)
class Verified:
    # [1 + num_drafts] the full-KV choice after each fed token; under rejection coupling, the
    # kept drafts and the token after them
    tokens: tuple[int, ...]
    num_accepted: int  # drafts kept: the cache holds pending + these
    exact: ExactKV  # the KV of pending + accepted drafts, for the drafter's next round
    link_delay_s: float  # until `exact` has crossed the link to the drafters
    traffic: Traffic
    forward_s: float = 0.0  # the batch's verification forward, without waiting for loads
    logprobs: tuple[TokenLogprob, ...] = ()  # of its tokens, where the request asks
    # A refresh of the drafter's kept set, for its next round (crosses the link with `exact`).
    kept_set: KeptSetRefresh | None = None


@dataclass(frozen=True)
class DecodeCall:
    """Full-KV or lossy decoding by one worker alone."""

    session_id: str
    pending: tuple[int, ...]  # [the newest committed token]
    max_tokens: int
    end_ids: frozenset[int]  # stop after choosing one of these
    sampler: SequenceSampler | None = None  # None: greedy
    grammar: GrammarState | None = None  # a constrained request's grammar and output so far


@dataclass(frozen=True)
class Decoded:
    tokens: tuple[int, ...]  # [<= max_tokens]
    traffic: Traffic
    logprobs: tuple[TokenLogprob, ...] = ()  # of its tokens, where the request asks


# -- introspection ----------------------------------------------------------------------------


@dataclass(frozen=True)
class BatchingStats:
    steps: int  # forwards the worker's batch loop ran
    max_batch: int  # the most jobs one of them held
    rows: int  # jobs summed over them (rows / steps: the mean batch)
    cpu_s: float  # CPU seconds of those forwards
    exact_cpu_s: float  # ...the full-KV rows' share of them, by tokens fed


@dataclass(frozen=True)
class Residency:
    bytes: int  # full KV resident on the verifier's device now
    peak_bytes: int  # ...and at most so far


# -- the protocols ----------------------------------------------------------------------------


@runtime_checkable
class VerifierAPI(Protocol):
    """The worker beside the full-KV store (serve/workers/verifier.py)."""

    name: str
    active: int  # sessions the coordinator has placed on it
    numerics: str  # its arithmetic, as its last probe said (`ModelInfo.numerics`)

    async def describe(self) -> VerifierInfo: ...
    async def measure_load_bandwidth(self) -> float: ...
    async def prefill_prefix(self, key: PrefixKey) -> None: ...
    async def store_prefix(self, key: PrefixKey) -> Traffic: ...
    async def compress_prefix(self, key: PrefixKey) -> PrefixRecord: ...  # stored already
    async def discard_staged(self, key: PrefixKey) -> bool: ...
    async def get_prefix(self, prefix_id: str) -> PrefixRecord: ...
    async def list_prefixes(self) -> list[PrefixRecord]: ...
    async def delete_prefix(self, prefix_id: str) -> PrefixRecord: ...
    async def open(self, call: OpenVerifier) -> VerifierOpened: ...
    async def verify(self, call: VerifyCall) -> Verified: ...
    async def decode(self, call: DecodeCall) -> Decoded: ...
    async def close_session(self, session_id: str) -> None: ...
    async def batching(self) -> BatchingStats: ...
    async def residency(self) -> Residency: ...
    async def shutdown(self) -> None: ...


@runtime_checkable
class DrafterAPI(Protocol):
    """The worker on a remote GPU, across the slow link (serve/workers/drafter.py)."""

    name: str
    active: int
    numerics: str  # its arithmetic, as its last probe said (`ModelInfo.numerics`)
    warm_prefixes: frozenset[str]  # whose full KV its host tier holds, as its last probe said

    async def describe(self) -> DrafterInfo: ...
    async def time_draft_step(self) -> float: ...
    async def open(self, call: OpenDrafter) -> DrafterOpened: ...
    async def draft(self, call: DraftCall) -> Drafted: ...
    def draft_ahead(self, call: DraftCall) -> DraftInFlight: ...
    async def open_local(self, call: OpenLocal) -> LocalOpened: ...
    async def local_round(self, call: LocalRoundCall) -> LocalRound: ...
    async def decode(self, call: DecodeCall) -> Decoded: ...
    async def close_session(self, session_id: str) -> None: ...
    async def batching(self) -> BatchingStats: ...
    async def shutdown(self) -> None: ...
