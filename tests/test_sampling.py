"""Sampling primitives for exact speculative decoding under sampling (vericache/engine/sampling.py):
the seeded noise is a function of (seed, position, token) alone, Gumbel-max and rejection coupling
both follow the target distribution (checked as vLLM's rejection-sampler test does: the empirical
distribution approaches the target as the sample grows, far closer than to other distributions),
and seeded coupling of a speculative loop gives the tokens sequential sampling gives."""

from __future__ import annotations

import pytest
import torch

from vericache.engine.request import SamplingParams
from vericache.engine.sampling import (
    gumbel_noise,
    processed_logits,
    rejection_sample,
    seeded_sample,
    token_logprobs,
)
from vericache.errors import InvalidRequestError

TARGET_LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])


def total_variation(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * float((a.double() - b.double()).abs().sum())


def empirical(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab_size).double() / tokens.numel()


def test_the_noise_of_a_position_does_not_depend_on_what_is_computed_with_it():
    together = gumbel_noise(7, torch.tensor([3, 4, 5]), 1000)
    alone = gumbel_noise(7, torch.tensor([4]), 1000)
    assert torch.equal(together[1], alone[0])
    assert torch.isfinite(together).all()
    assert not torch.equal(together[0], together[1])  # positions differ
    assert not torch.equal(gumbel_noise(8, torch.tensor([4]), 1000), alone)  # seeds differ
    big_seed = gumbel_noise(7 + (1 << 40), torch.tensor([4]), 1000)
    assert not torch.equal(big_seed, alone)  # the seed's high bits count too


def test_the_noise_is_standard_gumbel():
    noise = gumbel_noise(1, torch.arange(64), 4096).double()
    euler_gamma, variance = 0.5772156649, torch.pi**2 / 6
    assert float(noise.mean()) == pytest.approx(euler_gamma, abs=0.01)
    assert float(noise.var()) == pytest.approx(variance, rel=0.02)


def _seeded_distribution(logits: torch.Tensor, num_samples: int, seed: int = 0) -> torch.Tensor:
    positions = torch.arange(num_samples)
    tokens = seeded_sample(logits.expand(num_samples, -1), seed, positions)
    return empirical(tokens, logits.numel())


def test_seeded_sampling_converges_to_the_target_distribution():
    target = TARGET_LOGITS.softmax(-1)
    small = total_variation(_seeded_distribution(TARGET_LOGITS, 500), target)
    large = total_variation(_seeded_distribution(TARGET_LOGITS, 50_000), target)
    assert large < 0.01 and large < small
    # Far closer to the target than the target is to another distribution of the same support.
    generator = torch.Generator().manual_seed(0)
    for _ in range(5):
        other = torch.randn(6, generator=generator).softmax(-1)
        assert large < 0.2 * total_variation(other, target)


def test_the_same_seed_samples_the_same_tokens_and_another_seed_others():
    logits = torch.randn(200, 50, generator=torch.Generator().manual_seed(1))
    positions = torch.arange(200)
    first = seeded_sample(logits, 42, positions)
    assert torch.equal(first, seeded_sample(logits, 42, positions))
    assert not torch.equal(first, seeded_sample(logits, 43, positions))


def _markov_logits(table: torch.Tensor, previous: int) -> torch.Tensor:
    return table[previous]


def test_seeded_coupling_of_a_speculative_loop_gives_the_sequential_samples():
    """A toy model (logits a function of the previous token) sampled token by token, against
    drafts from a perturbed model verified in rounds: accept while a draft equals the target's
    sample at its position, then take the target's sample. The outputs are the same tokens."""
    generator = torch.Generator().manual_seed(3)
    target = torch.randn(40, 40, generator=generator) * 2
    drafter = target + torch.randn(40, 40, generator=generator)  # a lossy copy
    processing = SamplingParams(temperature=0.7, top_p=0.9, top_k=20)
    seed, length = 1234, 120

    def sample(table, previous, position):
        logits = processed_logits(_markov_logits(table, previous).unsqueeze(0), processing)
        return int(seeded_sample(logits, seed, torch.tensor([position]))[0])

    sequential = [5]
    for position in range(1, length):
        sequential.append(sample(target, sequential[-1], position))
    speculative, rounds, accepted_total = [5], 0, 0
    while len(speculative) < length:
        drafts = []
        for step in range(6):
            previous = drafts[-1] if drafts else speculative[-1]
            drafts.append(sample(drafter, previous, len(speculative) + step))
        rounds += 1
        fed = [speculative[-1], *drafts]
        for i, draft in enumerate(drafts + [None]):
            choice = sample(target, fed[i], len(speculative))
            speculative.append(choice)
            if choice != draft or len(speculative) == length:
                break
            accepted_total += 1
    assert speculative[:length] == sequential
    assert accepted_total > rounds  # the drafter's noise is the target's: most drafts hold


def test_rejection_coupling_follows_the_target_distribution():
    generator = torch.Generator().manual_seed(0)
    p = TARGET_LOGITS.softmax(-1)
    q = torch.tensor([0.05, 0.05, 0.3, 0.3, 0.2, 0.1])
    num_samples = 40_000
    drafts = torch.multinomial(q, num_samples, replacement=True, generator=generator)
    first_tokens, accepted = [], 0
    for draft in drafts.tolist():
        outcome = rejection_sample([draft], q.unsqueeze(0), torch.stack([p, p]), generator)
        first_tokens.append(draft if outcome.num_accepted else outcome.next_token)
        accepted += outcome.num_accepted
    distance = total_variation(empirical(torch.tensor(first_tokens), 6), p)
    assert distance < 0.01
    assert total_variation(q, p) > 20 * distance
    # The acceptance rate is sum(min(p, q)).
    assert accepted / num_samples == pytest.approx(float(torch.minimum(p, q).sum()), abs=0.01)


def test_rejection_coupling_keeps_every_draft_of_an_exact_drafter():
    generator = torch.Generator().manual_seed(0)
    p = TARGET_LOGITS.softmax(-1)
    outcome = rejection_sample([0, 2, 1], torch.stack([p] * 3), torch.stack([p] * 4), generator)
    assert outcome.num_accepted == 3 and 0 <= outcome.next_token < 6
    with pytest.raises(ValueError, match="drafts need"):
        rejection_sample([0], torch.stack([p] * 2), torch.stack([p] * 2), generator)


def test_top_k_top_p_and_min_p_keep_what_vllm_keeps():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.07, 0.03]]))

    def kept(**params) -> list[bool]:
        processed = processed_logits(logits, SamplingParams(temperature=1, **params))
        return torch.isfinite(processed)[0].tolist()

    assert kept(top_k=2) == [True, True, False, False, False]
    assert kept(top_p=0.7) == [True, True, False, False, False]  # 0.5 + 0.25 reaches 0.7
    assert kept(top_p=0.75) == [True, True, False, False, False]
    assert kept(top_p=0.76) == [True, True, True, False, False]
    assert kept(min_p=0.4) == [True, True, False, False, False]  # 0.15 < 0.4 * 0.5
    assert all(kept())
    scaled = processed_logits(logits, SamplingParams(temperature=0.5))
    assert torch.allclose(scaled, logits * 2)


