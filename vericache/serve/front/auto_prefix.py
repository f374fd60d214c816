"""Automatic prefix caching: a request that names no prefix uses the longest one its tenant
registered whose tokens lead its prompt, and system turns seen often enough register themselves.

Matching hashes token blocks as vLLM's automatic prefix caching does: a chain of digests, one per
full block of `BLOCK_TOKENS` tokens, each over the one before and the block's tokens. A prefix is
filed under the digest after its last full block, with the tokens of its partial last block; a
prompt is looked up block by block, at each boundary comparing the few prefixes filed there, so a
lookup costs one digest per block whatever the number of prefixes. Each tenant has an index of its
own: another tenant's prefixes are never matched, and a lookup does the same work, hit or miss,
whatever other tenants registered.

A request may ask for a compressor: then only prefixes registered with it match, and its system
turn registers itself with it.

Registration (`CoordinatorConfig.auto_prefix_min_tokens`): a system turn of at least that many
tokens, seen twice by one tenant without a match (with one compressor asked for, or none), is
registered in the background with that compressor, or `auto_prefix_compressor`: a prefix of its
own (`PrefixRecord.automatic`, hashed into its id), apart from any a client registers with the same
text, and taking none of the tenant's concurrent calls. At most `auto_prefix_max_per_tenant` such
prefixes are kept per tenant; past that, or past the tenant's prefix quota, the least recently
used one is deleted first. Prefixes a client registered are never deleted here. A restarted server
finds its automatic prefixes in their records and goes on counting and evicting them.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from vericache.serve.api_types import CompressorChoice
from vericache.serve.backends.metrics import ServeMetrics
from vericache.serve.config import CoordinatorConfig
from vericache.serve.front.auth import PrefixQuotaError, Tenant
from vericache.serve.store.catalog import PrefixRecord, is_owned_by

log = logging.getLogger(__name__)

BLOCK_TOKENS = 16
_SEEN_LIMIT = 1024  # system turns remembered per tenant while counting sightings


def block_digests(token_ids: tuple[int, ...]) -> list[bytes]:
    """The chain of digests after each full block: [after 0 blocks, after 1, ...]."""
    digests = [b""]
    for start in range(0, len(token_ids) - BLOCK_TOKENS + 1, BLOCK_TOKENS):
        digests.append(_digest(token_ids[start : start + BLOCK_TOKENS], digests[-1]))
    return digests


def _digest(token_ids: tuple[int, ...], before: bytes = b"") -> bytes:
    data = before + b"".join(t.to_bytes(4, "little") for t in token_ids)
    return hashlib.blake2b(data, digest_size=16).digest()


@dataclass(frozen=True)
class PrefixWish:
    """What a request that names no prefix looks one up by."""

    token_ids: tuple[int, ...]  # [prompt_tokens] the whole prompt
    system: tuple[str, tuple[int, ...]] | None  # its system turn (text, token ids), if any
    compressor: CompressorChoice | None = None  # as asked for; None: any
    compressor_spec: dict | None = None  # ...as registered prefixes record it


@dataclass(frozen=True)
class _Filed:
    record: PrefixRecord
    tail: tuple[int, ...]  # the tokens after its last full block


class PrefixIndex:
    """Every tenant's registered prefixes, by the digests of their token blocks."""

    def __init__(self):
        self._by_tenant: dict[str, dict[bytes, list[_Filed]]] = {}
        self._where: dict[str, tuple[str, bytes]] = {}  # prefix id -> (tenant, digest)

    def add(self, record: PrefixRecord) -> None:
        if record.prefix_id in self._where:
            return
        tokens = record.token_ids
        num_full = len(tokens) // BLOCK_TOKENS
        digest = block_digests(tokens[: num_full * BLOCK_TOKENS])[-1]
        filed = _Filed(record, tokens[num_full * BLOCK_TOKENS :])
        self._by_tenant.setdefault(record.tenant, {}).setdefault(digest, []).append(filed)
        self._where[record.prefix_id] = (record.tenant, digest)

    def remove(self, prefix_id: str) -> None:
        where = self._where.pop(prefix_id, None)
        if where is None:
            return
        tenant, digest = where
        shelf = self._by_tenant[tenant]
        shelf[digest] = [f for f in shelf[digest] if f.record.prefix_id != prefix_id]
        if not shelf[digest]:
            del shelf[digest]

    def longest_match(
        self, tenant: str, token_ids: tuple[int, ...], compressor_spec: dict | None = None
    ) -> PrefixRecord | None:
        """The tenant's longest prefix that `token_ids` begin with and go past by one token at
        least (the first output needs a token after the prefix), registered with
        `compressor_spec` if one is given; of two as long, a client's before an automatic one
        (which then ages out)."""
        shelf = self._by_tenant.get(tenant, {})
        best = None
        for num_blocks, digest in enumerate(block_digests(token_ids)):
            start = num_blocks * BLOCK_TOKENS
            for filed in shelf.get(digest, ()):
                if compressor_spec is not None and filed.record.compressor != compressor_spec:
                    continue
                end = start + len(filed.tail)
                if end < len(token_ids) and token_ids[start:end] == filed.tail:
                    rank = (end, not filed.record.automatic)
                    if best is None or rank > (best.num_tokens, not best.automatic):
                        best = filed.record
        return best


