"""The verifier's staged full KV of registrations in progress: expiry, bound, take and discard."""

from __future__ import annotations

import torch

from vericache.kv.cache import DenseLayerKV, KVCache
from vericache.serve.store.staging import StagedPrefixes

TTL_S = 10.0


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _cache(num_tokens: int = 3) -> KVCache:
    keys = torch.ones(num_tokens, 1, 2)  # [T, H, D]
    layer = DenseLayerKV.from_tensors(keys, keys, torch.arange(num_tokens))
    return KVCache([layer], num_tokens)


def test_an_entry_unused_for_the_ttl_expires_and_a_used_one_stays():
    clock = _Clock()
    staged = StagedPrefixes(max_entries=4, ttl_s=TTL_S, clock=clock)
    abandoned, in_progress = _cache(), _cache()
    staged.put((1, 2), abandoned)
    staged.put((3, 4), in_progress)
    clock.now = TTL_S - 1
    assert staged.expire() == 0
    assert staged.get((3, 4)) is in_progress  # the store stage: used again
    clock.now = TTL_S
    assert staged.expire() == 1
    assert staged.get((1, 2)) is None and staged.get((3, 4)) is in_progress
    clock.now = 3 * TTL_S
    assert staged.expire() == 1 and len(staged) == 0 and staged.nbytes == 0


def test_past_the_bound_the_least_recently_used_entry_goes():
    staged = StagedPrefixes(max_entries=2, ttl_s=TTL_S, clock=_Clock())
    first, second, third = _cache(), _cache(), _cache()
    staged.put((1,), first)
    staged.put((2,), second)
    staged.get((1,))
    staged.put((3,), third)
    assert len(staged) == 2
    assert staged.get((2,)) is None
    assert staged.get((1,)) is first and staged.get((3,)) is third
    assert staged.nbytes == first.nbytes + third.nbytes


def test_take_removes_and_a_second_take_finds_nothing():
    staged = StagedPrefixes(max_entries=2, ttl_s=TTL_S, clock=_Clock())
    cache = _cache()
    staged.put((1,), cache)
    assert staged.take((1,)) is cache
    assert staged.take((1,)) is None and len(staged) == 0
