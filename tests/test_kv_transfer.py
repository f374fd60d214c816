"""KV streamed to drafters over gRPC through the emulated link: exact, cached, paced, typed."""

from __future__ import annotations

import grpc
import pytest
import torch

from tests.timing import SLACK, slept_s
from vericache.compress import KIVI
from vericache.engine.link import LinkSpec, ThrottledLink
from vericache.errors import PrefixNotFoundError
from vericache.kv.cache import DenseLayerKV, KVCache
from vericache.kv.shared_prefix import SharedPrefixes
from vericache.serve.cluster_secret import ClusterSecret
from vericache.serve.config import DrafterConfig, VerifierConfig
from vericache.serve.workers.kv_transfer import (
    KVFetcher,
    KVKind,
    KVTransferService,
    TransferServer,
)

FINGERPRINT = "sha256:test-model"
SECRET = ClusterSecret.generate()


def proofs(prefix_id: str, kind: int = KVKind.COMPRESSED, session: str = "s1") -> tuple:
    """What a drafter of this server sends, with the grant the coordinator gave `session`."""
    return SECRET.fetch_metadata(session, SECRET.grant(session, prefix_id, kind))


def _full(num_tokens=600, layers=4, heads=2, dim=64, seed=0) -> KVCache:
    generator = torch.Generator().manual_seed(seed)
    caches = []
    for _ in range(layers):
        keys, values = torch.randn(2, num_tokens, heads, dim, generator=generator)
        caches.append(DenseLayerKV.from_tensors(keys, values, torch.arange(num_tokens)))
    return KVCache(caches, num_tokens)


@pytest.fixture(scope="module")
def prefixes():
    full = _full()
    return {
        "p1": {
            KVKind.FULL: full.to_state(),
            KVKind.COMPRESSED: KIVI(bits=2).compress(full).to_state(),
        }
    }


def _source(prefixes):
    def source(prefix_id, kind):
        if prefix_id not in prefixes:
            raise PrefixNotFoundError(f"no prefix {prefix_id!r}")
        return prefixes[prefix_id][kind]

    return source


@pytest.fixture
def serve(prefixes):
    started = []

    def start(spec: LinkSpec = LinkSpec()):
        link = ThrottledLink(spec)
        server = TransferServer(KVTransferService(_source(prefixes), FINGERPRINT, link, SECRET))
        started.append(server)
        return server, link

    yield start
    for server in started:
        server.stop()


@pytest.mark.parametrize("kind", [KVKind.COMPRESSED, KVKind.FULL])
def test_fetch_is_exact_and_the_second_fetch_is_free(serve, prefixes, kind):
    server, link = serve()
    fetcher = KVFetcher(f"127.0.0.1:{server.port}", FINGERPRINT, SharedPrefixes(1 << 30))
    first = fetcher.fetch("p1", kind, proofs("p1", kind))
    assert first.cache.to_state().equals(prefixes["p1"][kind])
    assert first.link_bytes == link.bytes_sent > 0
    second = fetcher.fetch("p1", kind, proofs("p1", kind))
    assert second.link_bytes == 0 and second.cache is first.cache
    assert link.bytes_sent == first.link_bytes
    assert fetcher.held.stats().sessions_per_prefix == (2,)
    fetcher.held.release(first.held)
    fetcher.held.release(second.held)
    assert fetcher.held.stats().sessions_per_prefix == (0,)
    fetcher.close()


def test_unknown_prefix_is_a_typed_error(serve):
    server, _ = serve()
    fetcher = KVFetcher(f"127.0.0.1:{server.port}", FINGERPRINT, SharedPrefixes(1 << 30))
    with pytest.raises(PrefixNotFoundError, match="nope"):
        fetcher.fetch("nope", KVKind.COMPRESSED, proofs("nope"))
    fetcher.close()


def test_transfer_rate_follows_the_link(serve):
    bandwidth = 10e6
    open_server, _ = serve()  # the reference: the same fetch's encoding, decoding and gRPC
    unpaced = _fetched_s(open_server)
    server, link = serve(LinkSpec(bandwidth=bandwidth, latency=0.01))
    fetcher = KVFetcher(f"127.0.0.1:{server.port}", FINGERPRINT, SharedPrefixes(1 << 30))
    result = fetcher.fetch(
        "p1", KVKind.FULL, proofs("p1", KVKind.FULL)
    )  # about 2.5 MB after encoding
    paced = 0.01 + result.link_bytes / bandwidth
    # The link's pace is a floor; encoding, decoding and gRPC add to it what they take without it
    # (tests/test_link.py checks the pace itself), and the pacing wakes as late as a sleep does.
    assert paced <= result.seconds <= SLACK * (slept_s(paced) + unpaced)
    fetcher.close()


