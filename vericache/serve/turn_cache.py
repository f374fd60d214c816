"""A verifier's finished turns: the exact KV after their prefix, for the next request to reuse.

An agent's next call, or a chat's next turn, repeats the one before: its prompt is that turn's
prompt and output and a few tokens more. Without this the verifier prefills the whole of it after
the prefix again, every turn. vLLM's automatic prefix caching and SGLang's radix cache keep a
finished request's KV for this; so does a verifier here. When a session closes, its full KV after
the prefix (the tokens it committed, less the newest, whose KV no forward computed) is kept with
their token ids, under its prefix and the prefix's owner, within `budget_bytes` on the worker's
device; the least recently used turn goes first. A later session over the same prefix takes the
longest leading run of its prompt after the prefix that a kept turn holds, copies that run's KV
into its cache and prefills only the rest.

Exact: full-KV prefills use the batch-invariant kernels, as decode steps and verifications do
(model/runner.py `prefill`), so a token's full KV is the same bits whichever forward computed it:
a reused run holds what the prefill it spares would have computed. A session whose tokens are not
known for certain (a call failed midway, residency.py) keeps nothing.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np

from vericache.errors import CacheStateError
from vericache.kv.exact import ExactKV


class TurnTokens:
    """A session's tokens after its prefix, in order: the prompt's, then each one committed. Its
    cache holds the KV of all but the newest, which its next call feeds. Forgotten where that is
    not known for certain (a call failed midway, or fed other tokens): then its KV is kept for no
    later turn."""

    def __init__(self, prompt_after_prefix):
        self.ids: list[int] | None = list(prompt_after_prefix)

    def feed(self, num_cached: int, pending) -> None:
        """A call feeds the session `pending`, its cache holding `num_cached` tokens after the
        prefix: they must be the history's next ones."""
        if self.ids is not None and self.ids[num_cached:] != list(pending):
            self.ids = None

    def commit(self, tokens) -> None:
        if self.ids is not None:
            self.ids.extend(tokens)

    def forget(self) -> None:
        self.ids = None

    def keep(self, turns: TurnCache, owner: Hashable, kv: ExactKV) -> None:
        """Keeps the session's KV after its prefix (`kv`, a copy of its own) as a finished turn,
        where its tokens are known."""
        if self.ids is not None and kv.num_tokens <= len(self.ids):
            turns.keep(owner, tuple(self.ids[: kv.num_tokens]), kv)


@dataclass(frozen=True)
class KeptTurn:
    token_ids: tuple[int, ...]  # [n] after the prefix
    # Their full KV, tokens [len(prefix), len(prefix) + n); None in the coordinator's index of
    # what a worker keeps.
    kv: ExactKV | None


class TurnCache:
    """A worker's kept turns; or, given `bytes_per_token` and no KV, the coordinator's index of
    them, which prices a request's prefill where its worker holds its turn before (path_costs.py)
    and which no lookup reorders."""

    def __init__(self, budget_bytes: int, bytes_per_token: int = 0):
        self.budget_bytes = budget_bytes
        self.bytes_per_token = bytes_per_token  # of an index's turns
        # By owner (a prefix's tokens and whose they are: another tenant's turns never match),
        # each owner's turns by id; and every id, least recently used first.
        self._by_owner: dict[Hashable, dict[int, KeptTurn]] = {}
        self._order: OrderedDict[int, Hashable] = OrderedDict()
        self._next_id = 0
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._order)

    def keep(self, owner: Hashable, token_ids: tuple[int, ...], kv: ExactKV | None = None) -> None:
        """Keeps a finished session's turn (its KV a copy of its own): turns it extends go, the
        least recently used ones too while the budget is exceeded."""
        if kv is not None and len(token_ids) != kv.num_tokens:
            raise CacheStateError(
                f"{len(token_ids)} token ids for exact KV of {kv.num_tokens} tokens"
            )
        nbytes = self._nbytes(KeptTurn(token_ids, kv))
        if not token_ids or nbytes > self.budget_bytes:
            return
        with self._lock:
            for turn_id, turn in list(self._by_owner.get(owner, {}).items()):
                if token_ids[: len(turn.token_ids)] == turn.token_ids:
                    self._drop(turn_id)
            self._by_owner.setdefault(owner, {})[self._next_id] = KeptTurn(token_ids, kv)
            self._order[self._next_id] = owner
            self._next_id += 1
            self._bytes += nbytes
            while self._bytes > self.budget_bytes:
                self._drop(next(iter(self._order)))

    def match(self, owner: Hashable, token_ids: tuple[int, ...]) -> ExactKV | None:
        """The KV of the longest leading run of `token_ids` (a prompt after its prefix) that a
        kept turn of `owner` holds, short of its last token, whose logits choose the next one;
        None where no turn shares its first token. The turn is now the most recently used."""
        with self._lock:
            best_id, best_run = self._longest(owner, token_ids)
            if best_id is None:
                return None
            self._order.move_to_end(best_id)
            return self._by_owner[owner][best_id].kv.head(best_run)

    def reusable(self, owner: Hashable, token_ids: tuple[int, ...]) -> int:
        """How many of `token_ids` `match` would give the KV of (no turn reordered)."""
        with self._lock:
            return self._longest(owner, token_ids)[1]

    def _longest(self, owner: Hashable, token_ids: tuple[int, ...]) -> tuple[int | None, int]:
        wanted = np.asarray(token_ids[:-1], dtype=np.int64)
        best_id, best_run = None, 0
        for turn_id, turn in self._by_owner.get(owner, {}).items():
            run = _common_run(wanted, turn.token_ids)
            if run > best_run:
                best_id, best_run = turn_id, run
        return best_id, best_run

    def _nbytes(self, turn: KeptTurn) -> int:
        return turn.kv.nbytes if turn.kv is not None else len(turn.token_ids) * self.bytes_per_token

    def _drop(self, turn_id: int) -> None:
        owner = self._order.pop(turn_id)
        turns = self._by_owner[owner]
        self._bytes -= self._nbytes(turns.pop(turn_id))
        if not turns:
            del self._by_owner[owner]


def _common_run(wanted: np.ndarray, kept: tuple[int, ...]) -> int:
    """How many leading tokens `wanted` and `kept` share."""
    size = min(len(wanted), len(kept))
    if size == 0:
        return 0
    differs = np.flatnonzero(wanted[:size] != np.asarray(kept[:size], dtype=np.int64))
    return int(differs[0]) if differs.size else size