class AutoPrefixCache:
    """The coordinator's automatic prefix caching: lookups for requests that name no prefix, and
    registrations of the system turns they repeat. `register(text, tenant, compressor)` registers
    a system turn and returns its prefix id; `delete(prefix_id, tenant)` deletes one (the
    coordinator's own PutPrefix and DeletePrefix, with the tenant's quotas)."""

    def __init__(
        self,
        config: CoordinatorConfig,
        metrics: ServeMetrics,
        fingerprint: str,
        register: Callable[[str, Tenant, CompressorChoice | None], Awaitable[str]],
        delete: Callable[[str, Tenant], Awaitable[bool]],
    ):
        self.config = config
        self.metrics = metrics
        self.fingerprint = fingerprint
        self.index = PrefixIndex()
        self._register, self._delete = register, delete
        self._seen: dict[str, OrderedDict[bytes, int]] = {}  # tenant -> system turn -> sightings
        self._registering: set[tuple[str, bytes]] = set()
        self._own: dict[str, OrderedDict[str, None]] = {}  # tenant -> its auto prefix ids, LRU
        self._tasks: set[asyncio.Task] = set()

    def restore(self, records: list[PrefixRecord]) -> None:
        """Indexes the prefixes a (re)started server finds, and takes back its automatic ones."""
        for record in records:
            self.index.add(record)
            if record.automatic and is_owned_by(record, self.fingerprint, record.tenant):
                self._own.setdefault(record.tenant, OrderedDict())[record.prefix_id] = None

    def match(self, tenant: Tenant, wish: PrefixWish) -> PrefixRecord | None:
        """The tenant's longest registered prefix leading the prompt, counted in the metrics as
        vLLM counts them (tokens looked up, tokens found). The request's system turn counts
        towards registering it."""
        self.metrics.prefix_cache_queried(len(wish.token_ids))
        record = self.index.longest_match(tenant.name, wish.token_ids, wish.compressor_spec)
        if record is not None and is_owned_by(record, self.fingerprint, tenant.name):
            self.metrics.prefix_cache_hit(record.num_tokens)
            own = self._own.get(tenant.name)
            if own is not None and record.prefix_id in own:
                own.move_to_end(record.prefix_id)
            return record
        if wish.system is not None and self._seen_twice(tenant.name, wish):
            task = asyncio.create_task(self._register_turn(tenant, wish))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return None

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _seen_twice(self, tenant: str, wish: PrefixWish) -> bool:
        """Counts a sighting of a system turn (with the compressor asked for) that matched
        nothing: True the second time, unless it is being registered already."""
        minimum = self.config.auto_prefix_min_tokens
        if minimum is None or len(wish.system[1]) < minimum:
            return False
        key = _sighting(wish)
        seen = self._seen.setdefault(tenant, OrderedDict())
        seen[key] = seen.get(key, 0) + 1
        seen.move_to_end(key)
        while len(seen) > _SEEN_LIMIT:
            seen.popitem(last=False)
        if seen[key] < 2 or (tenant, key) in self._registering:
            return False
        del seen[key]
        return True

    async def _register_turn(self, tenant: Tenant, wish: PrefixWish) -> None:
        """Registers a system turn; past the tenant's count of automatic prefixes, or its
        prefix quota, deletes its least recently used automatic prefixes to make room."""
        key = (tenant.name, _sighting(wish))
        self._registering.add(key)
        own = self._own.setdefault(tenant.name, OrderedDict())
        try:
            if len(own) >= self.config.auto_prefix_max_per_tenant:
                await self._evict_oldest(own, tenant)
            try:
                prefix_id = await self._register(wish.system[0], tenant, wish.compressor)
            except PrefixQuotaError:
                if not own:
                    return  # the quota is the client's prefixes': nothing here to make room
                await self._evict_oldest(own, tenant)
                prefix_id = await self._register(wish.system[0], tenant, wish.compressor)
            own[prefix_id] = None
        except PrefixQuotaError:
            log.info("a system turn was not registered: the tenant's prefix quota is full")
        except Exception:  # noqa: BLE001 - a background registration fails alone
            log.warning("automatic prefix registration failed", exc_info=True)
        finally:
            self._registering.discard(key)

    async def _evict_oldest(self, own: OrderedDict[str, None], tenant: Tenant) -> None:
        oldest = next(iter(own))
        await self._delete(oldest, tenant)
        own.pop(oldest, None)


def _sighting(wish: PrefixWish) -> bytes:
    """A system turn with the compressor asked for, as sightings are counted."""
    spec = json.dumps(wish.compressor_spec, sort_keys=True).encode()
    return _digest(wish.system[1], spec)
