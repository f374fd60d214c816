"""Warm drafter nodes (serve/workers/warm_node.py): a drafter streams the prefix's full KV into its
host tier, then verifies its own sessions' rounds, and every stream stays the stream full-KV
decoding gives, across the switch and when the node dies during it."""

from __future__ import annotations

import dataclasses
import time

import pytest

from tests.serve_fixtures import CONTEXT, start_server, wait_for
from tests.test_migration import PROMPT, holder_first, kill
from vericache.engine.link import LinkSpec, ThrottledLink
from vericache.errors import DataLossError
from vericache.kv.pool import BufferPool
from vericache.serve.config import CoordinatorConfig
from vericache.serve.workers.turn_cache import TurnCache
from vericache.serve.workers.warm_node import WarmNode

TIER = {"host_tier_bytes": 1 << 30}
VERICACHE = {"mode": "vericache", "max_tokens": 48, "draft_len": 4}


@pytest.fixture
def warm_server(tiny_chat_checkpoint, tmp_path):
    def start(num_drafters: int = 1, scheduling: str = "per-request"):
        server = start_server(
            tiny_chat_checkpoint, tmp_path, num_drafters=num_drafters, drafter_options=TIER,
            config=CoordinatorConfig(worker_wait_s=30, scheduling=scheduling),
        )  # fmt: skip
        started.append(server)
        from vericache.client import Client

        client = Client(server.target, timeout=120, retries=0)
        clients.append(client)
        prefix_id = client.put_prefix(CONTEXT, compressor="snapkv", ratio=4)
        return server, client, prefix_id

    started, clients = [], []
    yield start
    for client in clients:
        client.close()
    for server in started:
        server.stop()


def _warm(server, prefix_id: str) -> bool:
    """Whether a drafter's host tier holds the prefix, and the coordinator knows it."""
    return any(prefix_id in d.warm_prefixes for d in server.coordinator.backend.drafters)


@pytest.mark.parametrize("scheduling", ["per-request", "staggered"])
def test_a_request_on_a_warm_node_never_needs_the_central_verifier(warm_server, scheduling):
    server, client, prefix_id = warm_server(scheduling=scheduling)
    reference = client.generate(PROMPT, prefix_id=prefix_id, mode="full_local", max_tokens=48)
    first = client.generate(PROMPT, prefix_id=prefix_id, **VERICACHE)
    assert first.token_ids == reference.token_ids
    assert wait_for(lambda: _warm(server, prefix_id), timeout_s=30)  # streamed in the background
    (verifier,) = server.coordinator.backend.verifiers
    verified_before = verifier.worker.batching().steps
    warm = client.generate(PROMPT, prefix_id=prefix_id, **VERICACHE)
    assert warm.token_ids == reference.token_ids
    rounds = warm.stats["rounds"]
    assert rounds >= 3 and warm.stats["local_rounds"] == rounds
    assert verifier.worker.batching().steps == verified_before  # not one verification
    assert verifier.worker.num_sessions == 0
    metrics = server.coordinator.metrics
    sample = metrics.registry.get_sample_value
    counted = sample("vericache:local_rounds_total", {"model_name": metrics.model_name})
    assert counted == first.stats["local_rounds"] + rounds
    (drafter,) = server.coordinator.backend.drafters
    labels = {"model_name": metrics.model_name, "worker": drafter.name}
    assert wait_for(lambda: sample("vericache:host_tier_resident_prefixes", labels) == 1)


@pytest.mark.parametrize("scheduling", ["per-request", "staggered", "lockstep"])
def test_a_request_moves_to_its_node_once_warm_and_the_stream_is_unchanged(
    warm_server, monkeypatch, scheduling
):
    # The coordinator learns that the node is warm from a round's drafts, not from a probe. On
    # a staggered or lock-step schedule the request leaves it between two rounds.
    from vericache.serve.workers.handles import DrafterHandle

    unseen = property(lambda handle: frozenset(), lambda handle, value: None)
    monkeypatch.setattr(DrafterHandle, "warm_prefixes", unseen, raising=False)
    server, client, prefix_id = warm_server(scheduling=scheduling)
    reference = client.generate(PROMPT, prefix_id=prefix_id, mode="full_local", max_tokens=48)
    client.generate(PROMPT, prefix_id=prefix_id, mode="vericache", max_tokens=4)
    (drafter,) = server.coordinator.backend.drafters
    assert wait_for(lambda: drafter.worker._warm.is_warm(prefix_id), timeout_s=30)
    (verifier,) = server.coordinator.backend.verifiers
    verified_before = verifier.worker.batching().steps
    moved = client.generate(PROMPT, prefix_id=prefix_id, **VERICACHE)
    assert moved.token_ids == reference.token_ids
    # Its first round tells the coordinator the node is warm; every later one is the node's.
    rounds = moved.stats["rounds"]
    assert rounds >= 3 and moved.stats["local_rounds"] == rounds - 1
    assert verifier.worker.batching().steps - verified_before == 1
    assert verifier.worker.num_sessions == 0


