"""Registered prefixes: their ids, what they hold, and their compressed KV, persisted on disk.

A prefix id is a content hash of the model, the prefix's token ids, how the prompt continues it
(a chat system turn or raw tokens) and the compressor with its parameters: registering the same
prefix twice gives the same id (`PrefixKey`). A tenant's name joins the hash: two tenants
registering the same text get two prefixes, and a prefix belongs to the tenant whose name gives its
id; the anonymous tenant ("") adds nothing, so prefixes made before tenants are its own. The full
KV lives in the LMCache store (full_kv.py); the catalog keeps each prefix's record (JSON) and its
compressed KV (the KV codec's stream) under `root`, written atomically, so a verifier that
restarts, or another verifier sharing `root`, finds them again.

Integrity: a record file starts with the BLAKE3 digest of the JSON that follows, and the codec
stream of compressed KV carries CRCs of its own. A record that fails its check is moved aside
(`.corrupt`) and reported once: listing skips it, and its id answers DataLossError until the
prefix is registered again (its token ids were in the record, so nothing can rebuild it).
"""

from __future__ import annotations

import contextlib
import enum
import hashlib
import json
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import blake3

from vericache.compress import Compressor, build_compressor
from vericache.errors import DataLossError, PrefixNotFoundError
from vericache.kv.codec import decode, encode
from vericache.kv.state import CacheState
from vericache.serve.store.atomic_files import write_atomic

_ID_PREFIX = "pfx-"

log = logging.getLogger(__name__)


class StoredKind(enum.Enum):
    """What stored data failed its check (the `kind` of `vericache:store_corruptions_total`)."""

    FULL_KV = "full_kv"  # a chunk of the full-KV store
    COMPRESSED_KV = "compressed_kv"  # a prefix's codec stream
    RECORD = "record"  # a prefix's catalog record


@dataclass(frozen=True)
class PrefixRecord:
    prefix_id: str
    token_ids: tuple[int, ...]
    chat: bool  # True: the text of a chat system turn (prompts follow as the user turn)
    compressor: dict  # {"name": ..., "params": {...}}
    full_kv_bytes: int
    compressed_kv_bytes: int  # the codec stream drafters receive
    tenant: str = ""  # the owner (hashed into the id), whose namespace of the store holds its KV
    # Registered by automatic prefix caching, not by a client (hashed into the id): the server
    # may delete it to make room, as it never deletes a client's prefix.
    automatic: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def to_bytes(self) -> bytes:
        """The record file: the BLAKE3 digest of the JSON, a newline, the JSON."""
        body = json.dumps(asdict(self), sort_keys=True).encode()
        return blake3.blake3(body).hexdigest().encode() + b"\n" + body

    @classmethod
    def from_bytes(cls, data: bytes) -> PrefixRecord:
        """The record a file holds; `_CorruptRecordError` for anything `to_bytes` did not write."""
        if data.startswith(b"{"):
            # Written before records had digests: the prefix id, a hash of everything that
            # decides the output, is checked against it wherever the record is used
            # (`is_owned_by`), so a damaged one serves nobody.
            body = data
        else:
            digest, _, body = data.partition(b"\n")
            if blake3.blake3(body).hexdigest().encode() != digest:
                raise _CorruptRecordError("the record does not match its digest")
        try:
            raw = json.loads(body)
            return cls(**{**raw, "token_ids": tuple(raw["token_ids"])})
        except (ValueError, TypeError, KeyError) as exc:
            raise _CorruptRecordError(f"the record does not parse: {type(exc).__name__}") from None


class _CorruptRecordError(Exception):
    pass


@dataclass(frozen=True)
class PrefixKey:
    """What a registration is: the prefix id is a hash of it and the model's fingerprint."""

    token_ids: tuple[int, ...]  # [num_tokens]
    chat: bool  # a chat system turn (prompts follow as the user turn)
    compressor: Compressor  # what the drafters' copy is compressed with
    tenant: str = ""  # the owner; the anonymous tenant ("") adds nothing to the hash
    # Registered by automatic prefix caching: another prefix than a client's of the same text,
    # which the server may delete (a client's never); False adds nothing to the hash.
    automatic: bool = False

    def prefix_id(self, fingerprint: str) -> str:
        spec = self.compressor.spec()
        return _hashed_id(fingerprint, self.token_ids, self.chat, spec, self.tenant, self.automatic)


def _hashed_id(
    fingerprint: str, token_ids, chat: bool, spec: dict, tenant: str, automatic: bool = False
) -> str:
    owned = {**spec, "tenant": tenant} if tenant else spec  # the compressor ignores "tenant"
    if automatic:
        owned = {**owned, "automatic": True}
    described = {"model": fingerprint, "tokens": list(token_ids), "chat": chat, "compressor": owned}
    digest = hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()
    return _ID_PREFIX + digest[:32]


def compressor_of(record: PrefixRecord) -> Compressor:
    return build_compressor(record.compressor["name"], **record.compressor["params"])


