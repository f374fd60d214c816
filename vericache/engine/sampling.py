"""Sampling that speculative decoding can keep exact: seeded Gumbel-max and rejection coupling.

Seeded coupling: a position's token is argmax(processed logits / T + g), where g is Gumbel noise
drawn from a counter-based generator keyed by (seed, position in the sequence, token id). The
noise of a position is the same wherever and whenever that position is computed (in a draft
step over compressed KV, in a verification over full KV, in a full-KV decode step, in any batch),
so a verifier that accepts a draft exactly when it equals its own sample at that position, and
emits its own sample at the first mismatch, gives the tokens full-KV sampling gives with the same
seed; and argmax(x + Gumbel) is distributed as softmax(x), so those tokens follow the model's
distribution exactly.

Rejection coupling (Leviathan et al., 2023): a draft token t drawn from the drafter's q is kept
with probability min(1, p(t) / q(t)); at the first rejection the token is drawn from
norm(max(0, p - q)); after every draft kept, a bonus token from p. The output follows p exactly,
but it is not the sample full-KV decoding with the same seed would give.

Logit processing follows vLLM's definitions: repetition_penalty over the prompt and output tokens
(positive logits divided by it, negative ones multiplied), presence_penalty subtracted once from
every token already in the output, then temperature, then top-k, top-p and min-p masks. A greedy
request's token is the argmax of its penalized logits. Log-probabilities (`token_logprobs`) are
those of the processed logits a token was chosen from: vLLM's processed logprobs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vericache.engine.request import SamplingParams, TokenLogprob

_MASK32 = 0xFFFFFFFF
_UNIFORM_BITS = 24  # uniforms on a grid of 2**-24, never 0 or 1: finite Gumbel noise


def processed_logits(
    logits: torch.Tensor,
    processing: SamplingParams,
    prompt_ids: Sequence[int] = (),
    output_ids: Sequence[Sequence[int]] = (),
) -> torch.Tensor:
    """logits [n, V] of n consecutive positions -> float32 [n, V] to choose from (masked tokens
    -inf): penalized, and where the parameters sample (temperature > 0) scaled and masked.
    output_ids[i]: the output tokens before position i (penalties depend on them)."""
    x = logits.float().clone()
    for row, before in zip(x, output_ids if processing.is_penalized else ()):
        _penalize(row, processing, prompt_ids, before)
    if not processing.is_sampled:
        return x  # greedy: the argmax of the penalized logits
    x /= processing.temperature
    if processing.top_k and processing.top_k < x.shape[-1]:
        kth = x.topk(processing.top_k, dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if processing.top_p < 1:
        x = _top_p(x, processing.top_p)
    if processing.min_p > 0:
        probs = x.softmax(-1)
        floor = processing.min_p * probs.amax(-1, keepdim=True)
        x = x.masked_fill(probs < floor, float("-inf"))
    return x


def _penalize(row: torch.Tensor, processing: SamplingParams, prompt_ids, output_ids) -> None:
    seen = sorted({*prompt_ids, *output_ids})
    if processing.repetition_penalty != 1 and seen:
        seen = torch.tensor(seen, dtype=torch.long, device=row.device)
        values = row[seen]
        penalty = processing.repetition_penalty
        row[seen] = torch.where(values > 0, values / penalty, values * penalty)
    if processing.presence_penalty != 0 and output_ids:
        present = torch.tensor(sorted(set(output_ids)), dtype=torch.long, device=row.device)
        row[present] -= processing.presence_penalty


def _top_p(x: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keeps, per row, the most likely tokens until their mass reaches top_p (the token that
    crosses it included); ties in the sort go to the lower token id: a deterministic mask."""
    order = torch.sort(x, dim=-1, descending=True, stable=True)
    probs = order.values.softmax(-1)
    mass_before = probs.cumsum(-1) - probs
    dropped_sorted = mass_before >= top_p
    dropped = torch.zeros_like(dropped_sorted).scatter(-1, order.indices, dropped_sorted)
    return x.masked_fill(dropped, float("-inf"))


