"""Opening a channel to the API: TLS or plaintext, and the API key sent with every call."""

from __future__ import annotations

import os
from dataclasses import dataclass

import grpc

API_KEY_ENV = "VERICACHE_API_KEY"


@dataclass(frozen=True)
class ChannelSettings:
    credentials: grpc.ChannelCredentials | None  # None: plaintext
    metadata: tuple[tuple[str, str], ...]  # sent with every call: the API key, if any


def channel_settings(
    api_key: str | None, tls: bool, root_certificates: bytes | None
) -> ChannelSettings:
    """`api_key` None: $VERICACHE_API_KEY, if set. `root_certificates` (PEM) implies TLS; TLS
    without them trusts the system's CAs."""
    if api_key is None:
        api_key = os.environ.get(API_KEY_ENV) or None
    credentials = None
    if tls or root_certificates is not None:
        credentials = grpc.ssl_channel_credentials(root_certificates=root_certificates)
    metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
    return ChannelSettings(credentials, metadata)
