"""One round, four drivers: a table of cases runs every mode through the in-process engine, the
long-context engine and the served system (per-request and scheduled rounds), and each mode must
give the same tokens, text and finish reason wherever it runs; every exact mode (full, vericache,
full_local, full_remote) must give the full-KV reference.

The cases are where the copies of a round used to drift: prompts ending 1..x+1 tokens before the
model's context, token budgets that end inside a draft, a stop string across a round boundary and
an end token inside a draft.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from tests.serve_fixtures import open_sessions, start_server, wait_for
from vericache.client import Client
from vericache.compress import StreamingLLM
from vericache.engine.engine import Engine
from vericache.engine.long_context import LongContextEngine
from vericache.engine.long_context_config import LongContextConfig
from vericache.engine.request import DecodeMode, Request, SamplingParams
from vericache.model.loader import load_model
from vericache.model.runner import ModelRunner
from vericache.serve.config import CoordinatorConfig

X = 4  # draft length
PROMPT = "Which function multiplies by three?"
NUM_PREFIX_TOKENS = 300
# Keeping every token drafts almost exactly (full rounds of accepted drafts); keeping 80% drafts
# worse (rounds of every length, most rejected at once).
COMPRESSORS = {"keep-all": 1.0, "keep-80%": 1.25}
ENGINE_MODES = (DecodeMode.FULL, DecodeMode.VERICACHE, DecodeMode.LOSSY)
LONG_CONTEXT_MODES = (DecodeMode.FULL, DecodeMode.VERICACHE)
SERVED_MODES = ("full_local", "full_remote", "vericache", "lossy")
EXACT_MODES = {"full", "vericache", "full_local", "full_remote"}


@dataclass(frozen=True)
class Case:
    name: str
    max_tokens: int
    num_prefix_tokens: int = NUM_PREFIX_TOKENS  # the prompt is the prefix, then PROMPT
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class Outcome:
    token_ids: tuple[int, ...]
    finish_reason: str
    text: str


@pytest.fixture(scope="module")
def model(tiny_chat_checkpoint):
    return load_model(str(tiny_chat_checkpoint))


@pytest.fixture(scope="module")
def prefix_tokens(model) -> list[int]:
    """A repeating stretch of the vocabulary, as long as the context allows."""
    period = random.Random(0).choices(range(1000, 40000), k=40)
    return (period * model.config.max_position_embeddings)[: model.config.max_position_embeddings]


@pytest.fixture(scope="module")
def drivers(model, tiny_chat_checkpoint, tmp_path_factory):
    runner = ModelRunner(model.config, model.weights)
    engine = Engine(runner, model.tokenizer)
    long_context = LongContextEngine(runner, model.tokenizer, long_context=LongContextConfig())
    servers = {
        scheduling: start_server(
            tiny_chat_checkpoint,
            tmp_path_factory.mktemp(scheduling),
            num_drafters=1,
            config=CoordinatorConfig(default_draft_len=X, scheduling=scheduling),
        )
        for scheduling in ("per-request", "staggered")
    }
    clients = {name: Client(server.target, timeout=120) for name, server in servers.items()}
    yield engine, long_context, clients
    for client in clients.values():
        client.close()
    for server in servers.values():
        assert wait_for(lambda s=server: open_sessions(s) == 0)
        server.stop()
    long_context.close()


def run_everywhere(drivers, model, prefix_tokens, case: Case, ratio: float) -> dict:
    """(driver, mode) -> Outcome of the case on every driver that runs the mode."""
    engine, long_context, clients = drivers
    prefix = prefix_tokens[: case.num_prefix_tokens]
    prompt_ids = [*prefix, *model.tokenizer.encode(PROMPT, add_special_tokens=False)]
    params = SamplingParams(case.max_tokens, stop=case.stop, stop_token_ids=case.stop_token_ids)

    def request(mode: DecodeMode) -> Request:
        compressor = None if mode is DecodeMode.FULL else StreamingLLM(ratio=ratio)
        return Request(prompt_ids, len(prefix), params, mode, compressor, X)

    outcomes = {}
    for mode in ENGINE_MODES:
        (output,) = engine.generate([request(mode)])
        outcomes["engine", mode.value] = _outcome(output)
    for mode in LONG_CONTEXT_MODES:
        (output,) = long_context.generate([request(mode)])
        outcomes["long-context", mode.value] = _outcome(output)
    for scheduling, client in clients.items():
        prefix_id = client.put_prefix(token_ids=prefix, compressor="streamingllm", ratio=ratio)
        for mode in SERVED_MODES:
            result = client.generate(
                PROMPT, prefix_id=prefix_id, mode=mode, max_tokens=case.max_tokens,
                stop=case.stop, stop_token_ids=case.stop_token_ids, draft_len=X,
            )  # fmt: skip
            outcomes[f"served {scheduling}", mode] = _outcome(result)
    return outcomes


def _outcome(result) -> Outcome:
    return Outcome(tuple(result.token_ids), result.finish_reason, result.text)


def assert_drivers_agree(outcomes: dict) -> Outcome:
    """Every exact mode gives the engine's full-KV output, and lossy the same on every driver."""
    reference = outcomes["engine", "full"]
    for (driver, mode), outcome in outcomes.items():
        expected = reference if mode in EXACT_MODES else outcomes["engine", "lossy"]
        assert outcome == expected, f"{mode} on {driver}"
    return reference


