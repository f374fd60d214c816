"""What each path of `mode: auto` would cost a request, from the simulator's cost model
(vericache/sim/cost.py) over the served model's shape and a device profile: the prior that
auto_path.py's measurements correct.

A path's estimate (scheduler/path_choice.py `PathEstimate`) is its setup (until the first token)
and its seconds per output token after it, on the worker placement gives it, at that worker's
load now:
- setup: the bytes that must cross the link first (FULL_REMOTE: the prefix's full KV, unless
  its drafter's device holds it;
  VERICACHE: its compressed KV, and the prompt's exact KV across to the drafter after the
  verifier's prefill), the link's latency, and the prompt's prefill after the prefix, less the
  tokens whose KV that worker keeps from a finished turn (an agent's call before, a chat's turn);
- full decoding: one decode step over the full KV, batched with one row like it per request its
  worker paces now: those over its prefix read that prefix with it once per forward (shared-prefix
  attention, kv/shared_prefix.py), the rest read the other prefixes the worker decodes, each once;
- VERICACHE: a round of x draft steps over the compressed KV at the drafter's batch, one
  verification of x + 1 tokens (on the central verifier beside its full-KV decodes, or on a warm
  node beside its drafts), the two calls' latency and, from a central verifier, the committed
  tokens' exact KV across the link and, for a steered request, its share of a refresh of the
  drafter's kept set (sim/steering_link.py), over the accepted drafts and the verifier's token.
Every forward of a path's worker is slowed by the workers busy beside it on its memory system (a
CPU machine's workers share its DRAM: the profile's measured co-runner slowdown, co_runners.py,
which the server's own measurements replace, co_runner_fit.py).
A path slows the requests running now (scheduler/path_choice.py `Slowed`): its worker's
batch-mates by its row (a verifier's by its verification, once a round), and, where it sets an
idle worker computing, those of the busy workers beside it.
A request is priced at the middle of its output: its context is the prompt and half the tokens it
asks for. Which device the profile describes is the deployment's to say (`vericache calibrate`
writes one); by default the datasheet of the workers' GPU, or on a CPU a profile calibrated on a
2-core server CPU with one torch thread, which the measurements then scale to the CPU at hand.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from vericache.engine.link import LinkSpec
from vericache.errors import UnsupportedModelError
from vericache.scheduler.path_choice import (
    PathEstimate,
    ServingPath,
    Slowed,
    round_seconds_per_token,
)
from vericache.serve.backends.co_runners import StartedBeside
from vericache.serve.workers.worker_api import ModelInfo
from vericache.sim.cost import Row, forward_cost
from vericache.sim.profiles import DeviceProfile, ModelProfile, datasheet_for, device_profile
from vericache.sim.steering_link import refresh_bytes_per_round

# The bundled prior for a CPU worker (vericache/sim/profiles/devices/cpu.json).
CPU_PRIOR = "cpu"
PREFILL_CHUNK = 512  # tokens per prefill forward, as the workers' default `prefill_chunk`


@dataclass(frozen=True)
class RequestShape:
    """What a path's cost depends on, of one request over one prefix."""

    prefix_id: str
    prefix_tokens: int
    after_prefix: int  # prompt tokens after the prefix
    num_tokens: int  # output tokens it asks for
    draft_len: int
    compressed_share: float  # the prefix's compressed KV bytes over its full KV bytes
    steer_every: int = 0  # VERICACHE: rounds between refreshes of the drafter's kept set
    regrouped: bool = False  # its kept set is a composition's quantized groups, resent whole


@dataclass(frozen=True)
class PathOption:
    """A path a request may take now, on the worker placement would give it."""

    path: ServingPath
    worker: str
    load: int  # requests whose tokens that worker paces now
    verifier_load: int = 0  # VERICACHE: requests the central verifier decodes now
    is_warm: bool = False  # VERICACHE: its drafter node verifies the prefix's rounds itself
    link: LinkSpec = LinkSpec()  # between the store's verifier and that drafter
    # Tokens of the prompt after the prefix whose KV the worker that prefills it keeps from a
    # finished turn (turn_cache.py): they are not prefilled.
    reused: int = 0
    # Workers busy now beside that worker on its memory system (co_runners.py): each slows its
    # forwards by the device profile's co-runner slowdown.
    co_runners: int = 0
    # The busy workers it would set an idle worker computing beside (co_runners.py).
    started_beside: tuple[StartedBeside, ...] = ()
    # Of the `load` requests: those over the request's prefix, and the other prefixes the rest
    # read (None: each its own). A forward reads each prefix once for all its rows over it.
    same_prefix: int = 0
    other_prefixes: int | None = None
    # FULL_REMOTE: its worker's device holds the prefix's full KV already (fetches nothing).
    holds_prefix: bool = False