def test_a_later_turn_on_a_warm_node_reuses_the_turn_the_node_kept(warm_server):
    server, client, prefix_id = warm_server()
    client.generate(PROMPT, prefix_id=prefix_id, mode="vericache", max_tokens=4)
    assert wait_for(lambda: _warm(server, prefix_id), timeout_s=30)
    (drafter,) = server.coordinator.backend.drafters
    turn = client.generate(PROMPT, prefix_id=prefix_id, **VERICACHE)
    assert turn.stats["local_rounds"] == turn.stats["rounds"]
    # The node keeps the session's full KV after the prefix as it closes: its prompt and output
    # (in place of the shorter turn before it, of the same prompt).
    longest = len(turn.token_ids)
    assert wait_for(lambda: _longest_kept(drafter.worker._turns) >= longest), "no turn kept"
    second = PROMPT + turn.text + " And which one adds two?"
    reference = client.generate(second, prefix_id=prefix_id, mode="full_local", max_tokens=48)
    later = client.generate(second, prefix_id=prefix_id, **VERICACHE)
    assert later.token_ids == reference.token_ids
    assert later.stats["local_rounds"] == later.stats["rounds"]
    # Without a kept turn, the prefix's KV alone; with it, the first turn's prompt too (as
    # test_turn_cache.py: the reply's text in a new prompt is not its token ids again).
    num_prefix = client.get_prefix(prefix_id).num_tokens
    assert later.stats["cached_tokens"] > num_prefix + 8


def _longest_kept(turns) -> int:
    """The most tokens a turn kept in `turns` (turn_cache.py) holds."""
    kept = [turn for by_id in turns._by_owner.values() for turn in by_id.values()]
    return max((len(turn.token_ids) for turn in kept), default=0)


def test_full_decoding_on_a_warm_node_reads_its_host_tier_and_fetches_nothing(warm_server):
    server, client, prefix_id = warm_server()
    reference = client.generate(PROMPT, prefix_id=prefix_id, mode="full_local", max_tokens=24)
    client.generate(PROMPT, prefix_id=prefix_id, mode="vericache", max_tokens=4)
    assert wait_for(lambda: _warm(server, prefix_id), timeout_s=30)
    got = client.generate(PROMPT, prefix_id=prefix_id, mode="full_remote", max_tokens=24)
    assert got.token_ids == reference.token_ids
    assert got.stats["link_bytes"] == 0
    (drafter,) = server.coordinator.backend.drafters
    assert drafter.worker._prefixes.stats().num_prefixes == 1  # the compressed copy alone


def test_a_full_fetch_lands_in_the_host_tier_and_warms_the_node(warm_server):
    # A full-KV server with a host-memory tier keeps what it fetched: the prefix crosses once.
    server, client, prefix_id = warm_server()
    reference = client.generate(PROMPT, prefix_id=prefix_id, mode="full_local", max_tokens=24)
    first = client.generate(PROMPT, prefix_id=prefix_id, mode="full_remote", max_tokens=24)
    again = client.generate(PROMPT, prefix_id=prefix_id, mode="full_remote", max_tokens=24)
    assert first.token_ids == again.token_ids == reference.token_ids
    assert first.stats["link_bytes"] > 0 and again.stats["link_bytes"] == 0
    (drafter,) = server.coordinator.backend.drafters
    assert drafter.worker._prefixes.stats().num_prefixes == 0  # nothing on the device's copies
    assert wait_for(lambda: _warm(server, prefix_id), timeout_s=30)
    warm = client.generate(PROMPT, prefix_id=prefix_id, **VERICACHE)
    assert warm.stats["local_rounds"] == warm.stats["rounds"]
    assert warm.token_ids[:24] == reference.token_ids


def test_a_steered_request_is_steered_on_its_node_after_the_switch(warm_server, monkeypatch):
    from vericache.compress.steering import KeptSetSteering
    from vericache.serve.workers.handles import DrafterHandle

    unseen = property(lambda handle: frozenset(), lambda handle, value: None)
    monkeypatch.setattr(DrafterHandle, "warm_prefixes", unseen, raising=False)
    server, client, prefix_id = warm_server()
    reference = client.generate(PROMPT, prefix_id=prefix_id, mode="full_local", max_tokens=48)
    client.generate(PROMPT, prefix_id=prefix_id, mode="vericache", max_tokens=4)
    (drafter,) = server.coordinator.backend.drafters
    assert wait_for(lambda: drafter.worker._warm.is_warm(prefix_id), timeout_s=30)
    applied = []  # refreshes planned and applied in one place: the node's, over its host tier
    real_refresh = KeptSetSteering.refresh

    def refresh(self, compressed, full):
        applied.append(real_refresh(self, compressed, full))
        return applied[-1]

    monkeypatch.setattr(KeptSetSteering, "refresh", refresh)
    moved = client.generate(PROMPT, prefix_id=prefix_id, steer_every=1, **VERICACHE)
    assert moved.token_ids == reference.token_ids
    assert moved.stats["local_rounds"] == moved.stats["rounds"] - 1 >= 2
    assert len(applied) >= moved.stats["local_rounds"] - 1


