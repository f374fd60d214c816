"""Placement by prefix (scheduler/placement.py): a prefix's requests meet on one worker, spill to
the least loaded once out of balance by both margins, and a worker's death moves only its own
prefixes."""

from __future__ import annotations

import collections
import dataclasses

import pytest

from vericache.scheduler.placement import (
    DEFAULT_BALANCE,
    Balance,
    Candidate,
    PoolOption,
    choose_pool,
    place,
    ranking,
)

NAMES = [f"drafter-{i}" for i in range(4)]


def candidates(loads: list[int], names: list[str] = NAMES) -> list[Candidate]:
    return [Candidate(name, load) for name, load in zip(names, loads)]


def test_a_prefix_ranks_the_workers_by_their_names_alone():
    order = ranking("pfx-a", NAMES)
    assert sorted(order) == [0, 1, 2, 3]
    assert ranking("pfx-a", NAMES) == order  # deterministic
    shuffled = NAMES[::-1]  # the same workers listed otherwise: the same ranking by name
    assert [shuffled[i] for i in ranking("pfx-a", shuffled)] == [NAMES[i] for i in order]
    firsts = {ranking(f"pfx-{n}", NAMES)[0] for n in range(64)}
    assert firsts == {0, 1, 2, 3}  # prefixes spread over every worker


def test_a_hot_prefix_stays_on_its_holder_within_the_routers_margins():
    # 32 sessions on one prefix and two drafters: 32 over the idle one is within the 64 of the
    # cache-aware routers, so one drafter fetches the prefix once for all of them.
    holder = ranking("pfx-hot", NAMES[:2])[0]
    loads = [0, 0]
    for _ in range(32):
        loads[place("pfx-hot", candidates(loads, NAMES[:2]))] += 1
    assert loads[holder] == 32
    # Past 64 over the idlest (and 1.5x its load, which 0 always is) the 65th spills.
    loads = [0, 0]
    for _ in range(65):
        loads[place("pfx-hot", candidates(loads, NAMES[:2]))] += 1
    assert loads[holder] == 64 and loads[1 - holder] == 1


def test_a_holder_spills_only_past_both_margins():
    balance = Balance(max_excess=4, max_ratio=1.5)
    order = ranking("pfx-warm", NAMES)
    holder = order[0]
    loads = [2, 2, 2, 2]
    loads[holder] = 6  # placed, 7: 5 over the least (past 4), 3.5x it (past 1.5x)
    assert place("pfx-warm", candidates(loads), balance) == order[1]  # least loaded, best ranked
    loads = [10, 10, 10, 10]
    loads[holder] = 14  # placed, 15: 5 over the least, but within 1.5x of it
    assert place("pfx-warm", candidates(loads), balance) == holder
    assert DEFAULT_BALANCE.holds(64, 0) and not DEFAULT_BALANCE.holds(65, 0)
    assert DEFAULT_BALANCE.holds(150, 100) and not DEFAULT_BALANCE.holds(165, 100)


def test_spills_spread_over_the_least_loaded():
    balance = Balance(max_excess=2, max_ratio=1.0)
    holder = ranking("pfx-hot", NAMES)[0]
    loads = [0, 0, 0, 0]
    for _ in range(16):
        loads[place("pfx-hot", candidates(loads), balance)] += 1
    assert loads[holder] == max(loads) <= min(loads) + 2
    assert min(loads) >= 3


def test_a_dead_worker_moves_only_its_own_prefixes():
    keys = [f"pfx-{n}" for n in range(200)]
    before = {key: NAMES[ranking(key, NAMES)[0]] for key in keys}
    alive = [name for name in NAMES if name != "drafter-2"]
    after = {key: alive[ranking(key, alive)[0]] for key in keys}
    moved = [key for key in keys if before[key] != after[key]]
    assert moved and all(before[key] == "drafter-2" for key in moved)
    assert collections.Counter(after.values()).keys() == set(alive)


def test_a_request_without_a_prefix_goes_to_the_least_loaded():
    assert place(None, candidates([3, 1, 1, 2])) == 1
    assert place(None, candidates([0])) == 0
    with pytest.raises(ValueError):
        place("pfx-a", [])


def test_the_server_sends_a_prefix_s_requests_to_the_drafter_that_holds_it(
    tiny_chat_checkpoint, tmp_path
):
    from tests.serve_fixtures import CONTEXT, start_server
    from vericache.client import Client

    with start_server(tiny_chat_checkpoint, tmp_path, num_drafters=2) as server:
        drafters = server.coordinator.backend.drafters
        opened: list[str] = []
        for handle in drafters:
            original = handle.open

            async def recording(call, handle=handle, original=original):
                opened.append(handle.name)
                return await original(call)

            handle.open = recording
        names = [handle.name for handle in drafters]
        with Client(server.target, timeout=120) as client:
            by_holder = {}  # a prefix ranking each drafter first
            for n in range(16):
                text = f"# part {n}\n" + CONTEXT
                prefix_id = client.put_prefix(text, compressor="streamingllm", ratio=4)
                by_holder.setdefault(names[ranking(prefix_id, names)[0]], prefix_id)
                if len(by_holder) == len(names):
                    break
            # Least-busy placement would send every one of these to the idle first drafter.
            holders = sorted(by_holder, reverse=True)
            for holder in holders:
                for mode in ("vericache", "full_remote", "vericache"):
                    prefix_id = by_holder[holder]
                    client.generate("Go on.", prefix_id=prefix_id, mode=mode, max_tokens=2)
        assert opened == [holders[0]] * 3 + [holders[1]] * 3  # each fetched by its holder alone


def test_a_warm_node_ranks_before_the_prefix_s_rendezvous_holder():
    order = ranking("pfx-a", NAMES)
    warm = order[2]
    placed = candidates([0, 0, 0, 0])
    placed[warm] = Candidate(NAMES[warm], 0, is_warm=True)
    assert place("pfx-a", placed) == warm
    # Past the margins it spills as any holder does: to the least loaded, best ranked.
    placed[warm] = Candidate(NAMES[warm], 65, is_warm=True)
    assert place("pfx-a", placed) == order[0]


def test_a_pool_without_the_prefix_takes_a_request_only_where_its_queue_saves_the_fetch():
    held = PoolOption(in_flight=3, tokens_per_s=100.0)  # 4 requests of 50 tokens: 2 s
    lacking = PoolOption(in_flight=0, tokens_per_s=100.0, prefix_ready_s=1.0)  # 1 + 0.5 s
    assert choose_pool([held, lacking], num_tokens=50) == 1
    slow_fetch = dataclasses.replace(lacking, prefix_ready_s=1.6)  # 2.1 s
    assert choose_pool([held, slow_fetch], num_tokens=50) == 0
    faster = PoolOption(in_flight=7, tokens_per_s=400.0)  # 8 x 50 / 400: 1 s
    assert choose_pool([held, faster], num_tokens=50) == 1  # the queue by throughput
    assert choose_pool([held, held], num_tokens=50) == 0  # ties: the first
    with pytest.raises(ValueError):
        choose_pool([], num_tokens=50)