class PathCosts:
    def __init__(
        self,
        model: ModelProfile,
        device: DeviceProfile,
        kv_bytes_per_token: int,
        weight_element_size: int,
    ):
        self.model = model
        self.device = device
        self.kv_bytes_per_token = kv_bytes_per_token
        self.weight_element_size = weight_element_size

    def beside(self, co_runner_slowdown: float) -> PathCosts:
        """The same prices with each busy co-runner slowing a forward `co_runner_slowdown`
        times, as the server measured it (co_runner_fit.py), in place of the profile's."""
        device = replace(self.device, co_runner_slowdown=co_runner_slowdown)
        return PathCosts(self.model, device, self.kv_bytes_per_token, self.weight_element_size)

    def estimate(
        self, option: PathOption, shape: RequestShape, accepted_share: float
    ) -> PathEstimate:
        """The path's prior at its workers' loads now; VERICACHE accepting `accepted_share` of
        its drafts."""
        per_token = self.seconds_per_token(
            option, shape, accepted_share, option.load, option.co_runners
        )
        setup_s, slowed = self.setup_s(option, shape), self.slowed(option, shape)
        return PathEstimate(option.path, option.worker, setup_s, per_token, slowed=slowed)

    def slowed(self, option: PathOption, shape: RequestShape) -> tuple[Slowed, ...]:
        """The requests running now that the path slows: its worker's batch-mates, whose steps
        grow by its row; with a verification (VERICACHE), those of its verifier's batch, once a
        round; and those of the busy workers it starts an idle one beside."""
        is_vericache = option.path is ServingPath.VERICACHE
        row = self._row(shape, 1, compressed=is_vericache)
        slowed = [self._batch_slowed(row, option)]
        if is_vericache:
            round_s = shape.draft_len * self._forward_s(row, option.load, option)
            verify = self._row(shape, shape.draft_len + 1, compressed=False)
            decode = row if option.is_warm else self._row(shape, 1, compressed=False)
            load = option.load if option.is_warm else option.verifier_load
            added_s = self._seconds([verify] + [decode.unshared()] * load)
            added_s -= self._seconds([decode.unshared()] * load) if load else 0.0
            slowed.append(Slowed(load, 1 + added_s / (round_s + added_s)))
        for group in option.started_beside:  # each busy worker has the others busy beside it
            factor = self.device.slowdown_added(group.num_busy - 1, group.num_starting)
            slowed.append(Slowed(group.num_requests, factor))
        return tuple(slowed)

    def _batch_slowed(self, row: Row, option: PathOption) -> Slowed:
        """The requests of the option's worker's batch (rows like `row`), whose steps grow by
        it."""
        load = option.load
        if load < 1:
            return Slowed(0, 1.0)
        with_it = self._forward_s(row, load, option)
        return Slowed(load, with_it / self._seconds(self._beside(row, load, option)))

    def setup_s(
        self, option: PathOption, shape: RequestShape, co_runners: float | None = None
    ) -> float:
        """Until its first token, beside `co_runners` busy workers (None: the option's now)."""
        co_runners = option.co_runners if co_runners is None else co_runners
        full_bytes = shape.prefix_tokens * self.kv_bytes_per_token
        prefill_s = self._prefill_s(shape, option.reused) * self.device.slowdown_beside(co_runners)
        link = option.link
        if option.path is ServingPath.FULL_REMOTE:
            fetch_s = 0.0 if option.holds_prefix else link.transfer_s(full_bytes)
            return fetch_s + link.latency + prefill_s
        if option.path is not ServingPath.VERICACHE:  # the KV is beside the worker
            return prefill_s
        compressed_s = link.transfer_s(full_bytes * shape.compressed_share) + link.latency
        if option.is_warm:
            return compressed_s + prefill_s
        exact_s = link.transfer_s(shape.after_prefix * self.kv_bytes_per_token) + link.latency
        return compressed_s + prefill_s + exact_s

    def seconds_per_token(
        self,
        option: PathOption,
        shape: RequestShape,
        accepted_share: float,
        load: float,
        co_runners: float = 0.0,
    ) -> float:
        """After the first token, at `load` requests paced by its worker besides it and
        `co_runners` workers busy beside that worker on its memory system."""
        slowdown = self.device.slowdown_beside(co_runners)
        others = max(0, round(load))
        if option.path is not ServingPath.VERICACHE:
            return self._forward_s(self._row(shape, 1, compressed=False), others, option) * slowdown
        x = shape.draft_len
        draft = self._row(shape, 1, compressed=True)
        draft_s = self._forward_s(draft, others, option)
        verify = self._row(shape, x + 1, compressed=False)
        mean_accepted = accepted_share * x
        link = option.link
        if option.is_warm:  # verified beside its drafts, over the node's host tier
            verify_s = self._seconds([verify] + [draft.unshared()] * others)
            return round_seconds_per_token(
                x, draft_s * slowdown, verify_s * slowdown, 0.0, mean_accepted
            )
        decodes = [self._row(shape, 1, compressed=False).unshared()] * option.verifier_load
        verify_s = self._seconds([verify] + decodes)
        exact_bytes = (mean_accepted + 1) * self.kv_bytes_per_token
        calls_s = 2 * link.latency + link.transfer_s(exact_bytes + self._refresh_bytes(shape))
        return round_seconds_per_token(
            x, draft_s * slowdown, verify_s * slowdown, calls_s, mean_accepted
        )

    def _refresh_bytes(self, shape: RequestShape) -> float:
        """What the central verifier's refreshes of a steered drafter's kept set add to a round
        on the link (sim/steering_link.py)."""
        kept_bytes = shape.prefix_tokens * self.kv_bytes_per_token * shape.compressed_share
        return refresh_bytes_per_round(
            kept_bytes, shape.steer_every, self.model.head_dim, shape.regrouped
        )

    def _row(self, shape: RequestShape, num_new: int, compressed: bool) -> Row:
        """The request's row at the middle of its output: over the prefix (the share of it the
        compressed KV keeps, or all of it) and the tokens after it."""
        share = shape.compressed_share if compressed else 1.0
        kept = math.ceil(shape.prefix_tokens * share)
        own = shape.after_prefix + shape.num_tokens // 2
        size = self.kv_bytes_per_token
        return Row(
            num_new, kept + own, size, is_full_kv=not compressed,
            shared_prefix=(shape.prefix_id, compressed), shared_kv_bytes=kept * size,
        )  # fmt: skip

    def _forward_s(self, row: Row, others: int, option: PathOption) -> float:
        """A step of `row` with `others` rows like it beside it, over the option's prefixes: the
        share of them its load has over `row`'s prefix read it with `row`; the rest, the other
        prefixes in turn (each its own where those are not known)."""
        return self._seconds([row] + self._beside(row, others, option))

    @staticmethod
    def _beside(row: Row, others: int, option: PathOption) -> list[Row]:
        """`others` rows like `row`, over the option's prefixes (`_forward_s`)."""
        same = round(others * option.same_prefix / option.load) if option.load else 0
        rest = others - same
        groups = rest if option.other_prefixes is None else max(1, option.other_prefixes)
        beside = [row] * same
        return beside + [replace(row, shared_prefix=("other", i % groups)) for i in range(rest)]

    def _prefill_s(self, shape: RequestShape, reused: int = 0) -> float:
        """The prompt after the prefix and its first `reused` tokens (a kept turn's) prefilled
        over their full KV, chunk by chunk."""
        size, seconds = self.kv_bytes_per_token, 0.0
        for start in range(reused, shape.after_prefix, PREFILL_CHUNK):
            num_new = min(PREFILL_CHUNK, shape.after_prefix - start)
            seconds += self._seconds([Row(num_new, shape.prefix_tokens + start, size, True)])
        return seconds

    def _seconds(self, rows: list[Row]) -> float:
        cost = forward_cost(self.model, self.device, rows, self.weight_element_size)
        return cost.seconds


def path_costs(info: ModelInfo, cost_profile: str = "") -> PathCosts:
    """The prices of the paths over the workers' model (`info`), on the device `cost_profile`
    names ("": `default_device_profile`)."""
    device = device_profile(cost_profile) if cost_profile else default_device_profile(info.numerics)
    if info.shape is None:
        raise UnsupportedModelError(f"the workers of {info.model} report no shape to price with")
    return PathCosts(info.shape, device, info.full_kv_bytes_per_token, info.weight_element_size)


def default_device_profile(numerics: str) -> DeviceProfile:
    """The prior for a worker of `ModelInfo.numerics`: its GPU's datasheet, else the CPU's."""
    if numerics.startswith("cuda:"):
        datasheet = datasheet_for(numerics.split(":")[1])
        if datasheet is not None:
            return datasheet
    return device_profile(CPU_PRIOR)