def is_owned_by(record: PrefixRecord, fingerprint: str, tenant: str) -> bool:
    spec = {"name": record.compressor["name"], "params": record.compressor["params"]}
    hashed = _hashed_id(fingerprint, record.token_ids, record.chat, spec, tenant, record.automatic)
    return hashed == record.prefix_id


def check_prefix_id(prefix_id: str) -> None:
    """Ids name files: anything but the catalog's own form is unknown, never a path."""
    body = prefix_id[len(_ID_PREFIX) :]
    if not (
        prefix_id.startswith(_ID_PREFIX)
        and len(body) == 32
        and all(c in "0123456789abcdef" for c in body)
    ):
        raise PrefixNotFoundError(f"no prefix {prefix_id!r} is registered")


class PrefixCatalog:
    """`on_corruption` hears of each record that failed its check, once."""

    def __init__(
        self,
        root: Path,
        fingerprint: str,
        on_corruption: Callable[[StoredKind], None] | None = None,
    ):
        self.root = Path(root) / "prefixes"
        self.root.mkdir(parents=True, exist_ok=True)
        self.fingerprint = fingerprint
        self.on_corruption = on_corruption
        self._states: dict[str, CacheState] = {}  # compressed KV decoded already
        self._lock = threading.Lock()  # the KV transfer server reads from its own thread

    def add(self, record: PrefixRecord, compressed: CacheState) -> PrefixRecord:
        """Writes the compressed KV, then the record (its presence marks a complete prefix)."""
        with self._lock:
            size = write_atomic(
                self._kv_path(record.prefix_id), lambda f: encode(compressed, self.fingerprint, f)
            )
            record = PrefixRecord(**{**asdict(record), "compressed_kv_bytes": size})
            path = self._record_path(record.prefix_id)
            write_atomic(path, lambda f: f.write(record.to_bytes()))
            self._quarantine_path(path).unlink(missing_ok=True)  # registered again
            self._states[record.prefix_id] = compressed
            return record

    def replace_compressed(self, prefix_id: str, compressed: CacheState) -> None:
        """Writes a prefix's compressed KV again (its stream failed its check)."""
        with self._lock:
            path = self._kv_path(prefix_id)
            write_atomic(path, lambda f: encode(compressed, self.fingerprint, f))
            self._states[prefix_id] = compressed

    def get(self, prefix_id: str) -> PrefixRecord:
        check_prefix_id(prefix_id)
        path = self._record_path(prefix_id)
        try:
            record = self._read(path)
        except FileNotFoundError:
            if not self._quarantine_path(path).exists():
                raise PrefixNotFoundError(f"no prefix {prefix_id!r} is registered") from None
            record = None
        if record is None:
            raise DataLossError(f"the record of prefix {prefix_id!r} is damaged: register it again")
        return record

    def contains(self, prefix_id: str) -> bool:
        """True when the prefix is registered and its record intact."""
        try:
            self.get(prefix_id)
        except (PrefixNotFoundError, DataLossError):
            return False
        return True

    def compressed_state(self, prefix_id: str) -> CacheState:
        self.get(prefix_id)
        with self._lock:
            state = self._states.get(prefix_id)
            if state is None:
                with open(self._kv_path(prefix_id), "rb") as f:
                    state = self._states[prefix_id] = decode(f, self.fingerprint)
            return state

    def records(self) -> list[PrefixRecord]:
        found = []
        for path in sorted(self.root.glob(f"{_ID_PREFIX}*.json")):
            try:
                record = self._read(path)
            except FileNotFoundError:  # deleted meanwhile
                continue
            if record is not None:
                found.append(record)
        return found

    def _read(self, path: Path) -> PrefixRecord | None:
        """The record in `path`; None when it failed its check (it is then moved aside)."""
        data = path.read_bytes()
        try:
            record = PrefixRecord.from_bytes(data)
            if record.prefix_id != path.stem:
                raise _CorruptRecordError("the record names another prefix")
            return record
        except _CorruptRecordError as exc:
            log.error("prefix %s: its record failed its check and is set aside: %s", path.stem, exc)
            with contextlib.suppress(FileNotFoundError):  # another thread set it aside first
                os.replace(path, self._quarantine_path(path))
                if self.on_corruption is not None:
                    self.on_corruption(StoredKind.RECORD)
            return None

    def remove(self, prefix_id: str) -> PrefixRecord:
        record = self.get(prefix_id)
        with self._lock:
            self._record_path(prefix_id).unlink(missing_ok=True)
            self._kv_path(prefix_id).unlink(missing_ok=True)
            self._states.pop(prefix_id, None)
        return record

    def _record_path(self, prefix_id: str) -> Path:
        return self.root / f"{prefix_id}.json"

    def _kv_path(self, prefix_id: str) -> Path:
        return self.root / f"{prefix_id}.vkv"

    @staticmethod
    def _quarantine_path(record_path: Path) -> Path:
        return record_path.with_suffix(".corrupt")
