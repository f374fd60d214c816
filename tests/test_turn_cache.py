"""A worker's finished turns (serve/workers/turn_cache.py): a later request repeating one reuses its
KV, prefills only what follows, and gets the tokens full-KV decoding gives without it."""

from __future__ import annotations

import pytest
import torch

from tests.serve_fixtures import CONTEXT, start_server, wait_for
from vericache.errors import CacheStateError
from vericache.kv.exact import ExactKV
from vericache.serve.workers.turn_cache import TurnCache

LAYERS, HEADS, DIM = 2, 2, 4


def _kv(num_tokens: int, start: int = 10) -> ExactKV:
    keys = tuple(torch.randn(num_tokens, HEADS, DIM) for _ in range(LAYERS))
    return ExactKV(start, keys, tuple(k + 1 for k in keys))


def test_a_prompt_takes_the_longest_run_a_kept_turn_shares_short_of_its_last_token():
    turns = TurnCache(1 << 20)
    kept = _kv(6)
    turns.keep("owner", (1, 2, 3, 4, 5, 6), kept)
    turns.keep("owner", (1, 9), _kv(2))
    run = turns.match("owner", (1, 2, 3, 4, 8, 8))
    assert run.num_tokens == 4 and run.start == kept.start
    assert torch.equal(run.keys[0], kept.keys[0][:4])
    # The whole turn repeated: its last token is left to prefill, whose logits choose the next.
    assert turns.match("owner", (1, 2, 3, 4, 5, 6)).num_tokens == 5
    assert turns.match("owner", (2, 2, 3)) is None  # no shared first token
    assert turns.match("another tenant", (1, 2, 3, 4, 8)) is None


def test_a_turn_replaces_those_it_extends_and_the_budget_drops_the_least_recent():
    one_turn = _kv(4).nbytes
    turns = TurnCache(2 * one_turn)
    turns.keep("owner", (1, 2), _kv(2))
    turns.keep("owner", (1, 2, 3, 4), _kv(4))  # the next turn of the same session
    assert len(turns) == 1 and turns.nbytes == one_turn
    turns.keep("owner", (5, 6, 7, 8), _kv(4))
    turns.match("owner", (1, 2, 3, 9))  # used: now the most recent
    turns.keep("owner", (9, 9, 9, 9), _kv(4))
    assert len(turns) == 2 and turns.nbytes <= 2 * one_turn
    assert turns.match("owner", (5, 6, 7, 9)) is None  # the least recently used went
    assert turns.match("owner", (1, 2, 3, 9)).num_tokens == 3
    with pytest.raises(CacheStateError):
        turns.keep("owner", (1, 2, 3), _kv(2))
    TurnCache(one_turn - 1).keep("owner", (1, 2, 3, 4), _kv(4))  # larger than the budget: not kept


def test_turns_the_device_budget_pushes_out_wait_in_host_memory_until_its_budget_is_spent():
    one_turn = _kv(4).nbytes
    turns = TurnCache(one_turn, host_bytes=2 * one_turn)
    for first in (1, 2, 3, 4):  # four sessions' turns: one on the device, two in host memory
        turns.keep("owner", (first, 0, 0, 0), _kv(4))
    assert len(turns) == 3 and turns.nbytes == 3 * one_turn
    assert turns.match("owner", (1, 0, 0, 9)) is None  # the oldest went
    spilled = turns.match("owner", (2, 0, 0, 9))
    assert spilled.num_tokens == 3 and spilled.keys[0].device.type == "cpu"
    assert turns.reusable("owner", (4, 0, 0, 9)) == 3


@pytest.mark.parametrize("mode", ["full_local", "vericache", "full_remote"])
def test_a_later_turn_reuses_its_worker_s_kv_and_decodes_what_full_kv_gives(
    tiny_chat_checkpoint, tmp_path, mode
):
    from vericache.client import Client

    first = "Which function multiplies by three?"
    outputs = {}
    for turn_cache_bytes in (1 << 28, 0):
        root = tmp_path / str(turn_cache_bytes)
        budget = {"turn_cache_bytes": turn_cache_bytes}
        with start_server(
            tiny_chat_checkpoint, root, num_drafters=1, drafter_options=budget, **budget
        ) as server:
            with Client(server.target, timeout=120) as client:
                prefix_id = client.put_prefix(CONTEXT, compressor="snapkv", ratio=4)
                num_prefix = client.get_prefix(prefix_id).num_tokens
                turn = client.generate(first, prefix_id=prefix_id, mode=mode, max_tokens=16)
                if turn_cache_bytes:  # its worker keeps it as its session closes
                    assert wait_for(lambda: _kept_turns(server, mode) == 1), "no turn kept"
                second = first + turn.text + " And which one adds two?"
                later = client.generate(second, prefix_id=prefix_id, mode=mode, max_tokens=16)
                outputs[turn_cache_bytes] = (later.token_ids, later.stats["cached_tokens"])
    (kept_tokens, kept_cached), (fresh_tokens, fresh_cached) = outputs[1 << 28], outputs[0]
    assert kept_tokens == fresh_tokens
    assert fresh_cached == num_prefix  # the prefix's KV alone
    assert kept_cached > num_prefix + 8  # and the first turn's prompt and output after it


def _kept_turns(server, mode: str) -> int:
    """The turns the worker that decodes `mode`'s full KV keeps (in-process workers)."""
    backend = server.coordinator.backend
    handle = backend.drafters[0] if mode == "full_remote" else backend.verifiers[0]
    return len(handle.worker._turns)


def test_the_coordinator_prices_a_later_turn_where_its_kv_was_kept(tiny_chat_checkpoint, tmp_path):
    from vericache.client import Client
    from vericache.scheduler.path_choice import ServingPath

    first = "Which function multiplies by three?"
    with start_server(tiny_chat_checkpoint, tmp_path, num_drafters=1) as server:
        with Client(server.target, timeout=120) as client:
            prefix_id = client.put_prefix(CONTEXT, compressor="snapkv", ratio=4)
            turn = client.generate(first, prefix_id=prefix_id, mode="full_remote", max_tokens=8)
        backend = server.coordinator.backend
        (kept,) = backend.drafters[0].turns._by_owner[prefix_id].values()
        # The next turn's prompt after the prefix: the one before, its output, and more.
        reused = {
            option.path: option.reused
            for option in backend.path_options(prefix_id, kept.token_ids + (5, 6, 7))
        }
    # Its prompt after the prefix and its output but the newest token, whose KV was not computed.
    assert len(kept.token_ids) == turn.stats["prompt_tokens"] - turn.stats["cached_tokens"] + 7
    assert reused[ServingPath.FULL_REMOTE] == len(kept.token_ids)  # the drafter kept it
    assert reused[ServingPath.FULL_LOCAL] == 0 and reused[ServingPath.VERICACHE] == 0
