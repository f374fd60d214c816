"""Access control end to end, over TLS on loopback: API keys, tenants' prefixes, limits, health."""

from __future__ import annotations

import datetime
import ipaddress
import json

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.serve_fixtures import CONTEXT, start_server, wait_for
from vericache.client import Client
from vericache.client.errors import (
    AuthenticationError,
    PrefixNotFoundError,
    ServerBusyError,
    ServerUnavailableError,
)
from vericache.errors import InvalidRequestError
from vericache.serve.front.api import SERVICE_NAME
from vericache.serve.front.auth import Access, ApiKeys, TlsFiles, key_hash

x509 = pytest.importorskip("cryptography.x509")
from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402

KEY_A, KEY_B, KEY_SMALL = "tenant-a-secret-key-0001", "tenant-b-secret-key-0002", "small-key-0003xx"
PROMPT = "Which function multiplies by three?"


def _name(text: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(x509.NameOID.COMMON_NAME, text)])


def _certificate(subject, issuer, public_key, signing_key, is_ca: bool) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(_name(issuer))
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.BasicConstraints(ca=is_ca, path_length=None), critical=True)
    )
    if not is_ca:
        names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return builder.sign(signing_key, hashes.SHA256())


def _pem(certificate: x509.Certificate) -> bytes:
    return certificate.public_bytes(serialization.Encoding.PEM)


def make_ca(name: str):
    key = ec.generate_private_key(ec.SECP256R1())
    return key, _certificate(name, name, key.public_key(), key, is_ca=True)


