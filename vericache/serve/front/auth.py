"""Who may call the API: API keys that map to tenants, each tenant's limits, and TLS files.

A caller sends its key as gRPC metadata, `authorization: Bearer <key>` or `x-api-key: <key>`. The
keys file (JSON) lists tenants, their keys and limits:

    {"tenants": [
        {"name": "acme", "keys": ["a-long-random-secret", "sha256:9f86d0...(64 hex)"],
         "max_concurrent_requests": 4, "max_prompt_tokens": 8192, "max_output_tokens": 1024,
         "max_prefix_bytes": "2GiB"}
    ]}

A key is either the secret itself or `sha256:` and the hex SHA-256 of the secret, so the file need
not hold secrets. Presented keys are hashed and compared with every stored hash in constant time.
A limit left out is no limit. `--insecure-no-auth` serves every caller as one anonymous tenant
without limits. Tenants own prefixes through their ids (catalog.PrefixKey).
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Iterable
from dataclasses import dataclass, fields
from pathlib import Path

from vericache.engine.link import parse_size
from vericache.errors import InvalidRequestError, QueueFullError, VeriCacheError

_HASH_PREFIX = "sha256:"
MIN_KEY_CHARS = 16


class UnauthenticatedError(VeriCacheError):
    """No API key, or one the server does not know (UNAUTHENTICATED)."""


class TenantLimitError(QueueFullError):
    """A request goes past its tenant's limits (RESOURCE_EXHAUSTED)."""


class PrefixQuotaError(TenantLimitError):
    """A registration would take the tenant's prefixes past its bytes of KV."""


