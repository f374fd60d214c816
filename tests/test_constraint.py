"""Constrained decoding (engine/constraint.py): every mode chooses every token under the grammar's
mask, so the output follows the grammar, and VeriCache's output under a constraint is full
decoding's under it, token for token, greedy, seeded and across the long-context engine; drafts
never leave the grammar; a bad grammar is a clear error."""

from __future__ import annotations

import json

import pytest

from vericache.compress import StreamingLLM
from vericache.engine.constraint import TokenConstraint, grammar_of
from vericache.engine.engine import Engine
from vericache.engine.long_context import LongContextEngine
from vericache.engine.long_context_config import LongContextConfig
from vericache.engine.request import DecodeMode, OutputConstraint, Request, SamplingParams
from vericache.errors import InvalidRequestError
from vericache.model.loader import load_model
from vericache.model.runner import ModelRunner

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
        "metric": {"type": "boolean"},
    },
    "required": ["city", "days", "metric"],
    "additionalProperties": False,
}
PROMPT = "Give the forecast request as JSON."


@pytest.fixture(scope="module")
def model(tiny_chat_checkpoint):
    return load_model(str(tiny_chat_checkpoint))


@pytest.fixture(scope="module")
def engines(model):
    runner = ModelRunner(model.config, model.weights)
    engine = Engine(runner, model.tokenizer)
    long_context = LongContextEngine(runner, model.tokenizer, long_context=LongContextConfig())
    yield engine, long_context
    long_context.close()


def _request(model, mode: DecodeMode, constraint: OutputConstraint | None, **params) -> Request:
    prompt_ids = model.tokenizer.encode(PROMPT * 8, add_special_tokens=False)
    compressor = None if mode is DecodeMode.FULL else StreamingLLM(ratio=2)
    sampling = SamplingParams(max_new_tokens=64, **params)
    return Request(
        prompt_ids, len(prompt_ids) - 8, sampling, mode, compressor, 4, constraint=constraint
    )


@pytest.mark.parametrize(
    "params", [{}, {"temperature": 0.9, "seed": 5}, {"temperature": 1.3, "seed": 11, "top_k": 50}]
)
def test_vericache_under_a_schema_is_full_decoding_under_it(model, engines, params):
    engine, long_context = engines
    constraint = OutputConstraint("json_schema", json.dumps(SCHEMA))
    full, vericache, lossy = (
        engine.generate([_request(model, mode, constraint, **params)])[0]
        for mode in (DecodeMode.FULL, DecodeMode.VERICACHE, DecodeMode.LOSSY)
    )
    assert vericache.token_ids == full.token_ids and vericache.text == full.text
    (long,) = long_context.generate([_request(model, DecodeMode.VERICACHE, constraint, **params)])
    assert long.token_ids == full.token_ids
    for output in (full, lossy):  # lossy too: the grammar binds every mode's choices
        if output.finish_reason == "stop":
            value = json.loads(output.text)
            assert set(value) == {"city", "days", "metric"} and 1 <= value["days"] <= 9
        else:  # the budget ended it: a prefix of a valid document
            assert output.text.startswith("{")
    unconstrained = engine.generate([_request(model, DecodeMode.FULL, None, **params)])[0]
    assert unconstrained.token_ids != full.token_ids  # the mask changed what the model says


def test_rejection_coupling_drafts_and_verifies_under_the_mask(model, engines):
    engine, _ = engines
    constraint = OutputConstraint("regex", "(yes|no), [0-9]{2}")
    params = {"temperature": 1.0, "seed": 3, "coupling": "rejection"}
    (output,) = engine.generate([_request(model, DecodeMode.VERICACHE, constraint, **params)])
    assert output.finish_reason == "stop"
    text = output.text
    assert text.split(", ")[0] in {"yes", "no"} and text.split(", ")[1].isdigit()


def test_masks_follow_the_drafts_a_verification_feeds(model):
    constraint = TokenConstraint.build(
        OutputConstraint("regex", "ab+c"), model.tokenizer, model.config.vocab_size,
        frozenset(model.config.eos_token_ids),
    )  # fmt: skip
    encode = model.tokenizer.convert_tokens_to_ids
    a, b, c = encode("a"), encode("b"), encode("c")
    masks = constraint.masks([], [a, b, b], 4)
    assert masks[0][a] and not masks[0][b]  # first: only "a"
    assert masks[1][b] and not masks[1][c]  # after "a": "b"
    assert masks[2][b] and masks[2][c]  # after "ab": more b, or the end of it
    assert masks[3][c]
    # Nothing was consumed for good: the committed state is the start still.
    again = constraint.masks([], [], 1)
    assert bool(again[0][a]) and not bool(again[0][b])
    # A row past a forbidden draft keeps the mask before it (it cannot be accepted anyway).
    past = constraint.masks([], [c, a], 3)
    assert (past[1] == past[0]).all() and (past[2] == past[0]).all()


def test_a_draft_that_ends_the_grammar_and_the_output_leaves_the_state_as_it_was(model):
    # The end token after a finished grammar is never consumed: a stopped grammar refuses it
    # one token at a time, and a state left refusing would let only the end through later.
    eos = model.config.eos_token_ids[0]
    constraint = TokenConstraint.build(
        OutputConstraint("regex", "ab"), model.tokenizer, model.config.vocab_size,
        frozenset(model.config.eos_token_ids),
    )  # fmt: skip
    encode = model.tokenizer.convert_tokens_to_ids
    a, b = encode("a"), encode("b")
    constraint.masks([], [a, b, eos], 4)
    constraint.commit([a])
    masks = constraint.masks([], [b, eos], 3)
    assert masks[0][b] and not masks[0][eos]  # "b" still to come
    assert masks[1][eos] and masks[1].sum() == 1  # then the end alone
    constraint.commit([b, eos])
    assert constraint.output == [a, b, eos]


@pytest.mark.parametrize(
    "constraint, words",
    [
        (OutputConstraint("json_schema", '{"type": "objectx"}'), "objectx"),
        (OutputConstraint("json_schema", "not json"), "json_schema is not valid"),
        (OutputConstraint("lark", "start: undefined_rule"), "cannot be compiled"),
    ],
)
def test_a_bad_grammar_is_a_clear_error(constraint, words):
    with pytest.raises(InvalidRequestError, match=words):
        grammar_of(constraint)


def test_a_constraint_must_name_a_known_kind_and_its_spec():
    with pytest.raises(InvalidRequestError, match="one of"):
        OutputConstraint("yaml", "a: b")
    with pytest.raises(InvalidRequestError, match="needs its regex"):
        OutputConstraint("regex")
    assert OutputConstraint("json_object").spec == ""
