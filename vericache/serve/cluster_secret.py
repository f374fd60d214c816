"""The secret one server's processes share, and what the KV transfer service checks with it.

`vericache serve` (or whatever starts the workers) generates a secret and hands it to the
verifier and drafter actors in their configs; it is never logged (no repr shows it) and never
crosses the network. A drafter's Fetch carries two proofs, both HMAC-SHA256 under the secret:
- the caller token: it belongs to this server (without it: UNAUTHENTICATED);
- a grant the coordinator issued when it opened the drafter's session, naming that session, the
  prefix and the kind of KV (anything else: PERMISSION_DENIED). A prefix id alone, guessed or
  seen, opens nothing: another tenant's KV needs a grant only its own request gets.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass, field

from vericache.errors import InvalidRequestError

_CALLER = "authorization"  # metadata keys of a Fetch
_SESSION = "x-vericache-session"
_GRANT = "x-vericache-grant"


class FetchDeniedError(Exception):
    """A Fetch without valid proofs; `authenticated` says which one failed."""

    def __init__(self, message: str, authenticated: bool):
        super().__init__(message)
        self.authenticated = authenticated


@dataclass(frozen=True)
class ClusterSecret:
    key: bytes = field(repr=False)

    @classmethod
    def generate(cls) -> ClusterSecret:
        return cls(secrets.token_bytes(32))

    def grant(self, session_id: str, prefix_id: str, kind: int) -> str:
        """The coordinator's permission for one session to fetch one prefix's KV of one kind."""
        return self._mac(f"grant\0{session_id}\0{prefix_id}\0{kind}")

    def fetch_metadata(self, session_id: str, grant: str) -> tuple[tuple[str, str], ...]:
        """What a drafter sends with its Fetch."""
        return ((_CALLER, self._caller_token()), (_SESSION, session_id), (_GRANT, grant))

    def check_fetch(self, metadata, prefix_id: str, kind: int) -> None:
        """Raises FetchDeniedError unless `metadata` (a Fetch's) proves both."""
        sent = dict(metadata)
        caller = sent.get(_CALLER, "")
        if not hmac.compare_digest(caller, self._caller_token()):
            raise FetchDeniedError("the caller is not a worker of this server", False)
        expected = self.grant(sent.get(_SESSION, ""), prefix_id, kind)
        if not hmac.compare_digest(sent.get(_GRANT, ""), expected):
            raise FetchDeniedError("no grant for this session to fetch this prefix", True)

    def _caller_token(self) -> str:
        return f"Bearer {self._mac('caller')}"

    def _mac(self, message: str) -> str:
        return hmac.new(self.key, message.encode(), hashlib.sha256).hexdigest()


def required(secret: ClusterSecret | None) -> ClusterSecret:
    """A worker's secret, which its config must carry (launch/cluster.py hands it out)."""
    if secret is None:
        raise InvalidRequestError("a worker needs its server's secret: start it through its server")
    return secret