@dataclass(frozen=True)
class Tenant:
    name: str  # "" is the anonymous tenant of --insecure-no-auth (and of prefixes made before)
    # Limits; None: none.
    max_concurrent_requests: int | None = None  # Generate and PutPrefix calls at once
    max_prompt_tokens: int | None = None  # a prompt with its prefix, and a prefix alone
    max_output_tokens: int | None = None  # a Generate's max_tokens
    max_prefix_bytes: int | None = None  # full + compressed KV of the tenant's prefixes

    def __post_init__(self):
        for field in fields(self)[1:]:
            value = getattr(self, field.name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise InvalidRequestError(
                    f"tenant {self.name!r}: {field.name} must be an integer >= 1, got {value!r}"
                )

    def check_tokens(self, num_prompt_tokens: int, num_output_tokens: int = 0) -> None:
        limits = (
            ("prompt", num_prompt_tokens, self.max_prompt_tokens),
            ("output", num_output_tokens, self.max_output_tokens),
        )
        for what, count, limit in limits:
            if limit is not None and count > limit:
                raise TenantLimitError(
                    f"{count} {what} tokens exceed this API key's limit of {limit}"
                )


ANONYMOUS = Tenant("")


def key_hash(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class ApiKeys:
    """Maps presented API keys to tenants; `None` of these serves everyone as ANONYMOUS."""

    def __init__(self, tenants: Iterable[tuple[Tenant, list[str]]]):
        self._hashes: list[tuple[bytes, Tenant]] = []
        names = set()
        for tenant, keys in tenants:
            if not tenant.name or tenant.name in names:
                raise InvalidRequestError(f"tenant names must be unique and non-empty: {tenant}")
            names.add(tenant.name)
            if not keys:
                raise InvalidRequestError(f"tenant {tenant.name!r} has no keys")
            self._hashes += [(_stored_hash(key, tenant.name), tenant) for key in keys]
        if not self._hashes:
            raise InvalidRequestError("the API keys file names no tenant")
        if len({h for h, _ in self._hashes}) != len(self._hashes):
            raise InvalidRequestError("an API key is listed twice")

    @classmethod
    def load(cls, path: Path) -> ApiKeys:
        try:
            raw = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise InvalidRequestError(f"API keys file {path} does not exist") from None
        except (OSError, ValueError) as exc:
            raise InvalidRequestError(f"API keys file {path} is not readable JSON: {exc}") from None
        if (
            not isinstance(raw, dict)
            or set(raw) != {"tenants"}
            or not isinstance(raw["tenants"], list)
        ):
            raise InvalidRequestError(f'API keys file {path} must be {{"tenants": [...]}}')
        return cls(_tenant_entry(entry, path) for entry in raw["tenants"])

    @property
    def tenants(self) -> list[Tenant]:
        return list({t.name: t for _, t in self._hashes}.values())

    def tenant_for(self, metadata: Iterable[tuple[str, str | bytes]]) -> Tenant:
        key = presented_key(metadata)
        if key is None:
            raise UnauthenticatedError(
                "this server needs an API key: send `authorization: Bearer <key>`"
            )
        digest = key_hash(key)
        found = None
        for stored, tenant in self._hashes:  # every comparison made: no timing by position
            if hmac.compare_digest(stored, digest):
                found = tenant
        if found is None:
            raise UnauthenticatedError("the API key is not valid")
        return found


def presented_key(metadata: Iterable[tuple[str, str | bytes]]) -> str | None:
    for name, value in metadata or ():
        if isinstance(value, bytes):
            continue
        if name == "authorization" and value[:7].lower() == "bearer ":
            return value[7:].strip()
        if name == "x-api-key":
            return value.strip()
    return None


def _stored_hash(key: str, tenant: str) -> bytes:
    if not isinstance(key, str):
        raise InvalidRequestError(f"tenant {tenant!r}: keys must be strings")
    if key.startswith(_HASH_PREFIX):
        try:
            digest = bytes.fromhex(key[len(_HASH_PREFIX) :])
        except ValueError:
            digest = b""
        if len(digest) != 32:
            raise InvalidRequestError(f"tenant {tenant!r}: {_HASH_PREFIX} needs 64 hex digits")
        return digest
    if len(key) < MIN_KEY_CHARS:
        raise InvalidRequestError(
            f"tenant {tenant!r}: a key must have at least {MIN_KEY_CHARS} characters"
        )
    return key_hash(key)


def _tenant_entry(entry, path: Path) -> tuple[Tenant, list[str]]:
    if not isinstance(entry, dict):
        raise InvalidRequestError(f"{path}: each tenant is an object, got {entry!r}")
    known = {f.name for f in fields(Tenant)} | {"keys"}
    unknown = set(entry) - known
    if unknown:
        raise InvalidRequestError(f"{path}: unknown tenant fields {sorted(unknown)}")
    values = {k: v for k, v in entry.items() if k != "keys"}
    if isinstance(values.get("max_prefix_bytes"), str):
        values["max_prefix_bytes"] = parse_size(values["max_prefix_bytes"])
    if not isinstance(values.get("name"), str):
        raise InvalidRequestError(f"{path}: each tenant needs a name")
    keys = entry.get("keys")
    if not isinstance(keys, list):
        raise InvalidRequestError(f"{path}: tenant {values['name']!r} needs a list of keys")
    return Tenant(**values), keys


@dataclass(frozen=True)
class TlsFiles:
    cert: Path  # PEM certificate chain of the server
    key: Path  # its PEM private key

    def read(self) -> tuple[bytes, bytes]:
        """(key, certificate chain), as grpc.ssl_server_credentials takes them."""
        try:
            return self.key.read_bytes(), self.cert.read_bytes()
        except OSError as exc:
            raise InvalidRequestError(f"cannot read the TLS certificate or key: {exc}") from None


@dataclass(frozen=True)
class Access:
    """How the API admits callers: API keys (None: anonymous, `--insecure-no-auth`), TLS
    (None: plaintext), and a plaintext port serving only grpc.health.v1 (None: none)."""

    api_keys: ApiKeys | None = None
    tls: TlsFiles | None = None
    health_port: int | None = None

    def tenant_for(self, metadata) -> Tenant:
        return ANONYMOUS if self.api_keys is None else self.api_keys.tenant_for(metadata)
