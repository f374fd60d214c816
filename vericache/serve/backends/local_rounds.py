"""A request's rounds on its warm drafter node (warm_node.py): whether the node may verify it,
the move of its verification there (from its start, or between two rounds), and the rounds that
follow, each one call to the node that drafts and verifies. rounds.py drives them."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from vericache.kv.exact import ExactKV
from vericache.serve.workers.worker_api import (
    DrafterAPI,
    LocalOpened,
    LocalRoundCall,
    OpenLocal,
    VerifierAPI,
)

if TYPE_CHECKING:
    from vericache.serve.backends.rounds import ServedRequest


def may_verify_on(drafter: DrafterAPI, verifier: VerifierAPI, prefix_id: str | None) -> bool:
    """Whether the drafter node holds the prefix's full KV and verifies with the verifier's
    arithmetic (same bits), as their last probes said."""
    return same_arithmetic(drafter, verifier) and prefix_id in drafter.warm_prefixes


def same_arithmetic(drafter: DrafterAPI, verifier: VerifierAPI) -> bool:
    """Whether the drafter node's verifications would give the verifier's bits."""
    return bool(drafter.numerics) and drafter.numerics == verifier.numerics


async def go_local(
    served: ServedRequest,
    verifier: VerifierAPI,
    drafter: DrafterAPI,
    exact: ExactKV | None,
    needs_first_token: bool = False,
) -> LocalOpened | None:
    """Puts the request's verification on its warm drafter node (from its start, or between
    two rounds with the central verifier's last `exact` KV), then lets the central verifier go
    (its session, and its count of the request); None where the node's tier no longer holds
    the prefix, which changes nothing."""
    call = OpenLocal(
        served.session_id, served.history, exact, served.opening_sampler, needs_first_token,
        served.grammar, served.plan.request.steer_every,
    )  # fmt: skip
    local = await drafter.open_local(call)
    if not local.is_local:
        return None
    if needs_first_token:  # it starts here: its prompt's prefill is the node's
        served.reused_tokens = local.reused_tokens
    await verifier.close_session(served.session_id)
    served.release_verifier()
    return local


async def local_rounds(served: ServedRequest, drafter: DrafterAPI) -> AsyncIterator[list[int]]:
    """Rounds drafted and verified on the warm drafter node, one call each."""
    seq = served.seq
    while not seq.is_finished:
        num_drafts = seq.begin_round(seq.request.draft_len)
        served.num_round_calls += 1
        served.num_local_rounds += 1
        call = LocalRoundCall(
            served.session_id, served.pending, num_drafts, served.end_ids, seq.sampler(),
            served.grammar,
        )  # fmt: skip
        done = await drafter.local_round(call)
        seq.draft_ids = list(done.drafts)
        yield served.finish_round(done)
