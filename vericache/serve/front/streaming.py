"""The Generate stream of a served request: a chunk per batch of committed tokens, with the text
they add, then the summary."""

from __future__ import annotations

from collections.abc import AsyncIterator

from vericache.engine.stops import StopChecker
from vericache.serve.api_types import GenerateEvent, OutputChunk
from vericache.serve.backends.rounds import ServedRequest


async def stream_events(
    served: ServedRequest, rounds: AsyncIterator[list[int]]
) -> AsyncIterator[GenerateEvent]:
    """A chunk per batch of committed tokens (with the text they add), the text held back until
    the end, then the summary."""
    seq = served.seq
    text = TextDeltas(seq.stop_checker)
    async for tokens in rounds:
        if tokens:
            # The sequence's log-probabilities follow its output token for token.
            logprobs = (
                tuple(seq.logprobs[len(seq.logprobs) - len(tokens) :]) if seq.logprobs else ()
            )
            yield OutputChunk(text.delta(seq.output_ids), tuple(tokens), logprobs)
    tail = text.delta(seq.output_ids, final=True)
    if tail:
        yield OutputChunk(tail, ())
    yield served.summary()


class TextDeltas:
    """The text each chunk adds. Held back until certain: a token that ends inside a multi-byte
    character decodes to U+FFFD until the next one completes it, and text that may begin a stop
    string is cut if the stop string completes (as vLLM holds back len(stop) - 1 characters)."""

    def __init__(self, checker: StopChecker):
        self.checker = checker
        self.hold_back = max((len(stop) - 1 for stop in checker.params.stop), default=0)
        self.sent = 0

    def delta(self, output_ids: list[int], final: bool = False) -> str:
        text = self.checker.output_text(output_ids) or ""
        if not final:
            text = text.rstrip("\ufffd")
            text = text[: len(text) - self.hold_back]
        new, self.sent = text[self.sent :], max(self.sent, len(text))
        return new
