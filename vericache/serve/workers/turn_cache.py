"""A worker's finished turns: the exact KV after their prefix, for the next request to reuse.

An agent's next call, or a chat's next turn, repeats the one before: its prompt is that turn's
prompt and output and a few tokens more. Without this the worker prefills the whole of it after
the prefix again, every turn. vLLM's automatic prefix caching and SGLang's radix cache keep a
finished request's KV for this; so do the workers here: a verifier's sessions, a drafter's
FULL_REMOTE ones. When a session closes, its full KV after the prefix (the tokens it committed,
less the newest, whose KV no forward computed) is kept with their token ids, under its prefix and
the prefix's owner, within a budget on the worker's device; the least recently used turn goes
first, to host memory where the worker has a budget there. A later session over the same prefix
takes the longest leading run of its prompt after the prefix that a kept turn holds, copies that
run's KV into its cache and prefills only the rest. The coordinator keeps an index of the same
(no KV) to price and place a request where its turn before lies (path_costs.py).

Exact: full-KV prefills use the batch-invariant kernels, as decode steps and verifications do
(model/runner.py `prefill`), so a token's full KV is the same bits whichever forward computed it:
a reused run holds what the prefill it spares would have computed. A session whose tokens are not
known for certain (a call failed midway, or fed other tokens than its history's) keeps nothing.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import numpy as np

from vericache.errors import CacheStateError
from vericache.kv.cache import KVCache
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
        prefix: they must be the history's next ones, or its first told (a session opened over
        the tokens before them: a warm node's, warm_node.py)."""
        if self.ids is None:
            return
        if len(self.ids) == num_cached:
            self.ids.extend(pending)
        elif self.ids[num_cached:] != list(pending):
            self.ids = None

    def commit(self, tokens) -> None:
        if self.ids is not None:
            self.ids.extend(tokens)

    def forget(self) -> None:
        self.ids = None

    def keep_cache(
        self, turns: TurnCache, owner: Hashable, cache: KVCache, num_prefix: int
    ) -> None:
        """`keep` of the session's `cache`, which holds its prefix's `num_prefix` tokens first."""
        self.keep(turns, owner, lambda: ExactKV.of(cache, num_prefix, cache.num_tokens))

    def keep(self, turns: TurnCache, owner: Hashable, kv_of: Callable[[], ExactKV]) -> None:
        """Keeps the session's KV after its prefix (`kv_of()`, a copy of its own) as a finished
        turn, where its tokens are known; copied only then, and where `turns` keeps any."""
        if self.ids is None or not turns.keeps_any:
            return
        kv = kv_of()
        if kv.num_tokens <= len(self.ids):
            turns.keep(owner, tuple(self.ids[: kv.num_tokens]), kv)


@dataclass(frozen=True)
class KeptTurn:
    token_ids: tuple[int, ...]  # [n] after the prefix
    # Their full KV, tokens [len(prefix), len(prefix) + n); None in the coordinator's index of
    # what a worker keeps.
    kv: ExactKV | None


@dataclass
class _Tier:
    """Where kept turns lie: the worker's device, or its host memory."""

    budget_bytes: int
    nbytes: int = 0
    order: OrderedDict[int, Hashable] = field(default_factory=OrderedDict)  # ids, LRU first


