"""FullKVStore: the verifier's LMCache-backed store of full KV for registered prefixes.

No model: random full caches of a tiny layout (2 layers, 2 KV heads, head_dim 16, chunks of 16
tokens), a few hundred KB each, and a CPU tier of 1 MiB.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.damage import DAMAGES, flip_bytes
from vericache.errors import InvalidRequestError
from vericache.kv.cache import DenseLayerKV, KVCache
from vericache.kv.exact import ExactKV
from vericache.model.config import ModelConfig, RopeConfig
from vericache.serve.store.full_kv import (
    FullKVStore,
    PrefixNotStoredError,
    StoreClosedError,
    StoreCorruptionError,
)
from vericache.serve.store.lmcache import chained_chunk_hash, fingerprint_seed

CHUNK = 16
CPU_BYTES = 2**20

CONFIG = ModelConfig(
    model_type="llama",
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    max_position_embeddings=8192,
    rms_norm_eps=1e-6,
    rope=RopeConfig(theta=10000.0),
    tie_word_embeddings=False,
    qkv_bias=False,
    o_bias=False,
    mlp_bias=False,
    qk_norm=False,
    layer_windows=(None, None),
    eos_token_ids=(2,),
)


def random_full_cache(num_tokens: int, dtype: torch.dtype, seed: int) -> KVCache:
    generator = torch.Generator().manual_seed(seed)
    shape = (num_tokens, CONFIG.num_kv_heads, CONFIG.head_dim)  # [T, H, D]
    positions = torch.arange(num_tokens, dtype=torch.int32)
    layers = [
        DenseLayerKV.from_tensors(
            torch.randn(shape, generator=generator).to(dtype),
            torch.randn(shape, generator=generator).to(dtype),
            positions,
        )
        for _ in range(CONFIG.num_layers)
    ]
    return KVCache(layers, num_tokens)


def token_ids(num_tokens: int, offset: int = 100) -> list[int]:
    return list(range(offset, offset + num_tokens))


def assert_same_kv(loaded: KVCache, expected: KVCache) -> None:
    assert loaded.is_full and loaded.num_tokens == expected.num_tokens
    for got, want in zip(loaded.layers, expected.layers, strict=True):
        for got_tensor, want_tensor in zip(got.keys_values(), want.keys_values(), strict=True):
            assert got_tensor.dtype == want_tensor.dtype
            # Bit-exact, NaN payloads and signed zeros included.
            assert torch.equal(got_tensor.view(torch.uint8), want_tensor.view(torch.uint8))
        assert torch.equal(got.positions(), want.positions())


def open_store(root, dtype=torch.float32, cpu_bytes=CPU_BYTES) -> FullKVStore:
    return FullKVStore(root, CONFIG, "tiny-llama", dtype, cpu_bytes=cpu_bytes, chunk_size=CHUNK)


@pytest.fixture
def store(tmp_path):
    with open_store(tmp_path / "kv") as opened:
        yield opened


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [5, CHUNK, 40])
def test_round_trip_is_bit_exact(tmp_path, dtype, num_tokens):
    cache = random_full_cache(num_tokens, dtype, seed=num_tokens)
    with open_store(tmp_path / "kv", dtype) as store:
        stored = store.put(token_ids(num_tokens), cache)
        assert stored.num_tokens == num_tokens
        assert stored.nbytes == stored.bytes_written == cache.nbytes
        assert store.contains(token_ids(num_tokens))
        assert_same_kv(store.load(token_ids(num_tokens)).cache, cache)


def test_put_is_idempotent(store):
    cache = random_full_cache(40, torch.float32, seed=1)
    first = store.put(token_ids(40), cache)
    again = store.put(token_ids(40), cache)
    assert first.bytes_written == cache.nbytes
    assert again.bytes_written == 0 and again.nbytes == cache.nbytes
    assert store.bytes_stored == cache.nbytes
    # Token ids may come as a tensor too.
    assert_same_kv(store.load(torch.tensor(token_ids(40))).cache, cache)


def test_restart_on_the_same_root_loads_bit_exact(tmp_path):
    cache = random_full_cache(40, torch.bfloat16, seed=2)
    with open_store(tmp_path / "kv", torch.bfloat16) as first:
        first.put(token_ids(40), cache)
        # put returns once every chunk (two whole, one tail) is a file of LMCache's fs:// tier.
        assert len(list((tmp_path / "kv").glob("*.data"))) == 3
    first.close()  # safe to repeat
    with open_store(tmp_path / "kv", torch.bfloat16) as restarted:
        assert restarted.contains(token_ids(40))
        assert_same_kv(restarted.load(token_ids(40)).cache, cache)
        # Already on disk: nothing is written again.
        assert restarted.put(token_ids(40), cache).bytes_written == 0


def extended(cache: KVCache, num_kept: int, num_new: int, seed: int) -> KVCache:
    """The first `num_kept` tokens of `cache` followed by `num_new` tokens of fresh random KV."""
    dtype = cache.layers[0].keys_values()[0].dtype
    fresh = random_full_cache(num_new, dtype, seed)
    result = KVCache.empty(CONFIG.num_layers, CONFIG.num_kv_heads, CONFIG.head_dim, dtype, "cpu")
    result.append_exact(ExactKV.of(cache, 0, num_kept))
    positions = torch.arange(num_kept, num_kept + num_new, dtype=torch.int32)
    for layer, fresh_layer in zip(result.layers, fresh.layers, strict=True):
        layer.append(*fresh_layer.keys_values(), positions)
    result.advance(num_new)
    return result


def test_prefixes_sharing_a_first_chunk_both_load(store):
    shared = token_ids(CHUNK)
    prefix_a, prefix_b = shared + token_ids(24, offset=300), shared + token_ids(9, offset=400)
    cache_a = random_full_cache(len(prefix_a), torch.float32, seed=3)
    cache_b = extended(cache_a, CHUNK, 9, seed=4)
    store.put(prefix_a, cache_a)
    # The shared chunk is on disk already: only the rest of prefix_b is written.
    assert store.put(prefix_b, cache_b).bytes_written == 9 * store.bytes_per_token
    assert_same_kv(store.load(prefix_a).cache, cache_a)
    assert_same_kv(store.load(prefix_b).cache, cache_b)
    # The stored chunk boundary is a stored prefix too; a cut inside a chunk is not.
    assert store.contains(shared)
    assert not store.contains(prefix_a[: CHUNK + 3])


def test_load_of_unknown_or_partly_stored_prefix_raises(store):
    with pytest.raises(PrefixNotStoredError):
        store.load(token_ids(40))
    store.put(token_ids(40), random_full_cache(40, torch.float32, seed=4))
    with pytest.raises(PrefixNotStoredError):
        store.load(token_ids(41))  # the first 40 tokens' chunks are there, not the 41st token
    with pytest.raises(PrefixNotStoredError):
        store.load(token_ids(36))  # 36 tokens end inside the stored tail chunk of 40
    assert not store.contains(token_ids(40, offset=101))
    assert store.bytes_loaded == 0


def test_delete_removes_the_prefix_from_both_tiers(tmp_path):
    root = tmp_path / "kv"
    with open_store(root) as store:
        store.put(token_ids(40), random_full_cache(40, torch.float32, seed=5))
        store.delete(token_ids(40))
        assert not store.contains(token_ids(40))
        with pytest.raises(PrefixNotStoredError):
            store.load(token_ids(40))
        store.delete(token_ids(40))  # deleting what is not stored does nothing
    assert not list(root.glob("*.data")) and not any((root / "digests").iterdir())
    with open_store(root) as restarted:
        assert not restarted.contains(token_ids(40))


def test_delete_takes_shared_chunks_with_it(store):
    # Documented: chunks are not reference counted, so a prefix sharing them must be put again.
    longer, shorter = token_ids(40), token_ids(CHUNK)
    cache = random_full_cache(40, torch.float32, seed=6)
    store.put(longer, cache)
    store.delete(shorter)
    assert not store.contains(longer)
    store.put(longer, cache)
    assert_same_kv(store.load(longer).cache, cache)


def test_delete_leaves_a_prefix_that_is_not_stored_alone(store):
    cache = random_full_cache(CHUNK, torch.float32, seed=7)
    store.put(token_ids(CHUNK), cache)
    store.delete(token_ids(40))  # not stored, though its first chunk is
    assert_same_kv(store.load(token_ids(CHUNK)).cache, cache)


def test_accounting_and_capacity(store):
    num_tokens = 40
    cache = random_full_cache(num_tokens, torch.float32, seed=8)
    expected_bytes = num_tokens * CONFIG.kv_bytes_per_token(element_size=4)
    assert cache.nbytes == expected_bytes
    store.put(token_ids(num_tokens), cache)
    first = store.load(token_ids(num_tokens), capacity=100)
    second = store.load(token_ids(num_tokens))
    assert first.bytes_loaded == second.bytes_loaded == expected_bytes
    assert store.bytes_stored == expected_bytes and store.store_seconds > 0
    assert store.bytes_loaded == 2 * expected_bytes
    assert 0 < first.seconds and 0 < second.seconds
    assert store.load_seconds == pytest.approx(first.seconds + second.seconds)
    # Room reserved for tokens to come: decoding appends without regrowing the buffers.
    keys, _ = first.cache.layers[0].keys_values(pad_to=100)
    assert keys.shape[0] >= 100


def test_prefix_larger_than_the_cpu_tier_round_trips(tmp_path):
    # 1 MiB CPU tier, 1.5 MiB of KV: stored and loaded in several calls, evicting as it goes.
    num_tokens = 3 * CPU_BYTES // CONFIG.kv_bytes_per_token(element_size=4) // 2 + 5
    cache = random_full_cache(num_tokens, torch.float32, seed=9)
    with open_store(tmp_path / "kv") as store:
        store.put(token_ids(num_tokens), cache)
        assert_same_kv(store.load(token_ids(num_tokens)).cache, cache)
    with open_store(tmp_path / "kv") as restarted:
        assert_same_kv(restarted.load(token_ids(num_tokens)).cache, cache)


def test_put_rejects_caches_that_are_not_the_full_prefix(store):
    cache = random_full_cache(20, torch.float32, seed=10)
    with pytest.raises(InvalidRequestError):
        store.put(token_ids(21), cache)
    with pytest.raises(InvalidRequestError):
        store.put(token_ids(20), random_full_cache(20, torch.bfloat16, seed=10))
    with pytest.raises(InvalidRequestError):
        store.put([], cache)
    assert not store.contains(token_ids(20))


def test_closed_store_refuses_calls(tmp_path):
    store = open_store(tmp_path / "kv")
    store.close()
    with pytest.raises(StoreClosedError):
        store.contains(token_ids(5))


def test_cpu_tier_too_small_for_a_chunk_is_refused(tmp_path):
    with pytest.raises(InvalidRequestError):
        open_store(tmp_path / "kv", cpu_bytes=1024)


def test_chunk_keys_are_stable_values():
    # Golden values: keys must not depend on the process (no Python hash()) nor change silently,
    # or every store written before would be lost.
    seed = fingerprint_seed("sha256:0123")
    key = chained_chunk_hash(seed, np.arange(4))
    assert (seed, key) == (7532386527979548874, 2485914243384173417)
    assert chained_chunk_hash(seed, np.arange(5)) != key
    assert chained_chunk_hash(seed + 1, np.arange(4)) != key


# --- Integrity: what the disk returns is checked before it reaches a cache ----------------------


def stored_on_disk(tmp_path, num_tokens: int = 40) -> tuple:
    """A prefix put by one store, whose chunks a restarted store reads from the fs:// tier."""
    root = tmp_path / "kv"
    cache = random_full_cache(num_tokens, torch.float32, seed=11)
    with open_store(root) as first:
        first.put(token_ids(num_tokens), cache)
    return root, cache


