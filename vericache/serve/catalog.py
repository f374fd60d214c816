"""Registered prefixes: their ids, what they hold, and their compressed KV, persisted on disk.

A prefix id is a content hash of the model, the prefix's token ids, how the prompt continues it
(a chat system turn or raw tokens) and the compressor with its parameters: registering the same
prefix twice gives the same id. A tenant's name joins the hash (`owned_spec`): two tenants
registering the same text get two prefixes, and a prefix belongs to the tenant whose name gives its
id; the anonymous tenant ("") adds nothing, so prefixes made before tenants are its own. The full
KV lives in the LMCache store (store.py); the catalog keeps each prefix's record (JSON) and its
compressed KV (the KV codec's stream) under `root`, written atomically, so a verifier that
restarts, or another verifier sharing `root`, finds them again.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

from vericache.errors import PrefixNotFoundError
from vericache.kv.codec import decode, encode
from vericache.kv.state import CacheState

_ID_PREFIX = "pfx-"


@dataclass(frozen=True)
class PrefixRecord:
    prefix_id: str
    token_ids: tuple[int, ...]
    chat: bool  # True: the text of a chat system turn (prompts follow as the user turn)
    compressor: dict  # {"name": ..., "params": {...}}
    full_kv_bytes: int
    compressed_kv_bytes: int  # the codec stream drafters receive

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> PrefixRecord:
        raw = json.loads(text)
        return cls(**{**raw, "token_ids": tuple(raw["token_ids"])})


def prefix_id_for(fingerprint: str, token_ids, chat: bool, compressor_spec: dict) -> str:
    described = {
        "model": fingerprint,
        "tokens": list(token_ids),
        "chat": chat,
        "compressor": compressor_spec,
    }
    digest = hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()
    return _ID_PREFIX + digest[:32]


def owned_spec(compressor_spec: dict, tenant: str) -> dict:
    """The spec a tenant registers a prefix with: hashed into its id, ignored by the compressor
    (which reads only "name" and "params")."""
    return {**compressor_spec, "tenant": tenant} if tenant else compressor_spec


def compressor_only(spec: dict) -> dict:
    return {"name": spec["name"], "params": spec["params"]}


def is_owned_by(record: PrefixRecord, fingerprint: str, tenant: str) -> bool:
    spec = owned_spec(compressor_only(record.compressor), tenant)
    return prefix_id_for(fingerprint, record.token_ids, record.chat, spec) == record.prefix_id


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
    def __init__(self, root: Path, fingerprint: str):
        self.root = Path(root) / "prefixes"
        self.root.mkdir(parents=True, exist_ok=True)
        self.fingerprint = fingerprint
        self._states: dict[str, CacheState] = {}  # compressed KV decoded already
        self._lock = threading.Lock()  # the KV transfer server reads from its own thread

    def add(self, record: PrefixRecord, compressed: CacheState) -> PrefixRecord:
        """Writes the compressed KV, then the record (its presence marks a complete prefix)."""
        with self._lock:
            size = _write_atomic(
                self._kv_path(record.prefix_id), lambda f: encode(compressed, self.fingerprint, f)
            )
            record = PrefixRecord(**{**asdict(record), "compressed_kv_bytes": size})
            _write_atomic(
                self._record_path(record.prefix_id), lambda f: f.write(record.to_json().encode())
            )
            self._states[record.prefix_id] = compressed
            return record

    def get(self, prefix_id: str) -> PrefixRecord:
        check_prefix_id(prefix_id)
        try:
            return PrefixRecord.from_json(self._record_path(prefix_id).read_text())
        except FileNotFoundError:
            raise PrefixNotFoundError(f"no prefix {prefix_id!r} is registered") from None

    def contains(self, prefix_id: str) -> bool:
        try:
            self.get(prefix_id)
        except PrefixNotFoundError:
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
                found.append(PrefixRecord.from_json(path.read_text()))
            except FileNotFoundError:  # deleted meanwhile
                continue
        return found

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


def _write_atomic(path: Path, write) -> int:
    tmp = path.with_suffix(path.suffix + f".tmp{os.getpid()}.{threading.get_ident()}")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
        size = f.tell()
    os.replace(tmp, path)
    return size
