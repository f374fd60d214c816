"""The forward loop: every batched forward of a draft, a verification or a decode step runs here.

A `Job` is one piece of work on one cache: up to `max_steps` tokens (a draft, a run of full-KV or
lossy decoding), or a single forward that chooses `num_logits` tokens (a verification of [pending
+ drafts]); greedy, or sampled with seeded coupling where the job has a sampler (so a draft and
its verification draw the same noise at each position). `ForwardLoop.step(jobs)` runs one forward
over the next tokens of every job and records each one's choices. Rows over compressed KV attend
with the fast kernels; rows over full KV (`Job.is_full_kv`) with the batch-invariant kernels, so a
verification's choices do not depend on what shares its forward; both kinds share the forward's
one read of the weights.

The engine and the long-context engine build each iteration's jobs from their sequences and step
them once (sequence_forward.py); a worker's batch thread (serve/workers/batching.py) keeps the jobs
of the calls it holds and steps them until each is done, letting jobs join and leave between steps
(continuous batching, as in vLLM).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from vericache.engine.constraint import TokenConstraint
from vericache.engine.request import TokenLogprob
from vericache.engine.sampling import SequenceSampler
from vericache.kv.cache import KVCache
from vericache.model.runner import ModelRunner, SequenceInput


@dataclass(eq=False)  # compared by identity: two equal jobs are two pieces of work
class Job:
    cache: KVCache
    feed: list[int]  # tokens the cache does not hold yet, fed at the next step
    max_steps: int = 1
    num_logits: int = 1  # choices wanted from the first step (a verification: 1 + drafts)
    end_ids: frozenset[int] = frozenset()  # stop after choosing one of these
    is_full_kv: bool = False  # full-KV work: batch-invariant kernels
    after_step: Callable[[], None] | None = None  # e.g. an online compressor's update
    sampler: SequenceSampler | None = None  # None: the logits' plain argmax
    keeps_processed: bool = False  # keep the logits each sampled row was drawn from (rejection)
    # Its choices are output (a decode step or a verification, not a draft): it reports their
    # log-probabilities where its sampler asks for them.
    reports_logprobs: bool = False
    # A constrained sequence's grammar (constraint.py), and the tokens after its committed output
    # that come before this job's first row (a draft step's earlier drafts).
    constraint: TokenConstraint | None = None
    constrained_after: list[int] = field(default_factory=list)
    # Called with each layer's queries of its rows (the runner's `observe`): a verification's,
    # where its sequence steers its drafter's kept set (compress/steering.py).
    observe: Callable | None = None
    # A greedy, unconstrained run of steps (a worker's whole draft) whose choices stay on the
    # device until its last step: the host waits once for them all, not once a step. An end id
    # does not stop it early then; its choices are cut after the first one.
    defers_choices: bool = False
    processed: list[torch.Tensor] = field(default_factory=list)  # per step [n, V] float32
    choices: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # [len(choices)] where reported
    steps: int = 0
    _deferred: list[torch.Tensor] = field(default_factory=list)  # per step [1] on the device

    def __post_init__(self):
        if self.defers_choices and (self.sampler is not None or self.constraint is not None):
            raise ValueError("only a greedy, unconstrained job's choices can stay on the device")

    @property
    def is_done(self) -> bool:
        ended = bool(self.choices) and self.choices[-1] in self.end_ids
        return self.steps >= self.max_steps or ended

    def sequence_input(self) -> SequenceInput:
        cache = self.cache
        observe = self.observe
        if observe is None and getattr(cache, "records_queries", False):
            observe = cache.observe
        if self._deferred:  # the last choice, fed where it lies
            ids = self._deferred[-1]
        else:
            ids = torch.tensor(self.feed, dtype=torch.long)
        num_logits = self.num_logits if self.steps == 0 else 1
        return SequenceInput(ids, cache, num_logits, observe, fast_attention=not self.is_full_kv)

    def allowed(self, rows: torch.Tensor) -> torch.Tensor:
        """Its logits rows [n, V], with what its grammar forbids at -inf (if it has one)."""
        if self.constraint is None:
            return rows
        fed_after_first_row = self.feed[len(self.feed) - rows.shape[0] + 1 :]
        path = [*self.constrained_after, *self.choices]
        return self.constraint.restrict(rows, path, fed_after_first_row)

    def choose(self, rows: torch.Tensor) -> list[int]:
        """This step's tokens from its logits rows [n, V] (a job with a sampler's; the others'
        are chosen together in `choose`)."""
        fed_after_first_row = self.feed[len(self.feed) - rows.shape[0] + 1 :]
        choice = self.sampler.choose(rows, self.choices, fed_after_first_row)
        if self.keeps_processed:
            self.processed.append(choice.processed)
        if self.reports_logprobs:
            self.logprobs += self.sampler.reported(choice.processed, choice.tokens)
        return choice.tokens

    def advance(self, chosen: list[int] | torch.Tensor) -> None:
        """Records one step's choices (a deferring job's: [1] on the device); the last one is fed
        next."""
        self.steps += 1
        if self.defers_choices:
            self._deferred.append(chosen)  # read once its last step is done (`take_deferred`)
        else:
            self.choices.extend(chosen)
            self.feed = chosen[-1:]
        if self.after_step is not None:
            self.after_step()

    def restart(self, feed: list[int]) -> None:
        """Back to before its first step, fed `feed` (its cache is the caller's to truncate)."""
        self.feed, self.steps, self.choices, self._deferred = list(feed), 0, [], []
        self.processed, self.logprobs = [], []

    @property
    def has_deferred_to_take(self) -> bool:
        """A deferring job whose last step is done and whose choices are still on the device."""
        return self.defers_choices and self.steps >= self.max_steps and bool(self._deferred)

    def deferred_choices(self) -> torch.Tensor:  # [steps] on the device
        """A deferring job's choices still on the device, in step order."""
        return torch.cat(self._deferred)

    def take(self, tokens: list[int]) -> None:
        """A deferring job's choices, read: kept up to its first end id."""
        self._deferred = []
        ends = [i for i, token in enumerate(tokens) if token in self.end_ids]
        self.choices = tokens[: ends[0] + 1] if ends else tokens
        self.feed = self.choices[-1:]


def take_deferred(jobs: list[Job]) -> None:
    """The device-held choices of the deferring jobs whose last step is done, read in one wait
    for them all."""
    done = [job for job in jobs if job.has_deferred_to_take]
    if not done:
        return
    parts = [job.deferred_choices() for job in done]
    tokens = torch.cat(parts).tolist()
    start = 0
    for job, part in zip(done, parts):
        job.take(tokens[start : start + part.shape[0]])
        start += part.shape[0]


def choose(jobs: list[Job], logits: list[torch.Tensor]) -> list[list[int] | torch.Tensor]:
    """Each job's tokens from its logits: through its sampler where it has one, the plain argmax
    (in one batch) where not; a deferring job's stay on the device ([1])."""
    logits = [job.allowed(rows) for job, rows in zip(jobs, logits)]
    is_greedy = [job.sampler is None for job in jobs]
    greedy_rows = [rows for rows, plain in zip(logits, is_greedy) if plain]
    deferring = [job.defers_choices for job, plain in zip(jobs, is_greedy) if plain]
    greedy_chosen = iter(greedy(greedy_rows, deferring) if greedy_rows else [])
    return [
        next(greedy_chosen) if plain else job.choose(rows)
        for job, rows, plain in zip(jobs, logits, is_greedy)
    ]


@dataclass(frozen=True)
class FirstToken:
    """The token a prompt's prefill chose, and its log-probability where the request asks."""

    token_id: int
    logprobs: tuple[TokenLogprob, ...]  # [1], or () where not asked


def choose_first(
    logits: torch.Tensor,
    sampler: SequenceSampler | None = None,
    constraint: TokenConstraint | None = None,
) -> FirstToken:
    """The choice from a prefill's last logits row ([n, V]: its last row): the plain argmax (ties:
    the lowest id), or its sampler's; under its grammar, where it has one."""
    rows = logits[-1:]
    if constraint is not None:
        rows = constraint.restrict(rows, (), ())
    if sampler is None:
        return FirstToken(int(rows[-1].argmax()), ())
    choice = sampler.choose(rows)
    return FirstToken(choice.tokens[0], sampler.reported(choice.processed, choice.tokens))


def greedy(
    logits: list[torch.Tensor], on_device: list[bool] | None = None
) -> list[list[int] | torch.Tensor]:
    """Greedy tokens per sequence from its logits [n_i, vocab], in one argmax; read on the host
    in one wait, but for the sequences `on_device` marks, whose tokens stay there ([n_i]). None
    wait where every sequence's stay.

    argmax returns the first maximum: ties go to the lowest token id."""
    on_device = on_device or [False] * len(logits)
    if len(logits) == 1:  # as below, in the two operators a lone sequence needs
        chosen = logits[0].argmax(dim=-1)  # [n]
        return [chosen if on_device[0] else chosen.tolist()]
    chosen = torch.cat(logits).argmax(dim=-1)  # [sum n_i]
    parts = chosen.split([rows.shape[0] for rows in logits])
    read = [part for part, stays in zip(parts, on_device) if not stays]
    host = iter(torch.cat(read).tolist() if read else [])
    return [
        part if stays else [next(host) for _ in range(part.shape[0])]
        for part, stays in zip(parts, on_device)
    ]


class ForwardLoop:
    """Steps jobs over one model runner. `invariant_full_kv=False` lets full-KV rows take the
    fast kernels too, which gives up bit-exact verification for speed."""

    def __init__(self, runner: ModelRunner, invariant_full_kv: bool = True):
        self.runner = runner
        self.invariant_full_kv = invariant_full_kv
        self.num_steps = 0
        self.max_batch = 0  # the most jobs one step has run
        self.num_rows = 0  # jobs summed over its steps (num_rows / num_steps: the mean batch)
        # CPU seconds of this loop's forwards (the stepping thread's), and the share of them that
        # full-KV rows took, split by the tokens each kind fed: what verification costs.
        self.cpu_s = 0.0
        self.exact_cpu_s = 0.0

    def step(self, jobs: list[Job]) -> float:
        """One forward over every job's next tokens; advances each. Returns its seconds."""
        invariant = self.invariant_full_kv and any(job.is_full_kv for job in jobs)
        inputs = [job.sequence_input() for job in jobs]
        start, start_cpu = time.perf_counter(), time.thread_time()
        chosen = choose(jobs, self.runner.forward(inputs, invariant=invariant))
        elapsed, cpu_s = time.perf_counter() - start, time.thread_time() - start_cpu
        for job, job_chosen in zip(jobs, chosen):
            job.advance(job_chosen)
        take_deferred(jobs)
        self.num_steps += 1
        self.max_batch = max(self.max_batch, len(jobs))
        self.num_rows += len(jobs)
        num_fed = [seq.token_ids.numel() for seq in inputs]
        exact_fed = sum(n for job, n in zip(jobs, num_fed) if job.is_full_kv)
        self.cpu_s += cpu_s
        self.exact_cpu_s += cpu_s * exact_fed / sum(num_fed)
        return elapsed