def test_penalties_follow_vllm_definitions():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    out = processed_logits(
        logits,
        SamplingParams(temperature=1, repetition_penalty=2.0),
        prompt_ids=[0],
        output_ids=[[1]],
    )
    assert out[0].tolist() == [1.0, -4.0, 1.0, 0.5]  # positive divided, negative multiplied
    out = processed_logits(
        logits,
        SamplingParams(temperature=1, presence_penalty=0.5),
        prompt_ids=[0],
        output_ids=[[2, 2]],
    )
    assert out[0].tolist() == [2.0, -2.0, 0.5, 0.5]  # once per token present in the output


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -1.0),
        ("top_k", -1),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("min_p", -0.1),
        ("repetition_penalty", 0.0),
        ("presence_penalty", 3.0),
        ("seed", -1),
        ("coupling", "nearest"),
    ],
)
def test_bad_parameters_are_refused(field, value):
    with pytest.raises(InvalidRequestError, match=field):
        SamplingParams(**{"temperature": 0.7, field: value})


def test_rejection_coupling_applies_only_to_sampling():
    assert SamplingParams(temperature=0.7, coupling="rejection").is_rejection_coupled
    assert not SamplingParams(
        coupling="rejection"
    ).is_rejection_coupled  # greedy: nothing to couple
    assert not SamplingParams(temperature=0.7).is_rejection_coupled


def test_greedy_logits_are_penalized_but_neither_scaled_nor_masked():
    rows = TARGET_LOGITS.unsqueeze(0)
    assert not SamplingParams().is_sampled
    greedy = processed_logits(rows, SamplingParams(top_k=1, top_p=0.1))
    assert torch.equal(greedy, rows)  # temperature and masks shape sampling only
    penalized = processed_logits(rows, SamplingParams(repetition_penalty=4.0), (0,), [()])
    assert penalized[0, 0] == 0.5 and int(penalized.argmax()) == 1  # the argmax moves (vLLM)
    assert not SamplingParams().needs_sampler
    assert SamplingParams(repetition_penalty=1.1).needs_sampler
    assert SamplingParams(logprobs=0).needs_sampler


def test_token_logprobs_are_the_log_softmax_with_the_best_alternatives_first():
    processed = torch.stack([TARGET_LOGITS, TARGET_LOGITS.flip(0)])  # [2, 6]
    processed[1, 0] = float("-inf")  # a masked token
    reported = token_logprobs(processed, [3, 0], num_top=3)
    expected = processed.log_softmax(-1)
    assert [r.token_id for r in reported] == [3, 0]
    assert reported[0].logprob == pytest.approx(float(expected[0, 3]))
    assert reported[1].logprob == float("-inf")
    assert [id_ for id_, _ in reported[0].top] == [0, 1, 2]
    assert [id_ for id_, _ in reported[1].top] == [5, 4, 3]
    assert sum(torch.tensor([v for _, v in reported[0].top]).exp()) < 1
    assert token_logprobs(processed, [3, 0], num_top=0)[0].top == ()
    tied = token_logprobs(torch.zeros(1, 6), [4], num_top=2)[0]
    assert [id_ for id_, _ in tied.top] == [0, 1]  # ties: the lower id first


def test_logprobs_are_bounded_as_openai_bounds_them():
    with pytest.raises(InvalidRequestError, match="logprobs"):
        SamplingParams(logprobs=21)
    with pytest.raises(InvalidRequestError, match="logprobs"):
        SamplingParams(logprobs=-1)
