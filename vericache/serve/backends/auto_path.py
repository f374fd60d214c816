"""`mode: auto`: the coordinator chooses each request's path (scheduler/path_choice.py) from the
cost model (path_costs.py) at the workers' loads now, corrected by what the paths took on this
server.

Every path gives the same tokens (full-KV decoding's), so the choice is about time alone. From the
first request on, each path is estimated by the cost model: its setup and its seconds per token at
the load of the worker placement gives it (its drafter for VERICACHE and FULL_REMOTE, on a node
warm for the prefix where one is: FULL_WARM; its verifier for FULL_LOCAL), and `choose_path`
takes the one that finishes first. What the requests then took corrects it, per path, each
prediction made again at the load its worker had on average over the request's life
(worker_load.py): the setup (time to the first token) by the moving mean of measured over
predicted (the first measurement replaces the prior); the seconds per token by a fit to the
path's last requests, together with the slowdown that busy co-runners cause on this server
(co_runner_fit.py), which replaces the profile's in every price. VERICACHE's acceptance is
the one the server measured (the share of its drafts accepted), from a prior of what the
compressors accept on code and tool calls. A path none of whose workers is alive is never
offered.

A prior can be far off on a machine the profile does not describe (on a 2-core Intel Xeon every
path's steps take about three times the bundled CPU profile's, calibrated on an AMD EPYC), and a
path is priced by the prior until its own requests are measured. Most of that error is the
device's, common to every path: a path not yet measured takes the mean correction of the
measured paths' seconds per token (its setup, mostly link bytes on a remote path, keeps its
own), so a fast prior does not send a request to a slow path. Else, on that Xeon, `auto` sent a
quarter of a short stream to FULL_REMOTE, priced at a third of what it took. And a path takes
one request at a time, its probe, until PROBES of its requests were measured: while a probe runs,
the others choose among the rest. One request pays for a wrong prior, not a whole wave. The
acceptance is pooled over drafts, not requests (`_AcceptedShare`), so one lucky measurement does
not swing it.
"""

from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass

from vericache.scheduler.path_choice import PathEstimate, ServingPath, choose_path
from vericache.serve.api_types import GenerateSummary, ServeMode
from vericache.serve.backends.co_runner_fit import CoRunnerFit
from vericache.serve.backends.path_costs import PathCosts, PathOption, RequestShape

# Weight of each new request in the moving averages, past the first five: the last ten or so
# requests of a path count.
ALPHA = 0.2
# The share of its drafts a VeriCache round accepts before any is measured here, below the least
# of bench/results/acceptance_4x.json's (21.3 of 30 at 4x compression, code and tool calls: 0.71)
# for prompts less like its own.
PRIOR_ACCEPTED_SHARE = 0.6
# A correction is a ratio within these: one request far off (a stall) cannot swing a path away.
MAX_CORRECTION = 8.0
# Drafts the prior acceptance weighs as, and the share of the drafts so far that each request's
# rounds keep: a request's acceptance varies (one over code it has seen accepts nearly all, the
# next a tenth), and a path priced from one request's would swing with it.
PRIOR_DRAFTS = 100
DRAFTS_KEPT = 0.8
# A path takes one request at a time until this many of its requests were measured. One: on a
# 2-core CPU three probes of VeriCache at x=30, which runs there at half full decoding's speed,
# cost a 24-request stream a third of its throughput (bench/README.md, remote-prefix).
PROBES = 1

logger = logging.getLogger(__name__)

_SERVED_AS = {
    ServingPath.VERICACHE: ServeMode.VERICACHE,
    ServingPath.FULL_LOCAL: ServeMode.FULL_LOCAL,
    ServingPath.FULL_REMOTE: ServeMode.FULL_REMOTE,
    ServingPath.FULL_WARM: ServeMode.FULL_REMOTE,  # on the warm node, which placement prefers
}


@dataclass(frozen=True)
class PathChoice:
    """The option a request took, and what it was chosen for: `observe` prices it again."""

    option: PathOption
    shape: RequestShape
    is_probe: bool = False  # the first of its path, priced before any of it was measured

    @property
    def path(self) -> ServingPath:
        return self.option.path


class _MovingMean:
    """The mean of the values so far until they are 1 / ALPHA, then a moving average: the first
    measurement replaces the prior at once (a server learns within its first requests), later
    ones follow the last ten or so."""

    def __init__(self, prior: float):
        self.value = prior
        self.count = 0

    def observe(self, value: float) -> None:
        self.count += 1
        self.value += max(ALPHA, 1 / self.count) * (value - self.value)


class _AcceptedShare:
    """The share of drafts VeriCache's rounds accept: accepted over drafted, each summed with
    the older sums decayed by DRAFTS_KEPT per request, from PRIOR_DRAFTS at the prior share."""

    def __init__(self, prior: float):
        self._accepted = prior * PRIOR_DRAFTS
        self._drafted = float(PRIOR_DRAFTS)

    @property
    def value(self) -> float:
        return self._accepted / self._drafted

    def observe(self, accepted: int, drafted: int) -> None:
        self._accepted = DRAFTS_KEPT * self._accepted + accepted
        self._drafted = DRAFTS_KEPT * self._drafted + drafted


def _bounded(log_ratio: float) -> float:
    """A log correction within MAX_CORRECTION either way."""
    bound = math.log(MAX_CORRECTION)
    return min(bound, max(-bound, log_ratio))