def test_a_seeded_sampled_stream_is_unchanged_across_the_switch(warm_server):
    server, client, prefix_id = warm_server()
    options = {"max_tokens": 40, "temperature": 0.8, "seed": 11, "draft_len": 4}
    client.generate(PROMPT, prefix_id=prefix_id, mode="vericache", max_tokens=4)
    assert wait_for(lambda: _warm(server, prefix_id), timeout_s=30)
    reference = client.generate(PROMPT, prefix_id=prefix_id, mode="full_local", **options)
    warm = client.generate(PROMPT, prefix_id=prefix_id, mode="vericache", **options)
    assert warm.stats["local_rounds"] >= 1
    assert warm.token_ids == reference.token_ids


@pytest.mark.parametrize("method", ["open_local", "local_round"])
def test_a_warm_node_that_dies_moves_its_request_and_the_stream_is_unchanged(warm_server, method):
    server, client, prefix_id = warm_server(num_drafters=2)
    reference = client.generate(PROMPT, prefix_id=prefix_id, mode="full_local", max_tokens=48)
    client.generate(PROMPT, prefix_id=prefix_id, mode="vericache", max_tokens=4)  # warms it
    first, _ = holder_first(server, prefix_id)
    assert wait_for(lambda: first.worker._warm.is_warm(prefix_id), timeout_s=30)
    dying = kill(first, method, at=1 if method == "open_local" else 2)
    got = client.generate(PROMPT, prefix_id=prefix_id, **VERICACHE)
    assert dying.dead
    assert got.token_ids == reference.token_ids


def test_a_background_chunk_waits_for_the_wire_to_fall_idle():
    link = ThrottledLink(LinkSpec(bandwidth=1e6))
    link.schedule(100_000, first=False)  # a foreground transfer: 0.1 s of wire
    started = time.monotonic()
    link.send_blocking(10, background=True)
    assert time.monotonic() - started >= 0.09


class _FailingFetcher:
    def __init__(self):
        self.calls = 0

    def fetch(self, prefix_id, kind, metadata, background, nbytes, timeout_s):
        self.calls += 1
        assert background and timeout_s == 60  # behind every other transfer, and bounded
        raise DataLossError("arrived damaged twice")


def test_a_damaged_stream_leaves_the_node_cold(tiny_checkpoint):
    from vericache.model.loader import load_model
    from vericache.model.runner import ModelRunner
    from vericache.serve.workers.batching import BatchLoop

    loaded = load_model(str(tiny_checkpoint("llama")))
    runner = ModelRunner(loaded.config, loaded.weights)
    loop = BatchLoop(runner, "test")
    try:
        pool = BufferPool(1 << 20)
        node = WarmNode(runner, loop, 1 << 20, pool, 64, timeout_s=60, turns=TurnCache(1 << 20))
        fetcher = _FailingFetcher()
        node.stream("big", 2 << 20, fetcher, ())  # larger than the tier: never streamed
        node.stream("pfx", 1 << 10, fetcher, ())
        assert wait_for(lambda: not node._streaming, timeout_s=10)
        assert fetcher.calls == 1 and not node.is_warm("pfx")
        assert node.open("s", "pfx", (1, 2, 3), 16) is None  # nothing to verify over
    finally:
        loop.stop()


def test_a_node_of_other_arithmetic_never_warms_nor_verifies(warm_server):
    # Batch-invariant kernels give the same bits on one kind of device, not across kinds.
    server, client, prefix_id = warm_server()
    (drafter,) = server.coordinator.backend.drafters
    info = drafter.worker.info
    drafter.worker.info = dataclasses.replace(info, numerics=info.numerics + ":elsewhere")
    (verifier,) = server.coordinator.backend.verifiers
    assert wait_for(lambda: drafter.numerics != verifier.numerics)  # the next probe says so
    reference = client.generate(PROMPT, prefix_id=prefix_id, mode="full_local", max_tokens=48)
    got = client.generate(PROMPT, prefix_id=prefix_id, **VERICACHE)
    assert got.stats["local_rounds"] == 0
    assert got.token_ids == reference.token_ids
    # Nor does it stream the prefix's full KV over the link for nothing.
    assert drafter.worker._warm.tier.stats().num_loads == 0
