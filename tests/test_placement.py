"""Placement by prefix (scheduler/placement.py): a prefix's requests meet on one worker, spill to
the least loaded past the load bound, and a worker's death moves only its own prefixes."""

from __future__ import annotations

import collections
import math

import pytest

from vericache.scheduler.placement import LOAD_BOUND, Candidate, load_bound, place, ranking

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


def test_the_requests_of_a_prefix_go_to_its_holder_until_the_bound():
    holder = ranking("pfx-hot", NAMES)[0]
    loads = [0, 0, 0, 0]
    for _ in range(16):
        loads[place("pfx-hot", candidates(loads))] += 1
    # The holder carries the most, within the bound of the mean; the rest spill evenly.
    assert loads[holder] == max(loads) <= math.ceil(LOAD_BOUND * 16 / 4)
    assert min(loads) >= 3


def test_a_prefix_stays_on_its_holder_while_its_load_is_within_the_bound():
    order = ranking("pfx-warm", NAMES)
    holder = order[0]
    loads = [2, 2, 2, 2]
    loads[holder] = 3
    assert load_bound(candidates(loads)) == 4  # ceil(1.25 * 10 / 4)
    assert place("pfx-warm", candidates(loads)) == holder  # it would hold 4
    loads[holder] = 4
    assert load_bound(candidates(loads)) == 4  # ceil(1.25 * 11 / 4): 5 would be past it
    assert place("pfx-warm", candidates(loads)) == order[1]  # the least loaded, best ranked


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
