"""Constrained decoding: a grammar over a request's output (`OutputConstraint`: a JSON schema, any
JSON object, a Lark grammar or a regular expression), compiled by llguidance, as a mask over the
vocabulary at each position.

Every choice of a constrained sequence is made under the mask of the grammar's state after the
tokens before it: a full decode step's after the committed output, a draft step's after the
output and the round's drafts so far, and each position of a verification after the output and
the drafts before that position. The verifier's choice at a position is then the one full
decoding makes after the same tokens, so the output under a constraint is constrained full-KV
decoding's, token for token, under greedy and seeded sampling alike; under rejection coupling the
draft and verifier distributions are both masked. Drafts never leave the grammar: they are chosen
under its masks too. Where the grammar admits no token (it is exhausted and forbids even the end),
the mask admits the end tokens alone: the output stops, with a logged warning, and never takes a
forbidden token.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterable, Sequence

import numpy as np
import torch

from vericache.engine.request import GrammarState, OutputConstraint
from vericache.errors import InvalidRequestError

log = logging.getLogger(__name__)

# JSON as json.dumps writes it, with no whitespace beyond its separators: a model may not pad a
# document with whitespace forever (flexible whitespace lets a weak one do just that), and the
# output is one text whatever the model would have spaced.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# (id(tokenizer), vocab size) -> (the tokenizer, its llguidance tokenizer: about 0.5 s to build).
# The entry holds the tokenizer itself, so that its id cannot be reused by another while cached.
_TOKENIZERS: dict[tuple[int, int], tuple[object, object]] = {}
_TOKENIZERS_LOCK = threading.Lock()


def _llguidance_tokenizer(tokenizer, vocab_size: int):
    import llguidance.hf

    key = (id(tokenizer), vocab_size)
    with _TOKENIZERS_LOCK:
        if key not in _TOKENIZERS:
            built = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
            _TOKENIZERS[key] = (tokenizer, built)
        return _TOKENIZERS[key][1]


def grammar_of(constraint: OutputConstraint) -> str:
    """The llguidance grammar of a constraint, checked: a bad one is an InvalidRequestError
    naming what is wrong."""
    from llguidance import LLMatcher

    try:
        if constraint.kind == "json_schema":
            schema = json.loads(constraint.spec)
            if not isinstance(schema, dict):
                raise ValueError("a schema is a JSON object")
            grammar = LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        elif constraint.kind == "json_object":
            grammar = LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        elif constraint.kind == "lark":
            grammar = LLMatcher.grammar_from_lark(constraint.spec)
        else:
            grammar = LLMatcher.grammar_from_regex(constraint.spec)
    except ValueError as exc:  # json.JSONDecodeError among them
        raise InvalidRequestError(f"the {constraint.kind} is not valid: {exc}") from None
    error = LLMatcher.validate_grammar(grammar)
    if error:
        raise InvalidRequestError(f"the {constraint.kind} cannot be compiled: {error}")
    return grammar


class TokenConstraint:
    """One sequence's grammar state: the committed output consumed, masks computed ahead of it."""

    def __init__(
        self,
        new_matcher: Callable[[], object],
        vocab_size: int,
        end_ids: frozenset[int],
        matcher: object | None = None,
    ):
        self._new_matcher = new_matcher  # a fresh grammar state, from the start of the output
        self._matcher = matcher or new_matcher()
        self.vocab_size = vocab_size
        self.output: list[int] = []  # the committed output consumed
        self._end_ids = frozenset(end_ids)
        self._end_only = torch.zeros(vocab_size, dtype=torch.bool)
        self._end_only[[t for t in end_ids if t < vocab_size]] = True

    @classmethod
    def build(
        cls, constraint: OutputConstraint, tokenizer, vocab_size: int, end_ids: frozenset[int]
    ) -> TokenConstraint:
        from llguidance import LLMatcher

        if tokenizer is None:
            raise InvalidRequestError("a constrained output needs the model's tokenizer")
        grammar = grammar_of(constraint)
        llg_tokenizer = _llguidance_tokenizer(tokenizer, vocab_size)

        def new_matcher():
            return LLMatcher(llg_tokenizer, grammar, log_level=0)

        matcher = new_matcher()
        if matcher.is_error():
            error = matcher.get_error()
            raise InvalidRequestError(f"the {constraint.kind} cannot be used: {error}")
        return cls(new_matcher, vocab_size, end_ids, matcher)

    def commit(self, tokens: Sequence[int]) -> None:
        """Consumes committed output tokens (each chosen under its mask)."""
        tokens = list(tokens)
        self._consume(self._before_end(tokens))
        self.output += tokens

    def _consume(self, tokens: list[int]) -> None:
        matcher = self._matcher
        num_valid = matcher.validate_tokens(tokens)
        if num_valid < len(tokens):
            log.warning("a committed token leaves the output's grammar: the output ends there")
        matcher.consume_tokens(tokens[:num_valid])

    def _before_end(self, tokens: list[int]) -> list[int]:
        """`tokens` up to their first end token: an end token ends the output and is never
        consumed (a grammar that has stopped refuses to consume it one at a time)."""
        for index, token in enumerate(tokens):
            if token in self._end_ids:
                return tokens[:index]
        return tokens

    def follow(self, output: Sequence[int]) -> None:
        """Brings the state to `output` (a worker's, from each call): the tokens committed since
        the last call consumed; another output (a request gone on elsewhere) from the start."""
        done = len(self.output)
        if tuple(output[:done]) != tuple(self.output):
            self._matcher = self._new_matcher()
            self.output, done = [], 0
        self.commit(output[done:])

    def masks(self, path: Sequence[int], row_tokens: Sequence[int], num_rows: int) -> torch.Tensor:
        """[num_rows, V] the tokens allowed at each of a forward's rows: row 0 after the committed
        output and `path` (a draft's earlier drafts), row i after `row_tokens[:i]` too (the
        drafts a verification feeds). Rows past a token the grammar forbids (which no masked
        choice makes) get the mask before it: they cannot be accepted."""
        matcher = self._matcher
        ahead = self._before_end([*path, *row_tokens[: num_rows - 1]])
        num_valid = matcher.validate_tokens(ahead)
        consumed = 0
        rows = []
        try:
            for i in range(num_rows):
                reachable = len(path) + i
                if reachable <= num_valid and consumed < reachable:
                    matcher.consume_tokens(ahead[consumed:reachable])
                    consumed = reachable
                rows.append(self._mask())
        finally:
            if consumed and not matcher.rollback(consumed):
                self._rebuild()
        return torch.stack(rows)

    def _rebuild(self) -> None:
        """A fresh matcher brought to the committed output (where a rollback failed)."""
        log.warning("the output's grammar state could not roll back: rebuilt from the output")
        self._matcher = self._new_matcher()
        self._consume(self._before_end(self.output))

    def _mask(self) -> torch.Tensor:
        matcher = self._matcher
        if matcher.is_error():
            return self._end_only
        words = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
        allowed = np.unpackbits(words, bitorder="little")[: self.vocab_size].astype(bool)
        if not allowed.any():
            log.warning("the output's grammar admits no token: the output ends")
            return self._end_only
        return torch.from_numpy(allowed)

    def restrict(self, rows: torch.Tensor, path: Sequence[int], row_tokens: Sequence[int]):
        """`rows` [n, V] of logits with the forbidden tokens at -inf."""
        masks = self.masks(path, row_tokens, rows.shape[0]).to(rows.device)
        return rows.masked_fill(~masks, float("-inf"))


class SessionGrammars:
    """A worker's grammar state per constrained session, built at its first call and following
    the output each call carries; dropped with the session."""

    def __init__(self, tokenizer, vocab_size: int, end_ids: Iterable[int]):
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._end_ids = frozenset(end_ids)
        self._held: dict[str, tuple[OutputConstraint, TokenConstraint]] = {}
        self._lock = threading.Lock()

    def constraint(self, session_id: str, state: GrammarState | None) -> TokenConstraint | None:
        if state is None:
            return None
        with self._lock:
            held = self._held.get(session_id)
        if held is None or held[0] != state.constraint:
            built = TokenConstraint.build(
                state.constraint, self._tokenizer, self._vocab_size, self._end_ids
            )
            held = (state.constraint, built)
            with self._lock:
                self._held[session_id] = held
        held[1].follow(state.output)
        return held[1]

    def drop(self, session_id: str) -> None:
        with self._lock:
            self._held.pop(session_id, None)
