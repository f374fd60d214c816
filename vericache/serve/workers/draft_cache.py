"""What a drafter's session cache takes in from its verifier between drafts: the exact KV of
the tokens committed since (in place of the drafts' own), and a refresh of its kept set
(compress/kept_set.py), each checked before it is used."""

from __future__ import annotations

import logging

from vericache.compress.kept_set import KeptSetRefresh, apply_refresh
from vericache.kv.cache import KVCache
from vericache.kv.compressed import CompressedKV
from vericache.kv.exact import ExactKV

log = logging.getLogger(__name__)


def take_exact(cache: KVCache, exact: ExactKV) -> None:
    """The verifier's KV of the tokens committed since the last draft, in place of what this
    cache drafted for them (the drafts: uncommitted, never compressed)."""
    cache.truncate(exact.start)
    cache.append_exact(exact)
    update_compressed(cache)


def take_kept_set(
    session_id: str, cache: KVCache, num_prefix_tokens: int, held_version: int,
    refresh: KeptSetRefresh,
) -> int:  # fmt: skip
    """The kept set's version `cache` holds after `refresh`: applied where it arrived intact and
    was made for the set held (`held_version`); else dropped, and the set kept (the next drafts
    say which set they read, and the coordinator counts the refresh lost)."""
    if not refresh.is_intact():
        log.warning("session %s: a kept-set refresh arrived damaged; dropped", session_id)
        return held_version
    if refresh.base_version != held_version:
        log.warning("session %s: a kept-set refresh for another set; dropped", session_id)
        return held_version
    apply_refresh(cache, num_prefix_tokens, refresh)
    return refresh.version


def update_compressed(cache: KVCache) -> None:
    """An online compressor's update after its cache took new tokens (token dropping's eviction,
    quantization of a full residual group)."""
    if isinstance(cache, CompressedKV):
        cache.compressor.update(cache)