def gumbel_noise(seed: int, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Gumbel noise [n, V] float32 for the given positions [n] of a sequence with this seed: a
    pure function of (seed, position, token id), computed in integer arithmetic that is the same
    on every device, so any computation of a position draws the same noise."""
    device = positions.device
    tokens = torch.arange(vocab_size, dtype=torch.int64, device=device)
    low, high = seed & _MASK32, ((seed >> 32) & _MASK32) ^ 0x9E3779B9
    key = _mix(torch.tensor(low, device=device) ^ _mix(torch.tensor(high, device=device)))
    h = _mix(key ^ _mix(positions.to(torch.int64).unsqueeze(1) & _MASK32))  # [n, 1]
    h = _mix(h ^ _mix(tokens * 0x85EBCA6B & _MASK32))  # [n, V]
    uniform = ((h >> (32 - _UNIFORM_BITS)).double() + 0.5) / (1 << _UNIFORM_BITS)
    return (-torch.log(-torch.log(uniform))).float()


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (lowbias32) on int64 lanes holding values below 2**32: products keep
    their low 32 bits whatever int64 overflow does, shifts see non-negative values."""
    x = x & _MASK32
    x = ((x ^ (x >> 16)) * 0x7FEB352D) & _MASK32
    x = ((x ^ (x >> 15)) * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def seeded_sample(processed: torch.Tensor, seed: int, positions: torch.Tensor) -> torch.Tensor:
    """Gumbel-max over processed logits [n, V] at the given positions [n]: tokens [n], each
    distributed as softmax of its row, ties to the lower token id."""
    noise = gumbel_noise(seed, positions.to(processed.device), processed.shape[-1])
    return (processed + noise).argmax(-1)


def checks_by_rejection(sampler: SequenceSampler | None) -> bool:
    """Whether drafts under `sampler` are checked by rejection, which needs the drafter's
    distributions (greedy and seeded drafts are checked by equality)."""
    return sampler is not None and sampler.params.is_rejection_coupled


@dataclass(frozen=True)
class Choice:
    """Tokens chosen at consecutive positions, and the processed logits they were chosen from."""

    tokens: list[int]  # [n]
    processed: torch.Tensor  # [n, V] float32


@dataclass(frozen=True)
class SequenceSampler:
    """How one sequence chooses its tokens, wherever its rows are computed (a draft step, a
    verification, a decode step or a prefill), where that is more than a plain argmax
    (`SamplingParams.needs_sampler`): seeded sampling, penalties, reported log-probabilities.
    `history` is the output before the first row it chooses; row r of a forward then predicts
    output index len(history) + r past the tokens the job already knows, at sequence position
    len(prompt_ids) + that index."""

    params: SamplingParams
    seed: int | None  # None: greedy
    prompt_ids: tuple[int, ...]
    history: tuple[int, ...]

    def sample(
        self, rows: torch.Tensor, before: Sequence[int] = (), following: Sequence[int] = ()
    ) -> list[int]:
        """Tokens for logits rows [n, V]. before: the tokens after `history` that precede the
        first row's prediction (a stepping job's earlier choices); following: the tokens fed
        after the first row's, row r having seen following[:r] (a verification's drafts). Row r
        predicts output index len(history) + len(before) + r."""
        return self.choose(rows, before, following).tokens

    def choose(
        self, rows: torch.Tensor, before: Sequence[int] = (), following: Sequence[int] = ()
    ) -> Choice:
        """`sample`, with the processed logits the tokens were chosen from."""
        first = len(self.history) + len(before)
        seen = (*self.history, *before)
        penalized = self.params.is_penalized
        histories = [(*seen, *following[:r]) for r in range(rows.shape[0])] if penalized else ()
        processed = processed_logits(rows, self.params, self.prompt_ids, histories)
        if not self.params.is_sampled:
            return Choice(processed.argmax(-1).tolist(), processed)
        positions = len(self.prompt_ids) + first + torch.arange(rows.shape[0], device=rows.device)
        return Choice(seeded_sample(processed, self.seed, positions).tolist(), processed)

    def reported(self, processed: torch.Tensor, tokens: Sequence[int]) -> tuple[TokenLogprob, ...]:
        """The log-probabilities of `tokens` chosen from `processed` [n, V] as the request asks
        for them (`token_logprobs`); () where it asks for none."""
        num_top = self.params.logprobs
        if num_top is None:
            return ()
        return tuple(token_logprobs(processed, tokens, num_top))


def token_logprobs(
    processed: torch.Tensor, tokens: Sequence[int], num_top: int
) -> list[TokenLogprob]:
    """The log-probabilities of `tokens` [n] under processed logits [n, V] (row r chose
    tokens[r]), each with the `num_top` most likely tokens of its row (ties: the lower id)."""
    logprobs = processed.float().log_softmax(-1)  # [n, V]
    ids = torch.tensor(list(tokens), dtype=torch.long, device=logprobs.device)
    chosen = logprobs.gather(1, ids[:, None])[:, 0].tolist()
    if not num_top:
        return [TokenLogprob(token, value) for token, value in zip(tokens, chosen)]
    best = logprobs.topk(num_top, dim=-1)  # [n, k]; a full sort of each row costs 20x more
    kth = best.values[:, -1:]  # [n, 1]
    # Rows where more tokens tie with the k-th best than topk took (a grammar's mask ties every
    # forbidden token at -inf): which of them it took is its own; the lowest ids are reported.
    num_at_least = (logprobs >= kth).sum(-1).tolist()
    rows = zip(best.indices.tolist(), best.values.tolist(), num_at_least)
    reported = []
    for row, (token, value, (top_ids, top_values, at_least)) in enumerate(
        zip(tokens, chosen, rows)
    ):
        if at_least > num_top:
            top_ids, top_values = _lowest_ids_at_ties(logprobs[row], num_top, top_values[-1])
        ranked = sorted(zip(top_ids, top_values), key=lambda pair: (-pair[1], pair[0]))
        reported.append(TokenLogprob(token, value, tuple(ranked)))
    return reported


def _lowest_ids_at_ties(logprobs: torch.Tensor, num_top: int, kth: float):
    """The ids and values of a row's [V] `num_top` best tokens, the lowest ids among those tied
    with the k-th best."""
    above = (logprobs > kth).nonzero()[:, 0]
    tied = (logprobs == kth).nonzero()[:, 0][: num_top - above.numel()]
    ids = torch.cat([above, tied])
    return ids.tolist(), logprobs[ids].tolist()


@dataclass(frozen=True)
class RejectionOutcome:
    num_accepted: int  # drafts kept
    next_token: int  # the correction at the first rejection, or the bonus token after all


def rejection_sample(
    drafts: Sequence[int],
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator,
) -> RejectionOutcome:
    """Leviathan et al.'s rule for one round. drafts: [k] tokens drawn from draft_probs [k, V]
    (the drafter's distribution at each draft); target_probs: [k + 1, V] the verifier's, the last
    row after every draft. The emitted tokens follow target_probs exactly."""
    k = len(drafts)
    if draft_probs.shape[0] != k or target_probs.shape[0] != k + 1:
        raise ValueError(f"{k} drafts need [k, V] draft and [k + 1, V] target probabilities")
    uniforms = torch.rand(k, generator=generator, dtype=torch.float64)
    for i, token in enumerate(drafts):
        p, q = float(target_probs[i, token]), float(draft_probs[i, token])
        if q > 0 and uniforms[i] * q < p:  # accept with probability min(1, p / q)
            continue
        residual = (target_probs[i].double() - draft_probs[i].double()).clamp_min(0)
        if float(residual.sum()) <= 0:  # p == q: a rejection has probability zero
            residual = target_probs[i].double()
        return RejectionOutcome(i, _draw(residual, generator))
    return RejectionOutcome(k, _draw(target_probs[k].double(), generator))


@dataclass(frozen=True)
class Verdict:
    """A verification's outcome as a round commits it: the verifier's choice at each position
    (greedy and seeded coupling: after each fed token, [1 + num drafts]; rejection coupling: the
    kept drafts and the token after them), and their log-probabilities where the request asks."""

    tokens: list[int]
    logprobs: tuple[TokenLogprob, ...] = ()


def rejection_verdict(
    sampler: SequenceSampler,
    drafts: Sequence[int],
    draft_probs: torch.Tensor | None,
    target_processed: torch.Tensor,
) -> Verdict:
    """A round under rejection coupling, as the tokens a verifier would have chosen: the kept
    drafts, then the token drawn at the first rejection (never the rejected draft, whose residual
    probability is zero) or the bonus after them all. draft_probs: [k, V] (None when k = 0);
    target_processed: the verifier's processed logits [k + 1, V]. Its random numbers are the
    round's (seed, first position)."""
    target_probs = target_processed.softmax(-1)
    if draft_probs is None:
        draft_probs = target_probs[:0]
    position = len(sampler.prompt_ids) + len(sampler.history)
    generator = round_generator(sampler.seed, position)
    outcome = rejection_sample(drafts, draft_probs.to(target_probs.device), target_probs, generator)
    tokens = [*drafts[: outcome.num_accepted], outcome.next_token]
    return Verdict(tokens, sampler.reported(target_processed[: len(tokens)], tokens))


def round_generator(seed: int, position: int) -> torch.Generator:
    """The random numbers of one round's rejection coupling: a function of the request's seed
    and the round's first position, so the same seed gives the same output."""
    key = int(_mix(torch.tensor(seed & _MASK32) ^ _mix(torch.tensor(position & _MASK32))))
    return torch.Generator().manual_seed((seed >> 32) << 32 | key)


def _draw(weights: torch.Tensor, generator: torch.Generator) -> int:
    return int(torch.multinomial(weights.cpu() / weights.sum(), 1, generator=generator))
