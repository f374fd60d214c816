"""The block-hash index of automatic prefix caching: the longest registered prefix leading a prompt,
whatever its length against the block size, only among the tenant's own, and never the whole
prompt; and the automatic prefixes the server registers itself, which a restart takes back."""

from __future__ import annotations

import asyncio
import dataclasses

from vericache.compress import build_compressor
from vericache.serve.backends.metrics import ServeMetrics
from vericache.serve.config import CoordinatorConfig
from vericache.serve.front.auth import PrefixQuotaError, Tenant
from vericache.serve.front.auto_prefix import (
    BLOCK_TOKENS,
    AutoPrefixCache,
    PrefixIndex,
    PrefixWish,
    block_digests,
)
from vericache.serve.store.catalog import PrefixKey, PrefixRecord, is_owned_by


def record(prefix_id: str, token_ids, tenant: str = "a") -> PrefixRecord:
    return PrefixRecord(
        prefix_id, tuple(token_ids), True, {"name": "x", "params": {}}, 0, 0, tenant
    )


PROMPT = tuple(range(100, 100 + 5 * BLOCK_TOKENS + 7))


def test_the_longest_leading_prefix_is_found_at_any_length():
    index = PrefixIndex()
    lengths = [3, BLOCK_TOKENS, 2 * BLOCK_TOKENS + 5, 4 * BLOCK_TOKENS]
    for length in lengths:
        index.add(record(f"p{length}", PROMPT[:length]))
    index.add(record("other", (1, 2, 3) + PROMPT[3 : 5 * BLOCK_TOKENS]))  # differs at the start
    assert index.longest_match("a", PROMPT).prefix_id == f"p{4 * BLOCK_TOKENS}"
    assert (
        index.longest_match("a", PROMPT[: 3 * BLOCK_TOKENS]).prefix_id == f"p{2 * BLOCK_TOKENS + 5}"
    )
    assert index.longest_match("a", PROMPT[:10]).prefix_id == "p3"
    assert index.longest_match("a", (7,) + PROMPT) is None


def test_a_prefix_must_leave_a_token_after_it():
    index = PrefixIndex()
    index.add(record("whole", PROMPT[:BLOCK_TOKENS]))
    assert index.longest_match("a", PROMPT[:BLOCK_TOKENS]) is None
    assert index.longest_match("a", PROMPT[: BLOCK_TOKENS + 1]).prefix_id == "whole"


def test_a_tail_that_differs_in_its_last_token_does_not_match():
    index = PrefixIndex()
    index.add(record("p", PROMPT[: BLOCK_TOKENS + 4]))
    changed = PROMPT[: BLOCK_TOKENS + 3] + (1,) + PROMPT[BLOCK_TOKENS + 4 :]
    assert index.longest_match("a", changed) is None


def test_only_the_tenants_own_prefixes_match_and_removed_ones_no_more():
    index = PrefixIndex()
    index.add(record("of-b", PROMPT[:40], tenant="b"))
    assert index.longest_match("a", PROMPT) is None
    assert index.longest_match("b", PROMPT).prefix_id == "of-b"
    index.remove("of-b")
    index.remove("of-b")  # twice: nothing happens
    assert index.longest_match("b", PROMPT) is None


def test_block_digests_chain_over_full_blocks():
    digests = block_digests(PROMPT)
    assert len(digests) == len(PROMPT) // BLOCK_TOKENS + 1
    changed = (0,) + PROMPT[1:]
    assert all(a != b for a, b in zip(block_digests(changed)[1:], digests[1:]))


def test_a_lookup_does_the_same_work_whatever_other_tenants_registered(monkeypatch):
    """Another tenant's prefix cannot show in a lookup's timing: the lookup hashes the same
    blocks and reads the same entries whether or not another tenant registered its prompt."""
    from vericache.serve.front import auto_prefix

    hashed, real_digest = [], auto_prefix._digest
    monkeypatch.setattr(auto_prefix, "_digest", lambda *a: hashed.append(a) or real_digest(*a))
    index = PrefixIndex()
    index.add(record("of-a", PROMPT[:20], tenant="a"))
    index.add(record("of-a-too", (7,) * 40, tenant="a"))

    def lookup() -> tuple[list, dict, PrefixRecord | None]:
        hashed.clear()
        found = index.longest_match("a", PROMPT)
        return list(hashed), dict(index._by_tenant["a"]), found

    alone = lookup()
    index.add(record("of-b", PROMPT[: 3 * BLOCK_TOKENS + 2], tenant="b"))  # what A looks up
    index.add(record("of-b-too", PROMPT[:20], tenant="b"))
    assert lookup() == alone
    assert alone[2].prefix_id == "of-a"


def test_of_two_prefixes_as_long_a_clients_is_found_before_an_automatic_one():
    index = PrefixIndex()
    automatic = dataclasses.replace(record("auto", PROMPT[:40]), automatic=True)
    index.add(automatic)
    assert index.longest_match("a", PROMPT).prefix_id == "auto"
    index.add(record("client", PROMPT[:40]))
    assert index.longest_match("a", PROMPT).prefix_id == "client"
    index.add(dataclasses.replace(record("auto-longer", PROMPT[:41]), automatic=True))
    assert index.longest_match("a", PROMPT).prefix_id == "auto-longer"


