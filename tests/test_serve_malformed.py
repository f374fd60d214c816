"""Requests whose bytes are no message of their method, sent raw to each of the API's RPCs: the key
is checked first (UNAUTHENTICATED), then the bytes (INVALID_ARGUMENT), each with a request id and
no internal class in its detail, logged with the tenant and counted like any refusal."""

from __future__ import annotations

import logging
import re

import grpc
import pytest

from tests.serve_fixtures import counts, start_server
from tests.test_serve_auth import KEY_A, keys_file
from vericache.serve.front.api import SERVICE_NAME
from vericache.serve.front.auth import Access

GARBAGE = b"\xff\xff\xff\xff"
NOT_UTF8 = b"\xc3\x28"  # a lead byte without its continuation


def _string_field(number: int, value: bytes) -> bytes:
    return bytes([number << 3 | 2, len(value)]) + value


# RPC -> (is it server-streaming, an encoded request with invalid UTF-8 in a string field)
RPCS = {
    "PutPrefix": (True, _string_field(1, NOT_UTF8)),  # text
    "GetPrefix": (False, _string_field(1, NOT_UTF8)),  # prefix_id
    "ListPrefixes": (False, None),  # no string field
    "DeletePrefix": (False, _string_field(1, NOT_UTF8)),  # prefix_id
    "Generate": (True, _string_field(2, NOT_UTF8)),  # prompt
}
CASES = [(rpc, GARBAGE) for rpc in RPCS] + [
    (rpc, body) for rpc, (_, body) in RPCS.items() if body is not None
]


@pytest.fixture(scope="module")
def server(tiny_chat_checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("malformed")
    access = Access(api_keys=keys_file(root / "keys.json"))
    with start_server(tiny_chat_checkpoint, root / "store", num_drafters=1, access=access) as s:
        yield s


def _send(server, rpc: str, body: bytes, api_key: str | None) -> grpc.RpcError:
    metadata = [("authorization", f"Bearer {api_key}")] if api_key else []
    path = f"/{SERVICE_NAME}/{rpc}"
    with grpc.insecure_channel(server.target) as channel:
        with pytest.raises(grpc.RpcError) as caught:
            if RPCS[rpc][0]:
                list(channel.unary_stream(path)(body, metadata=metadata, timeout=30))
            else:
                channel.unary_unary(path)(body, metadata=metadata, timeout=30)
    return caught.value


def _assert_clean(error: grpc.RpcError) -> None:
    detail = error.details()
    assert re.search(r"\(request id [0-9a-f]{32}\)$", detail), detail
    assert "class" not in detail and "DecodeError" not in detail and "Traceback" not in detail


@pytest.mark.parametrize(("rpc", "body"), CASES)
def test_malformed_bytes_are_invalid_arguments_after_the_key(server, rpc, body):
    for key in (None, "not-a-key-of-anyone"):
        error = _send(server, rpc, body, key)
        assert error.code() == grpc.StatusCode.UNAUTHENTICATED, error.details()
        _assert_clean(error)
    error = _send(server, rpc, body, KEY_A)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert f"not a valid {rpc} message" in error.details()
    _assert_clean(error)


def test_a_malformed_request_is_logged_with_its_tenant_and_counted(server, caplog):
    before = counts(server, "request_failure", "code").get("INVALID_ARGUMENT", 0)
    with caplog.at_level(logging.INFO, logger="vericache.serve.front.api"):
        error = _send(server, "GetPrefix", GARBAGE, KEY_A)
    request_id = error.details()[-33:-1]
    (line,) = [r for r in caplog.records if getattr(r, "request_id", None) == request_id]
    assert line.tenant == "a" and line.code == "INVALID_ARGUMENT"
    assert "GetPrefix refused for tenant 'a'" in line.getMessage()
    after = counts(server, "request_failure", "code").get("INVALID_ARGUMENT", 0)
    assert after == before + 1


def test_a_refusal_without_a_key_is_logged_without_a_tenant(server, caplog):
    with caplog.at_level(logging.INFO, logger="vericache.serve.front.api"):
        error = _send(server, "ListPrefixes", GARBAGE, None)
    request_id = error.details()[-33:-1]
    (line,) = [r for r in caplog.records if getattr(r, "request_id", None) == request_id]
    assert line.tenant is None and line.code == "UNAUTHENTICATED"
