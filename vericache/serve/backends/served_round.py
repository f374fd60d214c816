"""One VERICACHE round of a served request verified by a central verifier, the only copy of it:
every schedule (scheduled.py) drives its rounds through this.

A round is two worker calls. The draft call drafts up to x tokens over the compressed KV and
carries, across the slow link, the verifier's exact KV of the tokens committed since the last
draft (`KVHandover`). The verifier call may be made before the drafts exist: they reach the
verifier by reference (`VerifyCall.drafts`), so a schedule can start its load early. The
verification hands back the exact KV of the tokens it commits, which the next round carries.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vericache.compress.kept_set import KeptSetRefresh
from vericache.kv.exact import ExactKV
from vericache.serve.workers.worker_api import (
    DraftAnswer,
    DraftCall,
    Drafted,
    DrafterAPI,
    DraftInFlight,
    Traffic,
    Verified,
    VerifierAPI,
    VerifierOpened,
    VerifyCall,
)

if TYPE_CHECKING:
    from vericache.serve.backends.rounds import ServedRequest


@dataclass(frozen=True)
class KVHandover:
    """The verifier's exact KV of the tokens it committed since the drafter's last draft, and its
    refresh of the drafter's kept set where one is due, for the next draft call; on an emulated
    link they have crossed the link's bandwidth `link_delay_s` after the verification answered."""

    exact: ExactKV | None = None
    link_delay_s: float = 0.0
    kept_set: KeptSetRefresh | None = None

    @classmethod
    def of(cls, answer: VerifierOpened | Verified) -> KVHandover:
        kept_set = answer.kept_set if isinstance(answer, Verified) else None
        return cls(answer.exact, answer.link_delay_s, kept_set)


@dataclass
class KeptSetRefreshes:
    """A steered request's refreshes of its drafter's kept set (compress/steering.py): those its
    drafter took in, and those lost on the way (damaged, or made for another set: dropped)."""

    taken: int = 0
    dropped: int = 0

    def count(self, taken: bool) -> None:
        if taken:
            self.taken += 1
        else:
            self.dropped += 1


@dataclass
class ServedRound:
    """A begun round: its draft call in flight, its verifier call still to make."""

    served: ServedRequest
    drafting: asyncio.Task[Drafted] | None  # None: no drafts (the budget leaves one token)
    drafts: tuple[int, ...] | DraftAnswer  # the draft call's answer, for the verifier
    kept_set_sent: int | None = None  # the version of the kept-set refresh its call carries

    @classmethod
    def begin(
        cls,
        served: ServedRequest,
        drafter: DrafterAPI,
        max_drafts: int,
        observe_step: Callable[[float], None] | None = None,
    ) -> ServedRound:
        """Begins a round of up to `max_drafts` drafts (within the budget and the context) with
        its draft call, which carries the request's `KVHandover`; `observe_step` is told the
        seconds per draft step the call took."""
        num_drafts = served.seq.begin_round(max_drafts)
        handover, served.handover = served.handover, KVHandover()
        if num_drafts == 0:
            return cls(served, None, ())
        served.num_round_calls += 1
        in_flight = drafter.draft_ahead(_draft_call(served, num_drafts, handover))
        drafting = asyncio.ensure_future(_drafted(in_flight, observe_step))
        sent = handover.kept_set.version if handover.kept_set is not None else None
        return cls(served, drafting, in_flight.answer, sent)

    async def verify(self, verifier: VerifierAPI, load_first: bool = False) -> Verified:
        """The round's verifier call, made while its draft call may still run; sets the round's
        drafts. Where the draft call failed, raises its error, not the verification's (which
        failed waiting for it)."""
        served, drafting = self.served, self.drafting
        seq = served.seq
        call = VerifyCall(
            served.session_id, served.pending, self.drafts, load_first, seq.sampler(),
            served.grammar, seq.drafts_wanted(seq.num_remaining), tuple(served.end_ids),
        )  # fmt: skip
        served.num_round_calls += 1
        try:
            verified = await verifier.verify(call)
        except asyncio.CancelledError:
            self.cancel()
            raise
        except Exception:
            if drafting is not None:
                await drafting  # raises the draft call's error, if it failed
            raise
        if drafting is not None:
            drafted = await drafting
            served.seq.draft_ids = list(drafted.tokens)
            served.drafter_is_warm = drafted.is_warm
            if self.kept_set_sent is not None:  # the drafts say which kept set they read
                served.kept_set_refreshes.count(drafted.kept_set_version == self.kept_set_sent)
        return verified

    def finish(self, verified: Verified) -> list[int]:
        """Commits the verified round; its exact KV is the next round's hand-over."""
        self.served.handover = KVHandover.of(verified)
        return self.served.finish_round(verified)

    def cancel(self) -> None:
        """Drops its draft call (its error, if any, included): no one will wait for it."""
        if self.drafting is not None:
            self.drafting.cancel()
            self.drafting.add_done_callback(lambda t: t.cancelled() or t.exception())


async def _drafted(
    in_flight: DraftInFlight, observe_step: Callable[[float], None] | None
) -> Drafted:
    drafted = await in_flight.drafted
    if observe_step is not None and drafted.step_s > 0:
        observe_step(drafted.step_s)
    return drafted


def _draft_call(served: ServedRequest, num_drafts: int, handover: KVHandover) -> DraftCall:
    """A round's draft call; on an emulated link it reaches the drafter once the hand-over has
    crossed the link's bandwidth, which the request's traffic counts."""
    if handover.link_delay_s > 0:
        served.add(Traffic(link_s=handover.link_delay_s))
    return DraftCall(
        served.session_id, served.pending, num_drafts, served.end_ids, handover.exact,
        sampler=served.seq.sampler(), arrives_in_s=handover.link_delay_s, grammar=served.grammar,
        kept_set=handover.kept_set,
    )  # fmt: skip