FINGERPRINT = "model"
SYSTEM = tuple(range(1000, 1040))


def owned_record(token_ids, automatic: bool, tenant: str = "a") -> PrefixRecord:
    """A record whose id is the hash of what it holds, as the catalog writes them."""
    compressor = build_compressor("streamingllm", ratio=4)
    key = PrefixKey(tuple(token_ids), True, compressor, tenant, automatic=automatic)
    return PrefixRecord(
        key.prefix_id(FINGERPRINT), key.token_ids, True, compressor.spec(), 0, 0, tenant, automatic
    )


def test_an_automatic_prefix_has_an_id_of_its_own_and_a_restart_takes_it_back():
    """The same text registered by a client and by the server makes two prefixes; after a
    restart the server's is counted again (and evicted first), the client's never."""
    restored = owned_record(range(1, 41), automatic=True)
    clients = owned_record(range(1, 41), automatic=False)
    assert restored.prefix_id != clients.prefix_id
    assert is_owned_by(restored, FINGERPRINT, "a") and is_owned_by(clients, FINGERPRINT, "a")
    deleted, registered = [], []

    async def register(text, tenant, compressor):
        registered.append(text)
        return "pfx-new"

    async def delete(prefix_id, tenant):
        deleted.append(prefix_id)
        return True

    config = CoordinatorConfig(auto_prefix_min_tokens=20, auto_prefix_max_per_tenant=1)
    cache = AutoPrefixCache(config, ServeMetrics("m"), FINGERPRINT, register, delete)
    cache.restore([restored, clients])
    wish = PrefixWish(PROMPT, ("a system turn", SYSTEM))

    async def twice():
        tenant = Tenant("a", max_concurrent_requests=1)
        assert cache.match(tenant, wish) is None
        assert cache.match(tenant, wish) is None  # the second sighting registers it
        await asyncio.gather(*cache._tasks)

    asyncio.run(twice())
    assert registered == ["a system turn"] and deleted == [restored.prefix_id]


class _Registry:
    """The coordinator's PutPrefix and DeletePrefix as the cache calls them: records what it was
    asked, and refuses the first `quota_refusals` registrations as over the tenant's quota."""

    def __init__(self, quota_refusals: int = 0):
        self.registered: list[str] = []
        self.deleted: list[str] = []
        self.quota_refusals = quota_refusals

    async def register(self, text, tenant, compressor) -> str:
        if self.quota_refusals:
            self.quota_refusals -= 1
            raise PrefixQuotaError("over the tenant's prefix bytes")
        self.registered.append(text)
        return f"pfx-{text}"

    async def delete(self, prefix_id, tenant) -> bool:
        self.deleted.append(prefix_id)
        return True


def _cache(registry: _Registry, max_per_tenant: int, restored: list[PrefixRecord]):
    config = CoordinatorConfig(auto_prefix_min_tokens=20, auto_prefix_max_per_tenant=max_per_tenant)
    cache = AutoPrefixCache(
        config, ServeMetrics("m"), FINGERPRINT, registry.register, registry.delete
    )
    cache.restore(restored)
    return cache


def _sighted_twice(cache: AutoPrefixCache, text: str, tenant: Tenant) -> None:
    """A system turn that matches nothing, sent twice: it registers itself in the background."""
    wish = PrefixWish(tuple(range(5000, 5060)), (text, tuple(range(5000, 5040))))

    async def twice():
        assert cache.match(tenant, wish) is None
        assert cache.match(tenant, wish) is None
        await asyncio.gather(*cache._tasks)

    asyncio.run(twice())


TENANT = Tenant("a", max_concurrent_requests=1)


def test_the_least_recently_used_automatic_prefix_goes_first():
    older = owned_record(range(1, 41), automatic=True)
    newer = owned_record(range(200, 240), automatic=True)
    registry = _Registry()
    cache = _cache(registry, max_per_tenant=2, restored=[older, newer])
    hit = cache.match(TENANT, PrefixWish(older.token_ids + (7, 8), None))
    assert hit.prefix_id == older.prefix_id  # used last now: the newer one is the oldest in use
    _sighted_twice(cache, "a third turn", TENANT)
    assert registry.deleted == [newer.prefix_id]
    assert registry.registered == ["a third turn"]


def test_past_the_prefix_quota_an_automatic_prefix_makes_room_and_a_clients_never_does():
    automatic = owned_record(range(1, 41), automatic=True)
    registry = _Registry(quota_refusals=1)
    cache = _cache(registry, max_per_tenant=4, restored=[automatic])
    _sighted_twice(cache, "over the quota", TENANT)
    assert registry.deleted == [automatic.prefix_id]  # room made, then registered
    assert registry.registered == ["over the quota"]

    clients_only = _Registry(quota_refusals=1)
    cache = _cache(clients_only, max_per_tenant=4, restored=[owned_record(range(1, 41), False)])
    _sighted_twice(cache, "over the quota", TENANT)
    assert clients_only.deleted == [] and clients_only.registered == []  # left as it was
