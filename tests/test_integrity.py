"""Stored data damaged on disk, read by a restarted server: every case ends in the tokens of an
undisturbed run, or in DATA_LOSS; never in OK with other tokens."""

from __future__ import annotations

import logging
import shutil

import pytest

from tests.damage import DAMAGES
from tests.serve_fixtures import CONTEXT, counts, serving_one_prefix, start_server
from vericache.client import Client, DataLossError

PROMPT = "Which function multiplies by three?"
MODES = ("full_local", "vericache", "full_remote")


def generate_all(client: Client, prefix_id: str, modes=MODES) -> dict[str, tuple[int, ...]]:
    results = {
        mode: client.generate(PROMPT, prefix_id=prefix_id, mode=mode, max_tokens=12)
        for mode in modes
    }
    return {mode: tuple(result.token_ids) for mode, result in results.items()}


def generate_twice(client: Client, prefix_id: str, tokens: dict) -> None:
    """Every mode gives the undisturbed tokens; then vericache, which reads both kinds of KV,
    gives them again from what the first pass stored anew."""
    assert generate_all(client, prefix_id) == tokens
    assert generate_all(client, prefix_id, ("vericache",)) == {"vericache": tokens["vericache"]}


@pytest.fixture(scope="module")
def registered(tiny_chat_checkpoint, tmp_path_factory):
    """A root holding one registered prefix, and the tokens each mode gave on it undisturbed."""
    root = tmp_path_factory.mktemp("registered")
    with serving_one_prefix(tiny_chat_checkpoint, root, "streamingllm") as (_, client, prefix_id):
        tokens = generate_all(client, prefix_id)
    assert len(set(tokens.values())) == 1  # every mode gives full decoding's tokens
    return root, prefix_id, tokens


@pytest.fixture
def damaged_root(registered, tmp_path):
    """A copy of the registered root, for one case to damage."""
    root, prefix_id, tokens = registered
    copy = tmp_path / "root"
    shutil.copytree(root, copy)
    return copy, prefix_id, tokens


def corruptions(server) -> dict[str, float]:
    return counts(server, "store_corruptions", "kind")


@pytest.mark.parametrize("damage", DAMAGES)
@pytest.mark.parametrize("file", ["chunk", "digest"])
def test_damaged_full_kv_is_rebuilt_and_the_output_is_unchanged(
    tiny_chat_checkpoint, damaged_root, damage, file
):
    root, prefix_id, tokens = damaged_root
    chunks = sorted((root / "kv").glob("*.data")) if file == "chunk" else []
    digests = sorted((root / "kv" / "digests").iterdir())
    for path in chunks or digests:  # every one: whichever the prefix reads first fails
        DAMAGES[damage](path)
    with start_server(tiny_chat_checkpoint, root, num_drafters=1) as server:
        with Client(server.target, timeout=120) as client:
            generate_twice(client, prefix_id, tokens)  # rebuilt once, then read as stored
        assert corruptions(server)["full_kv"] == 1


@pytest.mark.parametrize("damage", DAMAGES)
def test_damaged_compressed_kv_is_rebuilt_and_the_output_is_unchanged(
    tiny_chat_checkpoint, damaged_root, damage, caplog
):
    root, prefix_id, tokens = damaged_root
    (compressed,) = (root / "prefixes").glob("*.vkv")
    DAMAGES[damage](compressed)
    with start_server(tiny_chat_checkpoint, root, num_drafters=1) as server:
        with Client(server.target, timeout=120) as client:
            with caplog.at_level(logging.WARNING, logger="vericache.serve.backends.metrics"):
                generate_twice(client, prefix_id, tokens)  # rebuilt once, then read as stored
        assert corruptions(server) == {"full_kv": 0, "compressed_kv": 1, "record": 0}
    # The server's own log says so, with the request that met it (a Ray worker's log is apart).
    (logged,) = [r for r in caplog.records if "integrity check" in r.getMessage()]
    assert logged.kind == "compressed_kv" and logged.request_id
    assert compressed.is_file()  # written again


@pytest.mark.parametrize("damage", ["flipped", "truncated"])
def test_a_damaged_record_is_data_loss_for_its_prefix_alone(
    tiny_chat_checkpoint, damaged_root, damage
):
    root, prefix_id, tokens = damaged_root
    DAMAGES[damage](root / "prefixes" / f"{prefix_id}.json")
    with start_server(tiny_chat_checkpoint, root, num_drafters=1) as server:
        with Client(server.target, timeout=120) as client:
            other = client.put_prefix(CONTEXT, compressor="kivi", bits=4)
            assert [p.prefix_id for p in client.list_prefixes()] == [other]
            for mode in MODES:
                with pytest.raises(DataLossError):
                    client.generate(PROMPT, prefix_id=prefix_id, mode=mode, max_tokens=4)
            # Registering it again makes it whole (its full KV was never damaged).
            assert client.put_prefix(CONTEXT, compressor="streamingllm", ratio=4) == prefix_id
            assert generate_all(client, prefix_id) == tokens
        assert corruptions(server)["record"] == 1