def fixed_cases(model) -> list[Case]:
    limit = model.config.max_position_embeddings
    num_prompt = NUM_PREFIX_TOKENS + len(model.tokenizer.encode(PROMPT, add_special_tokens=False))
    cases = [
        Case("a budget that ends inside the second round's draft", max_tokens=X + 3),
        Case("a budget of one token", max_tokens=1),
        Case("a budget of exactly two rounds", max_tokens=2 * (X + 1) + 1),
    ]
    for room in range(1, X + 2):  # prompts ending 1..x+1 tokens before the context's end
        prefix = NUM_PREFIX_TOKENS + limit - num_prompt - room
        cases.append(Case(f"{room} tokens of context left", 40, num_prefix_tokens=prefix))
    return cases


CASE_COUNT = 3 + X + 1


@pytest.mark.parametrize("ratio", COMPRESSORS.values(), ids=COMPRESSORS.keys())
@pytest.mark.parametrize("index", range(CASE_COUNT))
def test_every_driver_stops_where_full_decoding_stops(drivers, model, prefix_tokens, ratio, index):
    case = fixed_cases(model)[index]
    reference = assert_drivers_agree(run_everywhere(drivers, model, prefix_tokens, case, ratio))
    assert reference.finish_reason == "length", case.name
    num_prompt = case.num_prefix_tokens + len(
        model.tokenizer.encode(PROMPT, add_special_tokens=False)
    )
    room = model.config.max_position_embeddings - num_prompt
    assert len(reference.token_ids) == min(case.max_tokens, room), case.name


@pytest.fixture(scope="module")
def rounds(drivers, model, prefix_tokens) -> dict:
    """Per compressor: the reference output without stops, and where each of its rounds begins
    (output indices), as the in-process engine ran them."""
    engine = drivers[0]
    prompt_ids = [
        *prefix_tokens[:NUM_PREFIX_TOKENS],
        *model.tokenizer.encode(PROMPT, add_special_tokens=False),
    ]
    found = {}
    for name, ratio in COMPRESSORS.items():
        params = SamplingParams(40)
        request = Request(
            prompt_ids, NUM_PREFIX_TOKENS, params, compressor=StreamingLLM(ratio=ratio), draft_len=X
        )
        (output,) = engine.generate([request])
        starts, position = [], 1  # the prefill chooses output token 0
        for accepted in output.stats.accepted_per_round:
            starts.append(position)
            position += accepted + 1
        found[name] = (output, starts)
    return found


def _stop_string_across_a_boundary(tokenizer, token_ids, starts) -> tuple[str, int]:
    """A stop string whose first occurrence spans the end of one round and the start of the
    next: (the string, the round boundary's output index)."""
    text = tokenizer.decode(token_ids, skip_special_tokens=True)
    for boundary in starts[1:]:
        cut = len(tokenizer.decode(token_ids[:boundary], skip_special_tokens=True))
        for before, after in ((1, 1), (2, 2), (3, 3)):
            stop = text[cut - before : cut + after]
            if len(stop) == before + after and text.find(stop) == cut - before:
                return stop, boundary
    raise AssertionError("no stop string spans a round boundary uniquely")


@pytest.mark.parametrize("name", COMPRESSORS)
def test_a_stop_string_across_a_round_boundary(drivers, model, prefix_tokens, rounds, name):
    output, starts = rounds[name]
    stop, boundary = _stop_string_across_a_boundary(model.tokenizer, output.token_ids, starts)
    case = Case("a stop string across a round boundary", 40, stop=(stop,))
    reference = assert_drivers_agree(
        run_everywhere(drivers, model, prefix_tokens, case, COMPRESSORS[name])
    )
    assert reference.finish_reason == "stop"
    # The text ends before the stop string, which the round after the boundary completed.
    assert len(reference.token_ids) > boundary and stop not in reference.text
    assert output.text.startswith(reference.text + stop)


@pytest.mark.parametrize("name", COMPRESSORS)
def test_an_end_token_inside_a_draft(drivers, model, prefix_tokens, rounds, name):
    output, starts = rounds[name]
    accepted = output.stats.accepted_per_round
    # An accepted draft token that the output has not chosen before: the drafter drafts it, the
    # verifier accepts it, and the request ends there in every driver.
    positions = [
        start + offset
        for start, num in zip(starts, accepted)
        for offset in range(num)
        if output.token_ids[start + offset] not in output.token_ids[: start + offset]
    ]
    assert positions, "no accepted draft to end on"
    position = positions[len(positions) // 2]
    end_token = output.token_ids[position]
    case = Case("an end token inside a draft", 40, stop_token_ids=(end_token,))
    reference = assert_drivers_agree(
        run_everywhere(drivers, model, prefix_tokens, case, COMPRESSORS[name])
    )
    assert reference.finish_reason == "stop"
    assert reference.token_ids == tuple(output.token_ids[: position + 1])