@pytest.fixture(scope="module")
def tls(tmp_path_factory) -> tuple[TlsFiles, bytes, bytes]:
    """The server's files, the CA that signed them (PEM) and another CA (PEM)."""
    folder = tmp_path_factory.mktemp("tls")
    ca_key, ca = make_ca("vericache test CA")
    server_key = ec.generate_private_key(ec.SECP256R1())
    cert = _certificate("localhost", ca.subject.rfc4514_string()[3:], server_key.public_key(),
                        ca_key, is_ca=False)  # fmt: skip
    (folder / "tls.crt").write_bytes(_pem(cert))
    (folder / "tls.key").write_bytes(
        server_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    _, other_ca = make_ca("another CA")
    return TlsFiles(folder / "tls.crt", folder / "tls.key"), _pem(ca), _pem(other_ca)


def keys_file(path) -> ApiKeys:
    tenants = [
        # A's key stored as its hash: the file need not hold the secret.
        {"name": "a", "keys": ["sha256:" + key_hash(KEY_A).hex()], "max_output_tokens": 16},
        {"name": "b", "keys": [KEY_B], "max_concurrent_requests": 1},
        {"name": "small", "keys": [KEY_SMALL], "max_prompt_tokens": 200,
         "max_prefix_bytes": "1KiB"},
    ]  # fmt: skip
    path.write_text(json.dumps({"tenants": tenants}))
    return ApiKeys.load(path)


@pytest.fixture(scope="module")
def server(tiny_chat_checkpoint, tmp_path_factory, tls):
    root = tmp_path_factory.mktemp("auth")
    access = Access(keys_file(root / "api-keys.json"), tls[0], health_port=0)
    with start_server(tiny_chat_checkpoint, root / "store", num_drafters=1, access=access) as s:
        yield s


@pytest.fixture(scope="module")
def connect(server, tls):
    def connect(api_key=None, ca=tls[1], **options) -> Client:
        options = {"timeout": 120, **options}
        return Client(server.target, api_key=api_key, root_certificates=ca, **options)

    return connect


def test_calls_without_or_with_a_wrong_key_are_unauthenticated(connect, monkeypatch):
    monkeypatch.delenv("VERICACHE_API_KEY", raising=False)
    for key in (None, "not-a-key-of-this-server", KEY_A + "x"):
        with connect(key) as client:
            with pytest.raises(AuthenticationError) as caught:
                client.list_prefixes()
            assert caught.value.code is grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(AuthenticationError):
                client.generate(PROMPT, mode="full_local", max_tokens=2)
    monkeypatch.setenv("VERICACHE_API_KEY", KEY_B)  # the SDK's default key
    with connect() as client:
        assert isinstance(client.list_prefixes(), list)


def test_tenants_see_only_their_own_prefixes(connect):
    with connect(KEY_A) as a, connect(KEY_B) as b:
        id_a = a.put_prefix(CONTEXT, compressor="streamingllm", ratio=4)
        id_b = b.put_prefix(CONTEXT, compressor="streamingllm", ratio=4)
        assert id_a != id_b  # the same text: two independent prefixes
        assert [p.prefix_id for p in a.list_prefixes()] == [id_a]
        assert [p.prefix_id for p in b.list_prefixes()] == [id_b]
        for prefix_id, other in ((id_a, b), (id_b, a)):
            with pytest.raises(PrefixNotFoundError, match="no prefix") as foreign:
                other.get_prefix(prefix_id)
            with pytest.raises(PrefixNotFoundError) as unknown:
                other.get_prefix("pfx-" + "0" * 32)
            # The same answer, but for the id asked about and the request id that ends it.
            answer = str(foreign.value).rsplit(" (request id ", 1)[0]
            assert answer == str(unknown.value).rsplit(" (request id ", 1)[0].replace(
                "0" * 32, prefix_id[4:]
            )
            with pytest.raises(PrefixNotFoundError):
                other.generate(PROMPT, prefix_id=prefix_id, max_tokens=2)
            assert other.delete_prefix(prefix_id) is False
        assert b.delete_prefix(id_b) is True  # A's copy is untouched
        result = a.generate(PROMPT, prefix_id=id_a, max_tokens=4, draft_len=2)
        assert len(result.token_ids) == 4


def test_a_tenant_cannot_tell_what_another_registered(connect, server):
    # Each tenant's full KV lives in its own namespace of the store: the second registration of
    # the same text does all the work again, as long as the first (no store hit to time).
    store = server.coordinator.backend.verifiers[0].worker.prefixes.store
    text = "# registered by two tenants\n" + CONTEXT  # a first chunk of its own
    with connect(KEY_A) as a, connect(KEY_B) as b:
        before = store.bytes_stored
        a.put_prefix(text, compressor="kivi", bits=4)
        written_by_a = store.bytes_stored - before
        b.put_prefix(text, compressor="kivi", bits=4)
        written_by_b = store.bytes_stored - before - written_by_a
        assert written_by_a > 0 and written_by_b == written_by_a
        assert b.put_prefix(text, compressor="kivi", bits=4)  # B's own: now found at once
        assert store.bytes_stored - before == 2 * written_by_a


def test_limits_answer_resource_exhausted(connect, server):
    with connect(KEY_A) as a:
        with pytest.raises(ServerBusyError, match="limit of 16") as caught:
            a.generate(PROMPT, mode="full_local", max_tokens=17)
        assert caught.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
    with connect(KEY_SMALL) as small:
        with pytest.raises(ServerBusyError, match="prompt tokens"):
            small.put_prefix(CONTEXT, compressor="streamingllm", ratio=4)  # ~300 tokens
        with pytest.raises(ServerBusyError, match="1024"):
            small.put_prefix(CONTEXT[:200], compressor="streamingllm", ratio=4)
        assert small.list_prefixes() == []  # the prefix past the quota was removed again
    with connect(KEY_B) as b, connect(KEY_B) as b2:
        with b.stream(PROMPT, mode="full_local", max_tokens=200) as running:
            next(running)  # B's one request is running
            with pytest.raises(ServerBusyError, match="requests of this API key"):
                b2.generate(PROMPT, mode="full_local", max_tokens=2)
        assert wait_for(lambda: "b" not in server.coordinator._num_active)  # the slot is free
        assert b2.generate(PROMPT, mode="full_local", max_tokens=2).token_ids


def test_a_request_leaving_max_tokens_unset_gets_the_default_within_its_tenants_cap(connect):
    # A's cap (16) lies below the server's default max_tokens (256): the default is clamped to
    # it rather than refused.
    with connect(KEY_A) as a:
        result = a.generate(PROMPT, mode="full_local")
        assert len(result.token_ids) == 16 and result.finish_reason == "length"


def test_health_needs_no_key_on_either_port(server, tls):
    request = health_pb2.HealthCheckRequest(service=SERVICE_NAME)
    credentials = grpc.ssl_channel_credentials(tls[1])
    with grpc.secure_channel(server.target, credentials) as channel:
        answer = health_pb2_grpc.HealthStub(channel).Check(request, timeout=10)
    assert answer.status == health_pb2.HealthCheckResponse.SERVING
    with grpc.insecure_channel(f"127.0.0.1:{server.health_port}") as channel:
        answer = health_pb2_grpc.HealthStub(channel).Check(request, timeout=10)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING
        with Client(f"127.0.0.1:{server.health_port}", api_key=KEY_A, timeout=10) as client:
            with pytest.raises(Exception, match="UNIMPLEMENTED|unimplemented|Method not found"):
                client.list_prefixes()  # only health is served in plaintext


@pytest.mark.parametrize("ca", ["other", None])
def test_tls_connects_only_with_the_right_ca(connect, tls, ca):
    with connect(KEY_A, ca=tls[2] if ca else None, retries=0, timeout=5) as client:
        with pytest.raises(ServerUnavailableError):
            client.list_prefixes()


def test_bad_keys_files_are_refused_clearly(tmp_path):
    path = tmp_path / "keys.json"
    for content, message in [
        ("{", "not readable JSON"),
        ('{"tenants": []}', "names no tenant"),
        ('{"tenants": [{"name": "x", "keys": ["short"]}]}', "at least 16"),
        ('{"tenants": [{"name": "x", "keys": ["sha256:12"]}]}', "64 hex"),
        ('{"tenants": [{"name": "x", "keys": ["' + "k" * 16 + '"], "max_qps": 1}]}', "unknown"),
        ('{"tenants": [{"name": "x", "keys": ["' + "k" * 16 + '"], "max_output_tokens": 0}]}',
         ">= 1"),
        ('{"tenants": [{"name": "x", "keys": ["' + "k" * 16 + '"]}, {"name": "y", "keys": ["'
         + "k" * 16 + '"]}]}', "listed twice"),
    ]:  # fmt: skip
        path.write_text(content)
        with pytest.raises(InvalidRequestError, match=message):
            ApiKeys.load(path)
    with pytest.raises(InvalidRequestError, match="does not exist"):
        ApiKeys.load(tmp_path / "missing")
