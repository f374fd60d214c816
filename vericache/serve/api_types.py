"""The records the serving front speaks: what an API call becomes, and what its answer is made of.

The gRPC servicer converts vericache.v1 messages to and from these (wire.py, the one module that
does); the coordinator, the rounds, the metrics and the backends see only these records.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from vericache.engine.request import DecodeMode, OutputConstraint, TokenLogprob


class ServeMode(str, enum.Enum):
    """Where and how a served request decodes."""

    VERICACHE = "vericache"  # a remote drafter drafts over compressed KV, the verifier verifies
    FULL_LOCAL = "full_local"  # the verifier decodes over the full KV (the reference)
    FULL_REMOTE = "full_remote"  # a drafter fetches the full KV over the slow link and decodes
    LOSSY = "lossy"  # a drafter decodes over the compressed KV only
    # The coordinator chooses one of the lossless modes per request (auto_path.py); resolved
    # before the request runs, never served as itself.
    AUTO = "auto"

    @property
    def decode_mode(self) -> DecodeMode:
        return _DECODE_MODES[self]

    @property
    def needs_drafter(self) -> bool:
        return self not in (ServeMode.FULL_LOCAL, ServeMode.AUTO)


_DECODE_MODES = {
    ServeMode.AUTO: DecodeMode.VERICACHE,  # until resolved: planned with its compressed KV
    ServeMode.VERICACHE: DecodeMode.VERICACHE,
    ServeMode.FULL_LOCAL: DecodeMode.FULL,
    ServeMode.FULL_REMOTE: DecodeMode.FULL,
    ServeMode.LOSSY: DecodeMode.LOSSY,
}


@dataclass(frozen=True)
class CompressorChoice:
    """A compressor as a caller names it; unset strengths take the compressor's defaults."""

    name: str  # a registry name: `vericache compressors`
    ratio: float | None = None  # token dropping
    bits: int | None = None  # quantization
    dtype: str | None = None  # token dropping's storage: "bfloat16" or "float16"


@dataclass(frozen=True)
class PutPrefixCall:
    """A prefix to register: text (a chat system turn) or token ids (used as they are)."""

    compressor: CompressorChoice
    text: str | None = None
    token_ids: tuple[int, ...] | None = None  # [num_tokens]


@dataclass(frozen=True)
class RegistrationProgress:
    prefix_id: str
    stage: str  # "queued", "prefill", "store", "compress", "done"
    num_tokens: int
    existed: bool = False  # the prefix was registered already: nothing was recomputed

    @property
    def is_done(self) -> bool:
        return self.stage == "done"


@dataclass(frozen=True)
class SamplingChoice:
    """Sampling as a caller asks for it; each field None takes SamplingParams' default (greedy,
    a seed drawn at random, seeded coupling)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    coupling: str | None = None  # "seeded" or "rejection"
    # Report each token's log-probability and this many alternatives (0 to 20); None: none.
    logprobs: int | None = None

    def given(self) -> dict[str, float | int | str]:
        """The fields the caller set, by SamplingParams' names."""
        return {name: value for name, value in vars(self).items() if value is not None}


@dataclass(frozen=True)
class ToolCall:
    """A function call the model made: its id, the function's name and its arguments (JSON)."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class FunctionTool:
    """A function the model may call: its name, what it does and its parameters (JSON schema)."""

    name: str
    description: str | None = None
    parameters: dict | None = None

    def as_openai(self) -> dict:
        """The tool as OpenAI's API and chat templates write it."""
        function: dict = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        if self.parameters is not None:
            function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ChatTurn:
    role: str  # "system", "user", "assistant" or "tool"
    content: str
    tool_calls: tuple[ToolCall, ...] = ()  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn's: the call it answers


@dataclass(frozen=True)
class GenerateCall:
    # The user turn after the prefix's system turn; with `continues_text`, text that continues
    # the prefix's tokens (or starts the sequence) as it is, no chat template (/v1/completions).
    prompt: str
    prefix_id: str | None = None  # None: no prefix
    max_tokens: int | None = None  # None: the server's default
    stop: tuple[str, ...] = ()  # stop strings
    stop_token_ids: tuple[int, ...] = ()  # end tokens besides the model's EOS
    mode: ServeMode | None = None  # None: VERICACHE with a prefix, FULL_LOCAL without
    draft_len: int | None = None  # None: the server's default
    sampling: SamplingChoice = SamplingChoice()
    continues_text: bool = False
    # A whole conversation instead of `prompt` (/v1/chat/completions): its leading system turn,
    # if any, is the prefix's text.
    messages: tuple[ChatTurn, ...] = ()
    # The functions the conversation's model may call: rendered with its system turn, so that
    # the catalogue is part of the prefix (front/tools.py).
    tools: tuple[FunctionTool, ...] = ()
    # The compressor of the prefix to draft over: the named prefix must have been registered
    # with it; without one, only the tenant's prefixes registered with it match, and a system
    # turn that registers itself uses it. None: any prefix; the server's compressor.
    compressor: CompressorChoice | None = None
    # A grammar every output token is chosen under (engine/constraint.py), in every mode: the
    # output is constrained full-KV decoding's. None: free text.
    constraint: OutputConstraint | None = None
    # VERICACHE over a token dropper's prefix: the verifier refreshes the drafter's kept set
    # every this many rounds from the attention its verifications pay (compress/steering.py).
    # 0: never; None: the engine's default, every round over a long enough prefix
    # (engine/request.py `Request.default_steer_every`).
    steer_every: int | None = None


@dataclass(frozen=True)
class OutputChunk:
    text: str  # the text these tokens add (held back while it may still change)
    token_ids: tuple[int, ...]  # [num_new_tokens]
    logprobs: tuple[TokenLogprob, ...] = ()  # [num_new_tokens] where the request asks


@dataclass(frozen=True)
class GenerateSummary:
    """The last event of a Generate stream."""

    finish_reason: str  # "stop", "length"; "cancelled" if the stream was cut
    num_tokens: int
    rounds: int  # verifications (vericache) or decode steps
    accepted_per_round: tuple[int, ...]  # [rounds] for vericache
    link_bytes: int  # sent over the slow link for this request
    store_bytes: int  # loaded from the full-KV store
    link_wait_s: float
    store_wait_s: float
    ttft_s: float
    tokens_per_s: float  # output tokens after the first over the time after it
    total_s: float
    seed: int | None = None  # the sampling seed (the request's, or one drawn); None: greedy
    prompt_tokens: int = 0  # the prompt's, its prefix's included
    local_rounds: int = 0  # of the rounds, those its warm drafter node verified itself
    # Refreshes of its drafter's kept set (`GenerateCall.steer_every`): taken in by the drafter,
    # and lost on the way (dropped: the drafter kept its set).
    kept_set_refreshes: int = 0
    kept_set_refreshes_dropped: int = 0
    path: str = ""  # how it was served (scheduler/path_choice.py ServingPath), chosen or named
    # Prompt tokens whose KV it did not compute: its prefix's, and those a finished turn's kept
    # KV held (serve/workers/turn_cache.py); OpenAI's usage.prompt_tokens_details.cached_tokens.
    cached_tokens: int = 0

    @property
    def mean_accepted_per_round(self) -> float:
        accepted = self.accepted_per_round
        return sum(accepted) / len(accepted) if accepted else 0.0


GenerateEvent = OutputChunk | GenerateSummary
