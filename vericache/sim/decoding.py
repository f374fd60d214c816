"""A simulated request's tokens, decoded by the engine's own round.

The simulator makes no token decision of its own: every request it serves is an engine `Sequence`
(engine/sequence.py), the one implementation of a round that the engine, the long-context engine
and the coordinator all drive. So a round drafts what `begin_round` allows within the token budget
and the model's context, a verification commits what `finish_round` commits, and a full-KV decode
step what `commit_decoded` commits, through the same stop checks.

The tokens are stand-ins. Every draft is DRAFT; the verifier agrees with the first `accepted` of
them (what a recorded round accepted) and then chooses OTHER. Neither is an end token (there is no
EOS), so a request ends at its drawn output length or at the model's context.

Two choices keep a simulated request small, and neither changes a round:
- The prompt is one token, and the context limit moves down by the rest of the prompt: the room
  left, the only way a prompt's length enters a round, is the same, and no request holds a list of
  a 100k-token prompt.
- The engine's request is in full mode. Its mode only tells an engine which caches to feed (the
  simulator charges the forwards itself), and a vericache request carries a compressor object,
  which a scenario describes by its bytes instead.
"""

from __future__ import annotations

from vericache.engine.request import DecodeMode, Request, SamplingParams
from vericache.engine.sequence import RoundOutcome, Sequence
from vericache.errors import InvalidRequestError

DRAFT, OTHER = 1, 2  # stand-in tokens: a draft, and the verifier's choice where it differs


class SimSequence:
    def __init__(self, prompt_tokens: int, max_new_tokens: int, max_positions: int):
        if prompt_tokens >= max_positions:
            raise InvalidRequestError(
                f"a prompt of {prompt_tokens} tokens leaves no room in the model's context of "
                f"{max_positions}"
            )
        request = Request((OTHER,), params=SamplingParams(max_new_tokens), mode=DecodeMode.FULL)
        self.seq = Sequence.start(request, (), max_positions - prompt_tokens + 1)
        # Output tokens it may emit in all (the budget, within the context): what its KV is
        # sized for, from its open to its end.
        self.max_output_tokens = self.num_left

    @property
    def is_finished(self) -> bool:
        return self.seq.is_finished

    @property
    def num_output_tokens(self) -> int:
        return self.seq.stats.num_output_tokens

    @property
    def num_left(self) -> int:
        """Output tokens it may still emit, within the budget and the context."""
        return max(0, min(self.seq.num_remaining, self.seq.room))

    @property
    def num_drafts(self) -> int:
        """Drafts of the round in progress."""
        return len(self.seq.draft_ids)

    @property
    def is_in_round(self) -> bool:
        return self.seq.num_drafts is not None

    def first_token(self) -> int:
        """The prefill's token; returns how many were committed (1)."""
        return len(self.seq.commit([OTHER]))

    def begin_round(self, draft_len: int) -> int:
        """Drafts wanted this round (`Sequence.begin_round`)."""
        return self.seq.begin_round(draft_len)

    def drafts_wanted(self, draft_len: int) -> int:
        return self.seq.drafts_wanted(draft_len)

    @property
    def wants_draft_step(self) -> bool:
        return self.seq.wants_draft_step

    def draft_step(self) -> None:
        self.seq.draft_ids.append(DRAFT)

    def verify(self, accepted: int) -> RoundOutcome:
        """Commits the round in progress, the verifier agreeing with its first `accepted` drafts."""
        num_drafts = self.num_drafts
        if not 0 <= accepted <= num_drafts:
            raise InvalidRequestError(f"{accepted} accepted of {num_drafts} drafts")
        verified = [DRAFT] * accepted + [OTHER] * (num_drafts + 1 - accepted)
        return self.seq.finish_round(verified)

    def decode_target(self, max_tokens: int) -> int:
        return self.seq.decode_target(max_tokens)

    def decode_step(self) -> int:
        """One full-KV decode step; returns the tokens committed (0 or 1)."""
        return len(self.seq.commit_decoded([OTHER]))