def chunk_files(root) -> list:
    return sorted(root.glob("*.data"), key=lambda path: path.stat().st_mtime_ns)


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_chunk_never_loads(tmp_path, damage):
    root, _ = stored_on_disk(tmp_path)
    DAMAGES[damage](chunk_files(root)[1])
    with open_store(root) as restarted:
        with pytest.raises(StoreCorruptionError):
            restarted.load(token_ids(40))


@pytest.mark.parametrize("damage", ["flipped", "removed"])
def test_a_damaged_digest_never_loads(tmp_path, damage):
    root, _ = stored_on_disk(tmp_path)
    DAMAGES[damage](sorted((root / "digests").iterdir())[0])
    with open_store(root) as restarted:
        with pytest.raises(StoreCorruptionError):
            restarted.load(token_ids(40))


def test_a_digest_of_another_chunk_does_not_pass(tmp_path):
    root, _ = stored_on_disk(tmp_path, num_tokens=2 * CHUNK)  # two whole chunks
    first, second = sorted((root / "digests").iterdir())
    first.write_bytes(second.read_bytes())
    with open_store(root) as restarted:
        with pytest.raises(StoreCorruptionError):
            restarted.load(token_ids(2 * CHUNK))


def test_a_damaged_prefix_discarded_and_put_again_loads_bit_exact(tmp_path):
    root, cache = stored_on_disk(tmp_path)
    flip_bytes(chunk_files(root)[0])
    with open_store(root) as restarted:
        with pytest.raises(StoreCorruptionError):
            restarted.load(token_ids(40))
        restarted.discard(token_ids(40))
        assert not restarted.contains(token_ids(40))
        assert restarted.put(token_ids(40), cache).bytes_written == 40 * restarted.bytes_per_token
        assert_same_kv(restarted.load(token_ids(40)).cache, cache)


def test_namespaces_share_no_chunk(store):
    cache = random_full_cache(40, torch.float32, seed=12)
    store.put(token_ids(40), cache, namespace="a")
    assert store.contains(token_ids(40), namespace="a")
    assert not store.contains(token_ids(40)) and not store.contains(token_ids(40), namespace="b")
    with pytest.raises(PrefixNotStoredError):
        store.load(token_ids(40), namespace="b")
    # Another namespace writes everything again: a store hit never tells what "a" stored.
    written = store.put(token_ids(40), cache, namespace="b").bytes_written
    assert written == 40 * store.bytes_per_token
    store.delete(token_ids(40), namespace="a")
    assert_same_kv(store.load(token_ids(40), namespace="b").cache, cache)
    assert not store.contains(token_ids(40), namespace="a")
