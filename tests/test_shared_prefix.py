"""One copy of each prefix per worker (kv/shared_prefix.py): loaded once however many sessions
open it at once, pinned while they hold it, evicted least recently used within the budget, and a
deleted prefix kept for its sessions until the last one leaves."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import pytest

from vericache.kv.shared_prefix import PrefixBudgetError, SharedPrefixes

PROMPT = "Which function multiplies by three?"


@dataclass
class Cache:
    nbytes: int


class Loader:
    def __init__(self, nbytes: int = 100, delay_s: float = 0.0):
        self.nbytes, self.delay_s, self.calls = nbytes, delay_s, 0

    def __call__(self) -> Cache:
        self.calls += 1
        time.sleep(self.delay_s)
        return Cache(self.nbytes)


def test_sessions_share_one_load_and_pin_it_while_they_hold_it():
    prefixes, load = SharedPrefixes(budget_bytes=250), Loader()
    first = prefixes.acquire("a", load)
    second = prefixes.acquire("a", load)
    assert first is second and load.calls == 1
    assert prefixes.stats().sessions_per_prefix == (2,)
    prefixes.release(first)
    prefixes.release(second)
    assert prefixes.stats().sessions_per_prefix == (0,)  # kept, unpinned
    assert prefixes.acquire("a", load) is first and load.calls == 1


def test_a_held_copy_is_pinned_without_a_load_and_none_is_loaded_for_a_missing_one():
    prefixes = SharedPrefixes(budget_bytes=250)
    assert prefixes.acquire_held("a") is None and not prefixes.holds("a")
    loaded = prefixes.acquire("a", Loader())
    prefixes.release(loaded)
    assert prefixes.holds("a") and prefixes.keys() == ["a"]
    held = prefixes.acquire_held("a")
    assert held is loaded and held.num_sessions == 1
    prefixes.release(held)
    prefixes.retire("a")
    assert prefixes.acquire_held("a") is None and prefixes.keys() == []


def test_sessions_opened_at_once_wait_for_one_load():
    prefixes, load = SharedPrefixes(budget_bytes=250), Loader(delay_s=0.2)
    held = []
    threads = [
        threading.Thread(target=lambda: held.append(prefixes.acquire("a", load))) for _ in range(4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert load.calls == 1 and len({id(h) for h in held}) == 1 and held[0].num_sessions == 4


def test_unpinned_prefixes_make_room_least_recently_used_first():
    prefixes = SharedPrefixes(budget_bytes=250)
    loads = {key: Loader() for key in "abc"}
    for key in "ab":
        prefixes.release(prefixes.acquire(key, loads[key]))
    prefixes.release(prefixes.acquire("a", loads["a"]))  # a is now the more recent
    prefixes.release(prefixes.acquire("c", loads["c"]))  # room for c: b goes
    prefixes.acquire("a", loads["a"])
    prefixes.acquire("b", loads["b"])
    assert [load.calls for load in loads.values()] == [1, 2, 1]


def test_where_pins_fill_the_budget_a_prefix_is_loaded_for_its_session_alone():
    prefixes = SharedPrefixes(budget_bytes=250)
    pinned = [prefixes.acquire(key, Loader()) for key in "ab"]
    alone = prefixes.acquire("c", Loader())
    assert not alone.is_shared and prefixes.stats().num_unshared == 1
    assert prefixes.stats().num_prefixes == 2  # c is not held for others
    prefixes.release(alone)
    for held in pinned:
        assert held.num_sessions == 1  # never evicted while pinned


def test_a_prefix_larger_than_the_budget_is_refused_before_it_loads():
    prefixes, load = SharedPrefixes(budget_bytes=250), Loader(nbytes=300)
    with pytest.raises(PrefixBudgetError, match="prefix-cache-bytes"):
        prefixes.acquire("big", load, nbytes=300)
    assert load.calls == 0
    with pytest.raises(PrefixBudgetError):  # its size known only once loaded
        prefixes.acquire("big", load)
    with pytest.raises(ValueError):
        SharedPrefixes(budget_bytes=0)


def test_a_retired_prefix_serves_its_sessions_until_the_last_leaves():
    prefixes, load = SharedPrefixes(budget_bytes=250), Loader()
    held = prefixes.acquire("a", load)
    prefixes.retire("a")
    assert held.num_sessions == 1 and prefixes.stats().num_prefixes == 1
    prefixes.release(held)
    assert prefixes.stats().num_prefixes == 0  # freed with the last release
    assert prefixes.acquire("a", load) is not held and load.calls == 2


def test_a_failed_load_is_tried_again_by_the_next_session():
    prefixes = SharedPrefixes(budget_bytes=250)

    def failing():
        raise OSError("the store is away")

    with pytest.raises(OSError):
        prefixes.acquire("a", failing)
    load = Loader()
    assert prefixes.acquire("a", load).num_sessions == 1 and load.calls == 1


# --- On a served verifier ---------------------------------------------------------------------


def test_requests_at_once_over_one_prefix_read_it_from_the_store_once(
    tiny_chat_checkpoint, tmp_path
):
    import concurrent.futures

    from tests.serve_fixtures import CONTEXT, start_server
    from vericache.client import Client

    prompts = [f"Question {n}: what does the first function do?" for n in range(6)]
    with start_server(tiny_chat_checkpoint, tmp_path, num_drafters=1) as server:
        with Client(server.target, timeout=120) as client:
            prefix_id = client.put_prefix(CONTEXT, compressor="streamingllm", ratio=4)
            full_kv = client.get_prefix(prefix_id).full_kv_bytes
            modes = ["vericache", "full_local", "full_remote"] * 2
            with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
                results = list(
                    pool.map(
                        lambda p, m: client.generate(p, prefix_id=prefix_id, mode=m, max_tokens=8),
                        prompts,
                        modes,
                    )
                )
        assert sum(r.stats["store_bytes"] for r in results) == full_kv  # one prefix, not six
        stats = server.coordinator.backend.verifiers[0].worker._prefix_copies.stats()
        assert (
            stats.num_loads == 1 and stats.num_prefixes == 1 and stats.sessions_per_prefix == (0,)
        )


def test_a_prefix_larger_than_the_verifier_s_prefix_cache_is_resource_exhausted(
    tiny_chat_checkpoint, tmp_path
):
    from tests.serve_fixtures import CONTEXT, start_server
    from vericache.client import Client, ServerBusyError

    with start_server(
        tiny_chat_checkpoint, tmp_path, num_drafters=1, prefix_cache_bytes=4096
    ) as server:
        with Client(server.target, timeout=120, retries=0) as client:
            prefix_id = client.put_prefix(CONTEXT, compressor="streamingllm", ratio=4)
            with pytest.raises(ServerBusyError, match="prefix-cache-bytes"):
                client.generate(PROMPT, prefix_id=prefix_id, mode="full_local", max_tokens=4)
            # The server goes on: a request without the prefix is served.
            assert client.generate(PROMPT, mode="full_local", max_tokens=4).token_ids


def test_a_prefix_deleted_while_a_request_streams_serves_it_to_the_end(
    tiny_chat_checkpoint, tmp_path
):
    from tests.serve_fixtures import CONTEXT, start_server
    from vericache.client import Client, PrefixNotFoundError

    with start_server(tiny_chat_checkpoint, tmp_path, num_drafters=1) as server:
        with Client(server.target, timeout=120) as client:
            prefix_id = client.put_prefix(CONTEXT, compressor="streamingllm", ratio=4)
            reference = client.generate(
                PROMPT, prefix_id=prefix_id, mode="full_local", max_tokens=24
            )
            with client.stream(
                PROMPT, prefix_id=prefix_id, mode="vericache", max_tokens=24, draft_len=2
            ) as stream:
                text = next(iter(stream))
                assert client.delete_prefix(prefix_id)
                text += "".join(stream)
                result = stream.result()
            assert result.token_ids == reference.token_ids and text == reference.text
            with pytest.raises(PrefixNotFoundError):
                client.generate(PROMPT, prefix_id=prefix_id, max_tokens=2)
        verifier = server.coordinator.backend.verifiers[0].worker
        assert verifier._prefix_copies.stats().num_prefixes == 0  # freed with its last session


def test_a_worker_on_cpu_holds_prefixes_in_a_quarter_of_its_ram_by_default():
    from vericache.engine.device_memory import device_memory_bytes, prefix_budget_left
    from vericache.serve.config import DrafterConfig, VerifierConfig

    assert VerifierConfig().prefix_cache_bytes is None and DrafterConfig().kv_cache_bytes is None
    assert prefix_budget_left("cpu", reserved_bytes=1 << 30) == device_memory_bytes("cpu") // 4
