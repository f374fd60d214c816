"""When a sequence ends. Every mode feeds its output through the same checker one token at a time,
so `vericache` stops at exactly the token where `full` stops, even inside a draft."""

from __future__ import annotations

from vericache.engine.request import SamplingParams
from vericache.errors import InvalidRequestError


class StopChecker:
    def __init__(
        self,
        params: SamplingParams,
        eos_token_ids: tuple[int, ...],
        max_total_tokens: int,
        tokenizer=None,
    ):
        self.params = params
        self.end_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            self.end_ids |= set(eos_token_ids)
        self.max_total_tokens = max_total_tokens
        self.tokenizer = tokenizer
        self.stop_text_end: int | None = None  # where the text is cut for a stop string
        if params.stop and tokenizer is None:
            raise InvalidRequestError("stop strings need a model with a tokenizer")

    def finish_reason(self, output_ids: list[int], num_total_tokens: int) -> str | None:
        """Checks the newest output token; returns "stop", "length" or None (go on)."""
        if output_ids[-1] in self.end_ids:
            return "stop"
        if self.params.stop and self._ends_in_stop_string(output_ids):
            return "stop"
        if (
            len(output_ids) >= self.params.max_new_tokens
            or num_total_tokens >= self.max_total_tokens
        ):
            return "length"
        return None

    def _ends_in_stop_string(self, output_ids: list[int]) -> bool:
        text = self.tokenizer.decode(output_ids, skip_special_tokens=True)
        # Only a match that the newest token completed; older text was checked before.
        longest = max(len(s) for s in self.params.stop)
        previous = self.tokenizer.decode(output_ids[:-1], skip_special_tokens=True)
        search_from = max(0, len(previous) - longest + 1)
        hits = [i for s in self.params.stop if (i := text.find(s, search_from)) >= 0]
        if hits:
            self.stop_text_end = min(hits)
            return True
        return False

    def output_text(self, output_ids: list[int]) -> str | None:
        if self.tokenizer is None:
            return None
        text = self.tokenizer.decode(output_ids, skip_special_tokens=True)
        return text if self.stop_text_end is None else text[: self.stop_text_end]