class TurnCache:
    """A worker's kept turns on its device (`budget_bytes`), and where `host_bytes` allows, those
    the device's budget pushed out in host memory (pinned on CUDA), each read back over the host
    link into the session that reuses it: as LMCache offloads a full-KV server's finished KV.
    Given `bytes_per_token` and no KV, the coordinator's index of what a worker keeps, which
    prices a request's prefill where its worker holds the turn before (path_costs.py)."""

    def __init__(self, budget_bytes: int, bytes_per_token: int = 0, host_bytes: int = 0):
        self.bytes_per_token = bytes_per_token  # of an index's turns
        self._device, self._host = _Tier(budget_bytes), _Tier(host_bytes)
        # By owner (a prefix's tokens and whose they are: another tenant's turns never match),
        # each owner's turns by id.
        self._by_owner: dict[Hashable, dict[int, KeptTurn]] = {}
        self._next_id = 0
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        return self._device.nbytes + self._host.nbytes

    @property
    def keeps_any(self) -> bool:
        """Whether it has a budget at all (every turn passes through the device's)."""
        return self._device.budget_bytes > 0

    def __len__(self) -> int:
        return len(self._device.order) + len(self._host.order)

    def keep(self, owner: Hashable, token_ids: tuple[int, ...], kv: ExactKV | None = None) -> None:
        """Keeps a finished session's turn (its KV a copy of its own): turns it extends go; the
        least recently used ones move to host memory while the device's budget is exceeded, and
        go while the host's is."""
        if kv is not None and len(token_ids) != kv.num_tokens:
            raise CacheStateError(
                f"{len(token_ids)} token ids for exact KV of {kv.num_tokens} tokens"
            )
        turn = KeptTurn(token_ids, kv)
        if not token_ids or self._nbytes(turn) > self._device.budget_bytes:
            return
        with self._lock:
            for turn_id, kept in list(self._by_owner.get(owner, {}).items()):
                if token_ids[: len(kept.token_ids)] == kept.token_ids:
                    self._drop(turn_id)
            self._by_owner.setdefault(owner, {})[self._next_id] = turn
            self._device.order[self._next_id] = owner
            self._device.nbytes += self._nbytes(turn)
            self._next_id += 1
            while self._device.nbytes > self._device.budget_bytes:
                self._spill(next(iter(self._device.order)))
            while self._host.nbytes > self._host.budget_bytes:
                self._drop(next(iter(self._host.order)))

    def match(self, owner: Hashable, token_ids: tuple[int, ...]) -> ExactKV | None:
        """The KV of the longest leading run of `token_ids` (a prompt after its prefix) that a
        kept turn of `owner` holds, short of its last token, whose logits choose the next one;
        None where no turn shares its first token. The turn is now the most recently used."""
        with self._lock:
            best_id, best_run = self._longest(owner, token_ids)
            if best_id is None:
                return None
            self._tier_of(best_id).order.move_to_end(best_id)
            return self._by_owner[owner][best_id].kv.head(best_run)

    def reuse_into(self, owner: Hashable, token_ids: tuple[int, ...], cache: KVCache) -> int:
        """Appends to `cache` (over the prefix) the KV `match` gives for `token_ids`; how many
        tokens that is (0: none kept). Never all of them: the last is left to prefill."""
        kept = self.match(owner, token_ids)
        if kept is None:
            return 0
        cache.append_exact(kept)
        return kept.num_tokens

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

    def _tier_of(self, turn_id: int) -> _Tier:
        return self._device if turn_id in self._device.order else self._host

    def _spill(self, turn_id: int) -> None:
        """The turn from the device to host memory, where that has room for it; else gone."""
        owner = self._device.order[turn_id]
        turn = self._by_owner[owner][turn_id]
        nbytes = self._nbytes(turn)
        if nbytes > self._host.budget_bytes:
            self._drop(turn_id)
            return
        del self._device.order[turn_id]
        self._device.nbytes -= nbytes
        kv = turn.kv.to_host() if turn.kv is not None else None
        self._by_owner[owner][turn_id] = KeptTurn(turn.token_ids, kv)
        self._host.order[turn_id] = owner
        self._host.nbytes += nbytes

    def _drop(self, turn_id: int) -> None:
        tier = self._tier_of(turn_id)
        owner = tier.order.pop(turn_id)
        turns = self._by_owner[owner]
        tier.nbytes -= self._nbytes(turns.pop(turn_id))
        if not turns:
            del self._by_owner[owner]


def _common_run(wanted: np.ndarray, kept: tuple[int, ...]) -> int:
    """How many leading tokens `wanted` and `kept` share."""
    size = min(len(wanted), len(kept))
    if size == 0:
        return 0
    differs = np.flatnonzero(wanted[:size] != np.asarray(kept[:size], dtype=np.int64))
    return int(differs[0]) if differs.size else size
