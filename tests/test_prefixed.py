"""Sessions over a shared prefix (vericache/kv/prefixed.py): one read-only copy of the prefix, each
session's own slots after it, and not one bit of output changed by the sharing."""

from __future__ import annotations

import pytest
import torch

from vericache.compress import build_compressor
from vericache.compress.context import ModelContext
from vericache.errors import CacheStateError
from vericache.kv.compressed import CompressedKV
from vericache.kv.exact import ExactKV
from vericache.kv.prefixed import PrefixedLayerKV, shared_clone
from vericache.model.loader import load_model
from vericache.model.runner import ModelRunner, SequenceInput

PREFIX = 600  # 4 whole chunks of the CPU kernel's 128 slots and one it shares with the session's


@pytest.fixture(scope="module", params=["llama", "mistral"])
def runner(request, tiny_checkpoint) -> ModelRunner:
    # mistral: a sliding window on every layer, so attention takes the library path over the two
    # parts copied into one buffer.
    loaded = load_model(str(tiny_checkpoint(request.param)))
    return ModelRunner(loaded.config, loaded.weights)


def _ids(num_tokens: int) -> torch.Tensor:
    return torch.randint(3, 512, (num_tokens,), generator=torch.Generator().manual_seed(7))


def _prefix(runner: ModelRunner, num_tokens: int = PREFIX):
    cache = runner.new_cache(num_tokens)
    runner.prefill(_ids(num_tokens), cache, num_logits=0, chunk_size=256)
    return cache


def _decode(runner, caches, suffixes, steps: int, invariant: bool) -> list[list[torch.Tensor]]:
    """Feeds each cache its suffix, then `steps` greedy tokens, all caches in one forward per
    step; every step's logits per cache."""
    feeds = [torch.tensor(s) for s in suffixes]
    logits = [[] for _ in caches]
    for _ in range(steps):
        batch = [SequenceInput(feed, cache) for feed, cache in zip(feeds, caches)]
        out = runner.forward(batch, invariant=invariant)
        for rows, seen in zip(out, logits):
            seen.append(rows)
        feeds = [rows[-1:].argmax(-1) for rows in out]
    return logits


@pytest.mark.parametrize("invariant", [True, False], ids=["exact", "fast"])
def test_sessions_over_a_shared_prefix_get_the_bits_of_private_copies(runner, invariant):
    prefix = _prefix(runner)
    before = [t.clone() for layer in prefix.layers for t in layer.keys_values()]
    suffixes = [[5, 6, 7], [9], list(range(20, 51))]
    shared = [shared_clone(prefix, PREFIX + 64) for _ in suffixes]
    assert all(isinstance(layer, PrefixedLayerKV) for layer in shared[0].layers)
    together = _decode(runner, shared, suffixes, steps=12, invariant=invariant)
    for index, suffix in enumerate(suffixes):
        alone = _decode(runner, [prefix.clone(PREFIX + 64)], [suffix], 12, invariant)[0]
        for step, (got, want) in enumerate(zip(together[index], alone)):
            assert torch.equal(got, want), (index, step)
    after = [t for layer in prefix.layers for t in layer.keys_values()]
    assert all(torch.equal(a, b) for a, b in zip(before, after)), "the shared prefix was written"


def test_a_session_holds_and_rolls_back_only_its_own_tokens(runner):
    prefix = _prefix(runner)
    cache = shared_clone(prefix, PREFIX + 64)
    layer = cache.layers[0]
    assert layer.shared.num_slots == PREFIX and layer.own.num_slots == 0
    assert cache.nbytes == 0  # the prefix is the holder's, not the session's
    runner.forward([SequenceInput(torch.tensor([4, 5, 6]), cache)])
    twin = prefix.clone(PREFIX + 64)
    runner.forward([SequenceInput(torch.tensor([4, 5, 6]), twin)])
    for start, end in [(PREFIX, PREFIX + 3), (500, 520), (0, 10)]:
        ours, theirs = ExactKV.of(cache, start, end), ExactKV.of(twin, start, end)
        assert all(
            torch.equal(a, b) for a, b in zip(ours.keys + ours.values, theirs.keys + theirs.values)
        )
    cache.truncate(PREFIX + 1)
    assert cache.num_tokens == PREFIX + 1 and layer.own.num_slots == 1
    with pytest.raises(CacheStateError, match="shared prefix"):
        layer.drop_last(layer.num_slots - 100)
    state = cache.to_state()
    assert state.layers[0].tensors["keys"].shape[0] == PREFIX + 1


@pytest.mark.parametrize("num_tokens", [1, 100, 128, 129, 255, 384])
def test_a_prefix_of_any_length_is_shared_and_changes_no_bit(runner, num_tokens):
    # Short of a chunk, on a chunk's end, one past it: the chunk that straddles the prefix and
    # the session's own tokens is read from both, as one buffer's chunk.
    prefix = _prefix(runner, num_tokens)
    shared = [shared_clone(prefix, num_tokens + 40) for _ in range(2)]
    assert all(isinstance(layer, PrefixedLayerKV) for layer in shared[0].layers)
    suffixes = [[5, 6, 7], list(range(20, 51))]
    together = _decode(runner, shared, suffixes, steps=3, invariant=True)
    for index, suffix in enumerate(suffixes):
        alone = _decode(runner, [prefix.clone(num_tokens + 40)], [suffix], 3, True)[0]
        assert all(torch.equal(got, want) for got, want in zip(together[index], alone)), index


@pytest.mark.parametrize("name", ["snapkv", "streamingllm", "h2o", "kivi"])
def test_drafts_over_a_shared_compressed_prefix_are_the_drafts_over_a_copy(runner, name):
    # A drafter's sessions share the compressed prefix it fetched: kept tokens are read in place
    # (an online compressor's eviction then gives the session a private layer), quantized layers
    # are copied.
    context = ModelContext(runner, _ids(1100).tolist())
    compressor = build_compressor(name) if name == "kivi" else build_compressor(name, ratio=2)
    compressed = compressor.compress(_prefix(runner, 1100), context)
    shared, copied = shared_clone(compressed, 1200), compressed.clone(1200)
    assert isinstance(shared, CompressedKV)
    assert any(isinstance(layer, PrefixedLayerKV) for layer in shared.layers) == (name != "kivi")
    feeds = [torch.tensor([5, 6, 7])] * 2
    for _ in range(8):
        out = [runner.forward([SequenceInput(f, c)])[0] for f, c in zip(feeds, (shared, copied))]
        assert torch.equal(out[0], out[1])
        for cache in (shared, copied):
            cache.compressor.update(cache)
        feeds = [rows[-1:].argmax(-1) for rows in out]