def _fetched_s(server) -> float:
    """Seconds of one fetch of p1's full KV from `server`."""
    fetcher = KVFetcher(f"127.0.0.1:{server.port}", FINGERPRINT, SharedPrefixes(1 << 30))
    try:
        return fetcher.fetch("p1", KVKind.FULL, proofs("p1", KVKind.FULL)).seconds
    finally:
        fetcher.close()


def test_concurrent_fetches_of_one_prefix_share_one_transfer(serve):
    from concurrent.futures import ThreadPoolExecutor

    server, link = serve()
    fetcher = KVFetcher(f"127.0.0.1:{server.port}", FINGERPRINT, SharedPrefixes(1 << 30))
    with ThreadPoolExecutor(4) as pool:
        results = list(
            pool.map(lambda _: fetcher.fetch("p1", KVKind.COMPRESSED, proofs("p1")), range(4))
        )
    assert sum(r.link_bytes > 0 for r in results) == 1
    assert link.bytes_sent == max(r.link_bytes for r in results)
    fetcher.close()


def _slow_server(prefixes, registered: list[bool]):
    """A service over a 1 MB/s link: the full KV (about 2.5 MB) takes some 2.5 s."""
    link = ThrottledLink(LinkSpec(bandwidth=1e6))
    service = KVTransferService(
        _source(prefixes), FINGERPRINT, link, SECRET, is_registered=lambda _: registered[0]
    )
    return TransferServer(service), link


@pytest.mark.parametrize("background", [True, False])
def test_a_prefix_deleted_mid_stream_ends_a_background_stream_alone(prefixes, background):
    # A warm node's host tier stops streaming a deleted prefix; a session's fetch of it goes on,
    # as the sessions using a deleted prefix are served to their end.
    import threading

    registered = [True]
    server, _ = _slow_server(prefixes, registered)
    fetcher = KVFetcher(f"127.0.0.1:{server.port}", FINGERPRINT, SharedPrefixes(1 << 30))
    threading.Timer(0.1, lambda: registered.__setitem__(0, False)).start()
    try:
        if background:
            with pytest.raises(PrefixNotFoundError):
                fetcher.fetch("p1", KVKind.FULL, proofs("p1", KVKind.FULL), background=True)
        else:
            fetched = fetcher.fetch("p1", KVKind.FULL, proofs("p1", KVKind.FULL))
            assert fetched.cache.to_state().equals(prefixes["p1"][KVKind.FULL])
    finally:
        fetcher.close()
        server.stop()


def test_a_stream_is_bounded_in_bytes_and_in_time(prefixes):
    from vericache.kv.shared_prefix import PrefixBudgetError

    server, link = _slow_server(prefixes, [True])
    fetcher = KVFetcher(f"127.0.0.1:{server.port}", FINGERPRINT, SharedPrefixes(1 << 20))
    try:
        with pytest.raises(PrefixBudgetError):  # refused before a byte moves
            fetcher.fetch("p1", KVKind.FULL, proofs("p1", KVKind.FULL), nbytes=2 << 20)
        assert link.bytes_sent == 0
        with pytest.raises(grpc.RpcError) as raised:
            fetcher.fetch("p1", KVKind.FULL, proofs("p1", KVKind.FULL), timeout_s=0.3)
        assert raised.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    finally:
        fetcher.close()
        server.stop()


UNAUTHENTICATED, DENIED = grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED
FORGED = {
    "no proofs": ((), UNAUTHENTICATED),
    "another server's secret": (
        ClusterSecret.generate().fetch_metadata("s1", SECRET.grant("s1", "p1", KVKind.FULL)),
        UNAUTHENTICATED,
    ),
    "a grant for another prefix": (
        SECRET.fetch_metadata("s1", SECRET.grant("s1", "p2", KVKind.FULL)),
        DENIED,
    ),
    "another session's grant": (
        SECRET.fetch_metadata("s1", SECRET.grant("s2", "p1", KVKind.FULL)),
        DENIED,
    ),
    "a grant for the compressed KV": (
        SECRET.fetch_metadata("s1", SECRET.grant("s1", "p1", KVKind.COMPRESSED)),
        DENIED,
    ),
}


@pytest.mark.parametrize("case", FORGED)
def test_a_fetch_without_the_servers_proofs_gets_nothing(serve, case):
    metadata, code = FORGED[case]
    server, link = serve()
    fetcher = KVFetcher(f"127.0.0.1:{server.port}", FINGERPRINT, SharedPrefixes(1 << 30))
    with pytest.raises(grpc.RpcError) as caught:
        fetcher.fetch("p1", KVKind.FULL, metadata)
    assert caught.value.code() is code and link.bytes_sent == 0
    fetcher.close()


def test_the_secret_never_shows_in_a_config():
    shown = repr(VerifierConfig(secret=SECRET)) + repr(DrafterConfig(secret=SECRET)) + repr(SECRET)
    assert SECRET.key.hex() not in shown and str(SECRET.key) not in shown
