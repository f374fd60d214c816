"""Requests, their options and their results.

Vocabulary, used everywhere in VeriCache:
- full KV: the exact keys and values of every token; compressed KV: what a compressor keeps.
- round: one draft phase and one verification of a `vericache` request.
- draft tokens: up to `draft_len` (x) tokens proposed with the compressed KV: greedily, or sampled
  with the noise the verifier draws at the same positions (seeded coupling, engine/sampling.py).
- verify: one forward over the full KV of [last committed token + draft tokens], which gives the
  full-KV choice (greedy or sampled) at each of the x + 1 positions.
- accepted tokens: the longest prefix of the draft that matches the verifier's choices.
- correction token: the verifier's choice at the first mismatch; bonus token: its choice after
  the last draft token when all x were accepted. Each round emits accepted + 1 tokens.
- compression ratio: tokens of the prefix over slots kept (token dropping), or 16 / bits.

Names in code:
- `draft_len`: x, the most drafts a round may make (a request's, or what a scheduler chose for
  it); `num_drafts`: the drafts one round makes, at most `draft_len` (fewer near the budget's or
  the context's end).
- `exact` names an `ExactKV` alone: the verifier's keys and values of committed tokens, handed to
  a drafter. Work over the full KV on the batch-invariant kernels is `is_full_kv`.
- a predicate reads as one: `is_done`, `is_sampled`, `is_alive`, or a verb that asks (`needs_`,
  `wants_`, `may_`, `has_`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vericache.errors import InvalidRequestError

if TYPE_CHECKING:  # requests and rounds stay torch-free: the simulator runs them (vericache.sim)
    from vericache.compress import Compressor


class DecodeMode(str, enum.Enum):
    FULL = "full"  # reference: greedy decoding over the full KV
    LOSSY = "lossy"  # greedy decoding over the compressed KV only (what VeriCache replaces)
    VERICACHE = "vericache"  # draft with the compressed KV, verify with the full KV


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 256
    # 0: greedy. Above 0, each token is sampled from the model's distribution after the
    # penalties, temperature and top-k / top-p / min-p masks (vLLM's definitions), with seeded
    # coupling (engine/sampling.py): the output is the sample full-KV decoding gives for `seed`.
    temperature: float = 0.0
    top_k: int = 0  # the k most likely tokens; 0: all
    top_p: float = 1.0  # the fewest most likely tokens whose mass reaches top_p
    min_p: float = 0.0  # drops tokens less likely than min_p times the most likely one
    seed: int | None = None  # None: drawn at random when the request starts, and reported
    repetition_penalty: float = 1.0  # over prompt and output tokens
    presence_penalty: float = 0.0  # once per token present in the output
    # How drafts are checked under sampling: "seeded" (kept when equal to the full-KV sample at
    # their position: the output is full-KV sampling's), or "rejection" (Leviathan et al.: the
    # model's distribution exactly, more drafts kept, but another sample than full-KV decoding).
    coupling: str = "seeded"
    stop: tuple[str, ...] = ()  # stop strings: the text ends before the first one found
    stop_token_ids: tuple[int, ...] = ()  # extra end tokens besides the model's EOS
    ignore_eos: bool = False
    # Report each output token's log-probability and this many of the most likely tokens at its
    # position (`TokenLogprob`; 0: the token's alone); None: none.
    logprobs: int | None = None

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise InvalidRequestError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if any(not s for s in self.stop):
            raise InvalidRequestError("stop strings must not be empty")
        self._check_sampling()

    def _check_sampling(self) -> None:
        checks = [  # (field, whether it holds, what it must be)
            ("temperature", self.temperature >= 0, "must be >= 0 (0: greedy)"),
            ("top_k", self.top_k >= 0, "must be >= 0 (0: no limit)"),
            ("top_p", 0 < self.top_p <= 1, "must lie in (0, 1]"),
            ("min_p", 0 <= self.min_p <= 1, "must lie in [0, 1]"),
            ("repetition_penalty", self.repetition_penalty > 0, "must be > 0"),
            ("presence_penalty", -2 <= self.presence_penalty <= 2, "must lie in [-2, 2]"),
            ("seed", self.seed is None or 0 <= self.seed < 2**64, "must lie in [0, 2**64)"),
            ("coupling", self.coupling in COUPLINGS, f"must be one of {', '.join(COUPLINGS)}"),
            (
                "logprobs",
                self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
                f"must lie in [0, {MAX_LOGPROBS}]",
            ),
        ]
        for name, holds, requirement in checks:
            if not holds:
                raise InvalidRequestError(f"{name} {requirement}, got {getattr(self, name)}")

    @property
    def is_sampled(self) -> bool:
        """Tokens are sampled (temperature > 0), not chosen greedily."""
        return self.temperature > 0

    @property
    def is_rejection_coupled(self) -> bool:
        """Drafts are checked by rejection coupling."""
        return self.is_sampled and self.coupling == "rejection"

    @property
    def is_penalized(self) -> bool:
        """Logits are penalized for the tokens seen (greedy choices included)."""
        return self.repetition_penalty != 1 or self.presence_penalty != 0

    @property
    def needs_sampler(self) -> bool:
        """Its tokens are not a plain argmax of the logits: sampled, penalized, or reported
        with their log-probabilities (engine/sampling.py `SequenceSampler`)."""
        return self.is_sampled or self.is_penalized or self.logprobs is not None


COUPLINGS = ("seeded", "rejection")
MAX_LOGPROBS = 20  # the most alternatives a position reports (OpenAI's bound)
CONSTRAINT_KINDS = ("json_schema", "json_object", "lark", "regex")


@dataclass(frozen=True)
class OutputConstraint:
    """A grammar the output must follow (engine/constraint.py): a JSON schema (its JSON text),
    any JSON object, a Lark grammar or a regular expression."""

    kind: str  # one of CONSTRAINT_KINDS
    spec: str = ""  # the schema, grammar or expression; "" for json_object

    def __post_init__(self):
        if self.kind not in CONSTRAINT_KINDS:
            kinds = ", ".join(CONSTRAINT_KINDS)
            raise InvalidRequestError(
                f"a constraint's kind must be one of {kinds}, got {self.kind!r}"
            )
        if self.kind != "json_object" and not self.spec:
            raise InvalidRequestError(f"a {self.kind} constraint needs its {self.kind}")


@dataclass(frozen=True)
class GrammarState:
    """What a worker call needs to choose under a request's constraint: the grammar, and the
    output committed so far (the worker's grammar state follows it, engine/constraint.py)."""

    constraint: OutputConstraint
    output: tuple[int, ...]


@dataclass(frozen=True)
class TokenLogprob:
    """An output token's log-probability, and the most likely tokens at its position (vLLM's
    processed logprobs): from the logits the token was chosen from, after the grammar mask and
    the penalties, and for a sampled request the temperature and the top-k, top-p and min-p
    masks; a masked token's is -inf. A vericache request's come from its verifier's full-KV
    logits: they equal what full-KV decoding reports, bit for bit."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # [SamplingParams.logprobs] (id, logprob), best first


# Steering's default (`Request.steer_every` None). Measured with SnapKV 8x at x=30, rounds
# verified whole, the same code and tool prompts over their contexts cut to a length (bench/
# README.md, acceptance): steered every round, drafts are accepted 7-10% more over prefixes of
# 3-4k tokens; over ~1k, 25% more on code and 3% fewer on tools (within noise); over ~250, 31% and
# 79% fewer, and over a 40-token system turn 23% fewer: a small kept set has little to gain and
# each refresh swaps what the drafts read. PyramidKV and KVzip, which keep their tokens the same
# way, take the same default.
DEFAULT_STEER_EVERY = 1
STEERED_PREFIX_TOKENS = 1024


@dataclass(frozen=True)
class Request:
    prompt_ids: tuple[int, ...]
    # The first num_prefix_tokens of the prompt form the shared prefix (the context): only they
    # are compressed; the rest (the user turn) is appended after compression.
    num_prefix_tokens: int = 0
    params: SamplingParams = SamplingParams()
    mode: DecodeMode = DecodeMode.VERICACHE
    compressor: Compressor | None = None
    draft_len: int = 30  # draft tokens per round; the longest allowed when adaptive
    request_id: str = ""
    # Choose each round's draft length from this request's acceptance so far and the measured
    # costs of draft steps and verifications (vericache.scheduler.adaptive), up to draft_len.
    adaptive_draft_len: bool = False
    # The output full-KV decoding gives, where it is known already (a benchmark's reference): a
    # round stops drafting after its first draft that differs from it, since no later draft could
    # be accepted. The round commits what it would have drafting on; the drafts it saves are the
    # ones verification would reject. Every round is still verified, so output stays exact.
    expected_ids: tuple[int, ...] | None = None
    # A grammar every output token is chosen under, in every mode (engine/constraint.py).
    constraint: OutputConstraint | None = None
    # Every this many rounds, the token dropper's kept prefix positions are chosen again from the
    # attention the verifications paid them (compress/steering.py); 0: never; None: where steering
    # pays (`default_steer_every`), resolved here.
    steer_every: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "prompt_ids", tuple(self.prompt_ids))  # hashable, immutable
        if self.expected_ids is not None:
            object.__setattr__(self, "expected_ids", tuple(self.expected_ids))
        if not self.prompt_ids:
            raise InvalidRequestError("the prompt is empty")
        if not 0 <= self.num_prefix_tokens <= len(self.prompt_ids):
            raise InvalidRequestError("num_prefix_tokens must lie within the prompt")
        if self.mode is not DecodeMode.FULL and self.compressor is None:
            raise InvalidRequestError(f"mode {self.mode.value!r} needs a compressor")
        if self.draft_len < 1:
            raise InvalidRequestError(f"draft_len must be >= 1, got {self.draft_len}")
        if self.adaptive_draft_len and self.mode is not DecodeMode.VERICACHE:
            raise InvalidRequestError(
                f"adaptive_draft_len applies to mode 'vericache' only, not {self.mode.value!r}"
            )
        if self.steer_every is None:
            object.__setattr__(self, "steer_every", self.default_steer_every())
        elif self.steer_every:
            self._check_steering()

    def default_steer_every(self) -> int:
        """The steering a request that does not choose gets: every round for VeriCache over a token
        dropper that keeps its tokens once (alone, not composed with a quantizer: the compressor's
        `steers_by_default`), where the prefix is long enough to pay; else never."""
        steers = (
            self.mode is DecodeMode.VERICACHE
            and self.compressor.steers_by_default
            and self.num_prefix_tokens >= STEERED_PREFIX_TOKENS
        )
        return DEFAULT_STEER_EVERY if steers else 0

    def _check_steering(self) -> None:
        if self.steer_every < 0:
            raise InvalidRequestError(f"steer_every must be >= 0, got {self.steer_every}")
        if self.mode is not DecodeMode.VERICACHE:
            raise InvalidRequestError(
                f"steer_every applies to mode 'vericache' only, not {self.mode.value!r}"
            )
        compressor = self.compressor
        if not compressor.is_steerable:
            raise InvalidRequestError(
                f"steer_every steers a token dropper that keeps its tokens once (snapkv, "
                f"pyramidkv, kvzip, alone or composed with kivi), not {compressor.name}"
            )


@dataclass
class RequestStats:
    rounds: int = 0  # verifications (vericache) or decode steps (full, lossy)
    drafted_per_round: list[int] = field(default_factory=list)
    accepted_per_round: list[int] = field(default_factory=list)
    num_output_tokens: int = 0
    prefill_s: float = 0.0  # prefill of the prompt, and compression of the prefix
    draft_s: float = 0.0
    verify_s: float = 0.0
    decode_s: float = 0.0  # single-token steps of the full and lossy modes
    total_s: float = 0.0
    # Where the verifier steers the drafter's kept set (compress/steering.py): the set's
    # (layer, head, position) entries, and how many of them each refresh replaced.
    kept_entries: int = 0
    changed_per_refresh: list[int] = field(default_factory=list)

    @property
    def draft_tokens(self) -> int:
        return sum(self.drafted_per_round)

    @property
    def accepted_tokens(self) -> int:
        return sum(self.accepted_per_round)

    @property
    def mean_accepted_per_round(self) -> float:
        return self.accepted_tokens / self.rounds if self.rounds and self.draft_tokens else 0.0

    @property
    def tokens_per_round(self) -> float:
        """Mean tokens a round yields: accepted + the verifier's own token."""
        return (self.accepted_tokens + self.rounds) / self.rounds if self.rounds else 0.0

    @property
    def other_s(self) -> float:
        return max(
            0.0, self.total_s - self.prefill_s - self.draft_s - self.verify_s - self.decode_s
        )

    @property
    def tokens_per_s(self) -> float:
        """Decode throughput: output tokens after the first (which the prefill yields) over the
        time after the prefill."""
        decode_time = self.total_s - self.prefill_s
        return (self.num_output_tokens - 1) / decode_time if decode_time > 0 else 0.0

    def as_dict(self) -> dict:
        return {
            "rounds": self.rounds,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "mean_accepted_per_round": self.mean_accepted_per_round,
            "tokens_per_round": self.tokens_per_round,
            "accepted_per_round": list(self.accepted_per_round),
            "drafted_per_round": list(self.drafted_per_round),
            "kept_entries": self.kept_entries,
            "changed_per_refresh": list(self.changed_per_refresh),
        }

    def timing_dict(self) -> dict:
        return {
            "total_s": self.total_s,
            "tokens_per_s": self.tokens_per_s,
            "prefill_s": self.prefill_s,
            "draft_s": self.draft_s,
            "verify_s": self.verify_s,
            "decode_s": self.decode_s,
            "other_s": self.other_s,
        }


@dataclass
class RequestOutput:
    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]
    text: str | None  # None when the model has no tokenizer
    finish_reason: str  # "stop" (EOS, stop token or stop string) or "length"
    stats: RequestStats
    seed: int | None = None  # the sampling seed used (drawn where the request gave none)
    logprobs: list[TokenLogprob] | None = None  # [len(token_ids)], where the request asked