class _Correction:
    """A ratio the prior is multiplied by: the moving mean of log(measured / predicted)."""

    def __init__(self):
        self._log_ratio = _MovingMean(0.0)

    @property
    def ratio(self) -> float:
        return math.exp(self._log_ratio.value)

    def observe(self, measured: float, predicted: float) -> None:
        if measured <= 0 or predicted <= 0:
            return
        self._log_ratio.observe(_bounded(math.log(measured / predicted)))


class AutoPaths:
    def __init__(self, costs: PathCosts):
        self._prior_costs = costs
        self._setup = {path: _Correction() for path in ServingPath}
        self._co_runners = CoRunnerFit(costs.device.co_runner_slowdown)
        self._accepted_share = _AcceptedShare(PRIOR_ACCEPTED_SHARE)
        self._probes = dict.fromkeys(ServingPath, 0)  # in flight, per path not yet measured
        self._lock = threading.Lock()

    @property
    def costs(self) -> PathCosts:
        """The cost model at the co-runner slowdown fitted so far."""
        return self._prior_costs.beside(self._co_runners.slowdown)

    @property
    def co_runner_slowdown(self) -> float:
        """A forward's time beside one busy co-runner over alone, as fitted here."""
        return self._co_runners.slowdown

    @property
    def accepted_share(self) -> float:
        """The share of its drafts a VeriCache round accepts, as measured here."""
        return self._accepted_share.value

    def choose(self, options: list[PathOption], shape: RequestShape) -> PathChoice:
        """The option of least cost (path_choice.py) by the corrected cost model, but for the
        paths whose probe is running (any, where that leaves none). Call `finished` when the
        request ends."""
        with self._lock:
            open_now = [o for o in options if not self._probes[o.path]] or options
            estimates = [self.estimate(option, shape) for option in open_now]
            chosen = open_now[estimates.index(choose_path(estimates, shape.num_tokens))]
            is_probe = not self._is_measured(chosen.path)
            self._probes[chosen.path] += is_probe
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "auto: %s%s over %s, of %s", chosen.path.value, " (probe)" * is_probe,
                shape.prefix_id, _described(estimates, shape.num_tokens),
            )  # fmt: skip
        return PathChoice(chosen, shape, is_probe)

    def finished(self, choice: PathChoice) -> None:
        """The request ended (observed or not): a probe lets its path take requests again."""
        if choice.is_probe:
            with self._lock:
                self._probes[choice.path] -= 1

    def _is_measured(self, path: ServingPath) -> bool:
        return self._co_runners.count(path) >= PROBES

    def _per_token_ratio(self, path: ServingPath) -> float:
        """The path's correction of its seconds per token; before any of its requests was
        measured, the device's: the mean of the measured paths' (in logs), or none."""
        own = self._co_runners.log_correction(path)
        if own is not None:
            return math.exp(_bounded(own))
        measured = [self._co_runners.log_correction(p) for p in ServingPath]
        measured = [_bounded(log) for log in measured if log is not None]
        return math.exp(sum(measured) / len(measured)) if measured else 1.0

    def estimate(self, option: PathOption, shape: RequestShape) -> PathEstimate:
        prior = self.costs.estimate(option, shape, self.accepted_share)
        setup_s = prior.setup_s * self._setup[option.path].ratio
        per_token = prior.seconds_per_token * self._per_token_ratio(option.path)
        return PathEstimate(option.path, option.worker, setup_s, per_token, slowed=prior.slowed)

    def observe(
        self, choice: PathChoice, summary: GenerateSummary, load: float, co_runners: float = 0.0
    ) -> None:
        """A request served as `choice` ended, its decoding worker holding `load` requests (it
        among them) and `co_runners` busy workers beside it on average while it ran
        (worker_load.py, co_runners.py). Requests cut short before their second token say
        nothing of the seconds per token."""
        option, shape, costs = choice.option, choice.shape, self.costs
        with self._lock:
            predicted_setup_s = costs.setup_s(option, shape, co_runners)
            self._setup[option.path].observe(summary.ttft_s, predicted_setup_s)
            if summary.num_tokens < 2 or summary.tokens_per_s <= 0:
                return
            accepted_share = self.accepted_share
            if option.path is ServingPath.VERICACHE and summary.accepted_per_round:
                accepted = sum(summary.accepted_per_round)
                drafted = len(summary.accepted_per_round) * shape.draft_len
                accepted_share = min(1.0, accepted / drafted)
                self._accepted_share.observe(accepted, drafted)
            others = max(0.0, load - 1)
            predicted = costs.seconds_per_token(option, shape, accepted_share, others)
            log_ratio = _bounded(math.log(1.0 / (summary.tokens_per_s * predicted)))
            self._co_runners.observe(option.path, co_runners, log_ratio)
        logger.debug(
            "auto: %s measured: ttft %.3f s (prior %.3f), %.1f ms/token (prior alone %.1f), load "
            "%.2f, co-runners %.2f; co-runner slowdown now %.2f", option.path.value,
            summary.ttft_s, predicted_setup_s, 1e3 / summary.tokens_per_s, predicted * 1e3, load,
            co_runners, self._co_runners.slowdown,
        )  # fmt: skip


def _described(estimates: list[PathEstimate], num_tokens: int) -> str:
    """The estimates as the debug log gives them: each path's setup, seconds per token and cost
    (its finish and the delay it adds to others')."""
    return "; ".join(
        f"{e.path.value}@{e.worker}: setup {e.setup_s:.3f} s, {e.seconds_per_token * 1e3:.1f} "
        f"ms/token, cost {e.cost_s(num_tokens):.2f} s"
        for e in estimates
    )


def served_as(path: ServingPath) -> ServeMode:
    """The mode a chosen path is served in."""
    return _SERVED_AS[path]
