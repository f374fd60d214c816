"""The verifier's side of steering a remote drafter's kept set (compress/steering.py): per session
that asks for it (`OpenVerifier.steer_every`), the verification queries and the kept sets it made;
every k rounds, a refresh from the set the drafter says it holds, which crosses the link with the
round's exact KV (compress/kept_set.py `KeptSetRefresh`).

The drafter's first kept set is its prefix's stored compressed KV's, read once per prefix from the
catalog (positions only: a few hundred KB for the embedded model). A session whose drafter holds a
set this verifier no longer knows (several refreshes lost on the way) gets no refresh until its
drafts report one it knows; its recorded queries are dropped meanwhile, so they stay bounded.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from vericache.compress.kept_set import KeptPositions, KeptSetRefresh, stored_kept_positions
from vericache.compress.steering import KeptSetSteering, kept_quantizer
from vericache.kv.cache import KVCache
from vericache.kv.state import CacheState
from vericache.serve.store.catalog import PrefixRecord, compressor_of


class SteeredSessions:
    def __init__(self, compressed_state: Callable[[str], CacheState]):
        self._compressed_state = compressed_state  # a prefix's stored compressed KV, by id
        self._kept: dict[str, KeptPositions] = {}  # by prefix id: its dropper's kept positions
        self._sessions: dict[str, KeptSetSteering] = {}
        self._lock = threading.Lock()  # calls run on many threads

    def open(self, session_id: str, record: PrefixRecord, every: int) -> None:
        """Steers the session's drafter over `record`'s prefix every `every` rounds."""
        compressor = compressor_of(record)
        with self._lock:
            kept = self._kept.get(record.prefix_id)
        if kept is None:
            kept = stored_kept_positions(self._compressed_state(record.prefix_id))
            with self._lock:
                self._kept[record.prefix_id] = kept
        steering = KeptSetSteering(
            every, len(record.token_ids), compressor.observation_window, kept,
            compressor.storage_dtype, kept_quantizer(compressor),
        )  # fmt: skip
        with self._lock:
            self._sessions[session_id] = steering

    def observer(self, session_id: str) -> Callable | None:
        """The runner's hook for the session's verification queries (None: not steered)."""
        steering = self._sessions.get(session_id)
        return steering.observe if steering is not None else None

    def after_round(
        self, session_id: str, full: KVCache, drafter_version: int | None
    ) -> KeptSetRefresh | None:
        """After a verified round: the refresh for the drafter, where one is due and the set it
        holds (`drafter_version`; None: not known) is one this verifier knows; sealed."""
        steering = self._sessions.get(session_id)
        if steering is None or not steering.round_done():
            return None
        if drafter_version is None or not steering.holds(drafter_version):
            steering.drop_queries()
            return None
        return steering.plan(full, drafter_version).sealed()

    def close(self, session_id: str) -> None:
        with self._lock:
            self._sessions.pop(session_id, None)

    def forget_prefix(self, prefix_id: str) -> None:
        with self._lock:
            self._kept.pop(prefix_id, None)
