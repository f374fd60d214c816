"""A prefix's ratio-free slot scores are computed once per prefix and reused by every later
compression of it (prefix_caches.py), and what they give equals scoring afresh."""

from __future__ import annotations

import pytest
import torch

from vericache.compress import ModelContext, build_compressor
from vericache.compress.composed import Composed
from vericache.engine.engine import Engine, EngineConfig

PREFIX = 200


@pytest.fixture
def engine(tiny_engine):
    """A fresh prefix store over the shared tiny model."""
    shared = tiny_engine()
    return Engine(shared.runner, None, EngineConfig())


@pytest.fixture
def forwards(engine, monkeypatch):
    """How many forwards the model has run since the fixture was made."""
    count = [0]
    forward = engine.runner.forward

    def counted(*args, **kwargs):
        count[0] += 1
        return forward(*args, **kwargs)

    monkeypatch.setattr(engine.runner, "forward", counted)
    return count


def _ids(seed: int = 5) -> tuple[int, ...]:
    generator = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(3, 512, (PREFIX,), generator=generator).tolist())


def _same(first, second) -> bool:
    return all(
        torch.equal(a.keys_values()[0], b.keys_values()[0])
        and torch.equal(a.positions(), b.positions())
        for a, b in zip(first.layers, second.layers, strict=True)
    )


def test_kvzip_scores_once_for_every_ratio_and_composition(engine, forwards):
    ids = _ids()
    engine.compressed_prefix_kv(ids, build_compressor("kvzip", ratio=2, chunk_size=64))
    after_first = forwards[0]
    assert after_first > 1  # the prefill, then the replays that score
    quarter = build_compressor("kvzip", ratio=4, chunk_size=64)
    reused = engine.compressed_prefix_kv(ids, quarter)
    composed = Composed(quarter, build_compressor("kivi", bits=4))
    engine.compressed_prefix_kv(ids, composed)
    assert forwards[0] == after_first
    fresh = quarter.compress(engine.prefix_kv(ids), ModelContext(engine.runner, ids))
    assert _same(reused, fresh)


def test_scores_are_per_prefix_and_per_scoring(engine, forwards):
    ids = _ids()
    engine.compressed_prefix_kv(ids, build_compressor("kvzip", ratio=2, chunk_size=64))
    before = forwards[0]
    engine.compressed_prefix_kv(ids, build_compressor("kvzip", ratio=2, chunk_size=32))
    assert forwards[0] > before  # another replay, other scores
    before = forwards[0]
    engine.compressed_prefix_kv(_ids(seed=6), build_compressor("kvzip", ratio=2, chunk_size=64))
    assert forwards[0] > before + 1  # another prefix: its prefill and its own replays
