"""`mode: auto` simulated: each request's path chosen when it arrives, among VeriCache, FULL_LOCAL,
FULL_REMOTE and full decoding on a warm node, by scheduler/path_choice.py (the function a served
coordinator imports) from this module's estimates. A session's turns are requests of their own,
as served (the coordinator resolves `auto` per request when it admits it): each turn's path is
chosen and its worker placed when it arrives. A worker keeps a finished session's KV after the
prefix in its turn cache (turn_kv.py): a verifier, of each turn it serves (FULL_LOCAL, or its
prefill of a VeriCache session's prompt); a drafter, one cache for its full-KV turns
(FULL_REMOTE, FULL_WARM) and the VeriCache sessions its warm node verifies; on its device,
spilled into its host tier where the node has one (the served `--turn-host-bytes`). A turn on
the worker that keeps its session's turn before prefills only its new tokens while the KV is
there (from the host tier, once loaded over PCIe), a VeriCache turn verified on its node too; a
drafter keeps none of the VeriCache sessions a central verifier verifies.

Each estimate comes from the cost model (cost.py) and the workers' state now: the rows each
worker's next forward holds (its load), what its device and host tier hold, and the transfers
queued ahead on its links. For the worker placement would give each path (placement.py, warm
nodes first):
- full decoding: the seconds until its prefix's full KV is on the device (held: none; in the host
  tier: over PCIe; else the fetch or, where the deployment recomputes, the prefill if sooner
  counted once for each job on the device it would hold up, as its workers choose: host_tier.py)
  and its prompt's prefill after the prefix (on a worker that keeps its session's turn before,
  of the new tokens alone, after that turn's PCIe load where it lies in the host tier); then one
  decode step at the worker's batch with it added, per token;
- VeriCache: the full KV onto the verifier and then the compressed KV onto the drafter (on a
  warm node: the compressed KV, and its host tier's full KV), the prefill (on the central
  verifier or the warm node, whichever prefills it, where that keeps its session's turn before,
  of the new tokens alone, after its PCIe load as for full decoding), and from a central
  verifier the prompt's exact KV after the prefix across to the drafter; then a round per the
  acceptance's mean accepted drafts at x: x draft steps at the drafter's batch, a verification
  at the verifier's (or the node's), and the calls' latency and exact KV (behind the drafter's
  link's queue; on a warm node: a PCIe load, unless its device holds the KV);
- where a worker's memory has no room for the request now, its turn behind the sessions
  waiting there, as sessions leave (each taken to last as long as this request);
- and the requests running now that it slows (path_choice.py `Slowed`): its worker's batch-mates
  by its rows (a central verifier's by its verifications), and, where the workers share one
  memory system, those of the workers already busy (computing, or with requests placed there)
  beside a worker it sets computing, by the co-runner slowdown and, where that fills the
  machine's cores, the serving work each of their forwards then waits for
  (`RemotePrefixScenario.host_cpu_s_per_forward`), which its own steps wait for too. The served
  `auto` prices both with the CPU prior's co-runner slowdown (1.23, path_costs.py).
"""

from __future__ import annotations

from vericache.scheduler.path_choice import (
    PathEstimate,
    ServingPath,
    Slowed,
    choose_path,
    round_seconds_per_token,
)
from vericache.sim.cost import Row
from vericache.sim.kv_memory import Session
from vericache.sim.long_context import SimReport
from vericache.sim.remote_prefix import VeriCacheRequest
from vericache.sim.remote_prefix_full import FullRequest
from vericache.sim.remote_prefix_scenario import RemotePrefixScenario
from vericache.sim.remote_prefix_workers import PrefixKey, Run, SessionTurns, Worker
from vericache.sim.turn_kv import ReusedTurn, reusable, reuse_load_s, served_keeps


def simulate_auto(scenario: RemotePrefixScenario, full_kv_only: bool = False) -> SimReport:
    """`mode: auto`; with `full_kv_only`, its choice among the full-KV paths alone: a full-KV
    deployment whose router prices each request by the same cost model and load (as KV-aware
    routers do), the baseline that shows what VeriCache's path adds."""
    start = start_full_routed if full_kv_only else start_auto
    return Run(scenario, weighs_recompute=True).serve(start)


def start_auto(run: Run, prefix: int, turns: SessionTurns, arrival_s: float) -> None:
    _start(run, prefix, turns, arrival_s, path_estimates(run, prefix, turns))


def start_full_routed(run: Run, prefix: int, turns: SessionTurns, arrival_s: float) -> None:
    estimates = path_estimates(run, prefix, turns, with_vericache=False)
    _start(run, prefix, turns, arrival_s, estimates)


def _start(
    run: Run, prefix: int, turns: SessionTurns, arrival_s: float, estimates: list[PathEstimate]
) -> None:
    chosen = choose_path(estimates, turns.num_tokens)
    run.report.paths[chosen.path.value] = run.report.paths.get(chosen.path.value, 0) + 1
    worker = next(w for w in run.workers if w.name == chosen.worker)
    worker.num_requests += 1
    if chosen.path is ServingPath.VERICACHE:
        VeriCacheRequest.start(run, prefix, turns, arrival_s, drafter=worker)
    else:
        FullRequest.open_on(run, prefix, turns, arrival_s, worker, served_keeps(worker))


def path_estimates(
    run: Run, prefix: int, turns: SessionTurns, with_vericache: bool = True
) -> list[PathEstimate]:
    """Every path (the full-KV ones alone, without `with_vericache`) on the worker placement
    gives it, and on the least loaded worker of its kind where that is another (where the placed
    one holds nothing of the prefix, nothing is lost)."""
    estimates = []
    own_bytes = run.own_bytes(turns, run.sequence(turns))  # the same on every path
    placed_verifier = run.choose(run.verifiers, prefix)
    for verifier in _candidates(run.verifiers, placed_verifier):
        estimates.append(_full(run, verifier, ServingPath.FULL_LOCAL, prefix, turns, own_bytes))
    for drafter in _candidates(run.drafters, run.choose(run.drafters, prefix)):
        remote = ServingPath.FULL_WARM if drafter.is_warm(prefix) else ServingPath.FULL_REMOTE
        estimates.append(_full(run, drafter, remote, prefix, turns, own_bytes))
        if with_vericache:
            estimates.append(_vericache(run, drafter, placed_verifier, prefix, turns, own_bytes))
    return estimates


def _candidates(workers: list[Worker], placed: Worker) -> list[Worker]:
    least = min(workers, key=lambda worker: worker.num_requests)
    return [placed] if least is placed else [placed, least]


def _full(
    run: Run, worker: Worker, path: ServingPath, prefix: int, turns: SessionTurns, own_bytes: int
) -> PathEstimate:
    scenario = run.scenario
    num_after = scenario.tokens_after_prefix(turns.history_tokens)
    reused = reusable(worker, turns, served_keeps(worker))
    key = PrefixKey(prefix, False)
    full_bytes = scenario.prefix_bytes(compressed=False)
    session = Session(key, full_bytes, own_bytes - reused.held_bytes)
    room = _room_in_sessions(worker, session)
    setup = _ready_s(worker, key, full_bytes) + _reused_prefill_s(worker, reused, key, num_after)
    row = scenario.row(1, num_after, False, key)
    per_token = _step_s(run, worker, [row], room)
    wait = _memory_wait_s(worker, session, room, setup + turns.num_tokens * per_token)
    slowed = (_batch_slowed(run, worker, [row], room), *_co_runners_slowed(run, [worker], row))
    return PathEstimate(path, worker.name, setup, per_token, wait, slowed)


def _vericache(
    run: Run, drafter: Worker, verifier: Worker, prefix: int, turns: SessionTurns, own_bytes: int
) -> PathEstimate:
    scenario, num_tokens = run.scenario, turns.num_tokens
    num_after = scenario.tokens_after_prefix(turns.history_tokens)
    full, compressed = PrefixKey(prefix, False), PrefixKey(prefix, True)
    compressed_bytes, full_bytes = (scenario.prefix_bytes(c) for c in (True, False))
    is_warm = drafter.is_warm(prefix)
    # A warm node verifies it and prefills its prompt but for what its own turn cache keeps.
    at_node = reusable(drafter, turns, served_keeps(drafter)) if is_warm else ReusedTurn()
    drafted = Session(compressed, compressed_bytes, own_bytes - at_node.held_bytes)
    room = _room_in_sessions(drafter, drafted)
    compressed_ready = _ready_s(drafter, compressed, compressed_bytes)
    draft_row = scenario.row(1, num_after, True, compressed)
    draft_s = _step_s(run, drafter, [draft_row], room)
    prefill_s = _prefill_s(scenario, full, num_after)
    if scenario.warm_nodes:
        draft = (draft_row, draft_s)
        local_s, load_s = _local_seconds_per_token(run, drafter, full, num_after, draft, room)
    drafts_slowed = (_batch_slowed(run, drafter, [draft_row], room),)
    if is_warm:
        setup = compressed_ready + load_s + _reused_prefill_s(drafter, at_node, full, num_after)
        wait = _memory_wait_s(drafter, drafted, room, setup + num_tokens * local_s)
        verify = (_verify_slowed(run, drafter, full, num_after, local_s, [draft_row]),)
        slowed = drafts_slowed + verify + _co_runners_slowed(run, [drafter], draft_row)
        return PathEstimate(ServingPath.VERICACHE, drafter.name, setup, local_s, wait, slowed)
    central_s = _central_seconds_per_token(run, drafter, verifier, draft_s, full, num_after)
    reused = reusable(verifier, turns, served_keeps(verifier))
    setup = compressed_ready + _central_setup_s(run, drafter, verifier, reused, full, num_after)
    per_token, warm_s = central_s, float("inf")
    if scenario.warm_nodes:  # central until its node has the full KV, then on its node
        link = drafter.link
        warm_s = link.backlog_s() + link.seconds_for(compressed_bytes + full_bytes)
        cold_tokens = min(num_tokens, warm_s / central_s)
        setup += cold_tokens * max(0.0, central_s - local_s)
        if cold_tokens < num_tokens:  # the node prefills the prompt after the prefix again
            setup += prefill_s
        per_token = local_s
    service_s = setup + num_tokens * per_token
    # The central verifier admits it first, and holds its full KV while its node is cold:
    # either memory may bind. The sessions ahead of it there may be full-KV ones, which stay for
    # their whole service: it waits as if they were as long as this one.
    verified = Session(full, full_bytes, own_bytes - reused.held_bytes)
    central_room = _room_in_sessions(verifier, verified)
    wait = max(
        _memory_wait_s(drafter, drafted, room, service_s),
        _memory_wait_s(verifier, verified, central_room, service_s),
    )
    verify = _verify_slowed(run, verifier, full, num_after, central_s)
    co_runners = _co_runners_slowed(run, [drafter, verifier], draft_row)
    slowed = (*drafts_slowed, verify, *co_runners)
    return PathEstimate(ServingPath.VERICACHE, drafter.name, setup, per_token, wait, slowed)


def _central_setup_s(
    run: Run, drafter: Worker, verifier: Worker, reused: ReusedTurn, full: PrefixKey, num_after: int
) -> float:
    """Of a central session's setup, all but its compressed KV's fetch: the full KV onto the
    verifier, its prefill there (but for what `reused` spares), and the prompt's exact KV after
    the prefix across to the drafter with the first draft call. The drafter admits the session
    (and fetches its compressed KV) once the verifier's full KV is in: memory in one order
    (VeriCacheRequest.start)."""
    scenario = run.scenario
    full_ready = _ready_s(verifier, full, scenario.prefix_bytes(compressed=False))
    prefill_s = _reused_prefill_s(verifier, reused, full, num_after)
    exact_s = drafter.link.seconds_for(num_after * scenario.kv_bytes_per_token)
    return full_ready + prefill_s + exact_s + scenario.network_latency_s


def _central_seconds_per_token(
    run: Run, drafter: Worker, verifier: Worker, draft_s: float, full: PrefixKey, num_after: int
) -> float:
    """A round drafted on `drafter` (a step: `draft_s`) and verified on the central verifier
    over `num_after` tokens past the prefix (`full`): the draft steps, the verification, the two
    calls' latency and the committed tokens' exact KV across (and a steered kept set's
    refreshes), behind the transfers queued on the drafter's link (it moves one at a time: a
    round's few MB wait out a prefix fetched ahead, and the fetches that keep a link busy now are
    taken to keep it so)."""
    scenario, mean = run.scenario, run.mean_accepted
    x = scenario.draft_len
    verify_row = scenario.row(x + 1, num_after, False, full)
    verify_s = _step_s(run, verifier, [verify_row], 0)
    link = drafter.link
    round_bytes = (mean + 1) * scenario.kv_bytes_per_token + scenario.refresh_bytes_per_round()
    exact_s = link.foreground_wait_s() + round_bytes / link.bytes_per_s
    overhead_s = 2 * scenario.network_latency_s + exact_s
    return round_seconds_per_token(x, draft_s, verify_s, overhead_s, mean)


def _local_seconds_per_token(
    run: Run, drafter: Worker, full: PrefixKey, num_after: int, draft: tuple[Row, float], room: int
) -> tuple[float, float]:
    """A round drafted (`draft`: its row and a step's seconds) and verified on the warm node over
    `num_after` tokens past the prefix (`full`), and the PCIe read of the full KV for each
    verification (none where its device holds a copy), which the sessions it verifies take in
    turn (not its full-KV ones, which read theirs on the device): their rounds go no faster than
    their reads."""
    scenario, mean = run.scenario, run.mean_accepted
    x = scenario.draft_len
    draft_row, draft_s = draft
    verify_row = scenario.row(x + 1, num_after, False, full)
    verify_s = _step_s(run, drafter, [draft_row, verify_row], room)
    full_bytes = scenario.prefix_bytes(compressed=False)
    load_s = 0.0 if drafter.memory.holds(full) else drafter.host_link.seconds_for(full_bytes)
    per_token = round_seconds_per_token(x, draft_s, verify_s, load_s, mean)
    num_sessions = min(drafter.num_local_sessions + 1, room)
    return max(per_token, num_sessions * load_s / (mean + 1)), load_s


def _room_in_sessions(worker: Worker, session: Session) -> int:
    """How many sessions like this one, each over a prefix of its own, the worker's memory holds
    at once (at least one)."""
    memory = worker.memory
    size = session.own_bytes + session.prefix_bytes
    return max(1, memory.capacity_bytes // max(1, size))


def _memory_wait_s(worker: Worker, session: Session, room: int, service_s: float) -> float:
    """Until the worker's memory admits the session: none where it fits now; else its turn
    behind the sessions waiting there (first come, first served), as sessions leave at `room`
    per `service_s` (each taken to last as long as this one)."""
    if worker.memory.fits_now(session):
        return 0.0
    return (worker.memory.num_waiting + 1) * service_s / room


def _ready_s(worker: Worker, key: PrefixKey, nbytes: int) -> float:
    """Until the prefix's KV is on the worker's device: none where held; where it is on its way,
    the link's queue ahead (a bound on what is left of it); else as a fetch sent now would bring
    it (TieredFetch.choose: from the host tier, by a prefill if sooner, or over the link)."""
    if worker.memory.holds(key):
        return 0.0
    if worker.memory.is_fetching(key):
        return worker.link.foreground_wait_s()
    return worker.fetches.ready_s(key, nbytes)


def _step_s(run: Run, worker: Worker, rows: list[Row], room: int) -> float:
    """The worker's next forward with `rows` added to its batch (`_batch`), and the serving work
    it waits for where every core of the machine would compute (`RemotePrefixScenario
    .host_work_s`)."""
    busy = 1 + sum(1 for other in run.workers if other is not worker and _is_busy(other))
    scenario = run.scenario
    return scenario.forward_s(_batch(worker, rows[0], room) + rows) + scenario.host_work_s(busy)


def _batch(worker: Worker, like: Row, room: int) -> list[Row]:
    """The rows of the worker's next forward now, and one more like `like` for each session
    placed there and within its room that has not reached its batch yet (its KV on the way),
    taken to share its prefix with none (its prefix is not known here)."""
    # A prefill's chunks pass in a few forwards (a short one is no verification, whatever its
    # size): the steady batch is the decodes, drafts and verifications.
    current = worker.loop.steady_rows()
    num_placed = max(0, min(worker.num_requests, room) - len(current))
    return current + [like.unshared()] * num_placed


def _batch_slowed(run: Run, worker: Worker, rows: list[Row], room: int) -> Slowed:
    """The requests of the worker's batch, whose steps grow by `rows`."""
    batch = _batch(worker, rows[0], room)
    if not batch:
        return Slowed(0, 1.0)
    forward_s = run.scenario.forward_s
    return Slowed(len(batch), forward_s(batch + rows) / forward_s(batch))


def _verify_slowed(
    run: Run, worker: Worker, full: PrefixKey, num_after: int, per_token_s: float, beside=()
) -> Slowed:
    """The requests of the worker's batch now, slowed by a verification of a round (x + 1 rows
    over `num_after` tokens past the prefix, beside the rows `beside`) once per round of its own:
    a round commits `mean_accepted + 1` tokens at `per_token_s`."""
    scenario = run.scenario
    verify = scenario.row(scenario.draft_len + 1, num_after, False, full)
    batch = worker.loop.steady_rows() + list(beside)
    if not batch:
        return Slowed(0, 1.0)
    added_s = scenario.forward_s(batch + [verify]) - scenario.forward_s(batch)
    round_s = per_token_s * (run.mean_accepted + 1)
    return Slowed(len(batch) - len(beside), 1 + added_s / round_s)


def _co_runners_slowed(run: Run, starting: list[Worker], like: Row) -> tuple[Slowed, ...]:
    """Where the workers share one memory system: the requests of each worker computing now,
    slowed by those of `starting` that are idle now and start computing beside it."""
    if not run.scenario.workers_share_memory:
        return ()
    computing = [w for w in run.workers if _is_busy(w)]
    num_idle = sum(1 for worker in starting if not _is_busy(worker))
    # Each computing worker has the others computing beside it.
    scenario = run.scenario
    factor = scenario.device.slowdown_added(len(computing) - 1, num_idle)
    # The serving work each of their forwards waits for once the starting workers compute too.
    host_s = scenario.host_work_s(len(computing) + num_idle) - scenario.host_work_s(len(computing))
    slowed = []
    for worker in computing:
        batch = _batch(worker, like, worker.num_requests)
        step_s = scenario.forward_s(batch) if batch else 0.0
        extra = (step_s * factor + host_s) / step_s if step_s else factor
        slowed.append(Slowed(len(batch), extra))
    return tuple(slowed)


def _is_busy(worker: Worker) -> bool:
    """Computing now, or with requests placed on it that will."""
    return worker.is_computing or worker.num_requests > 0


def _reused_prefill_s(worker: Worker, reused: ReusedTurn, key: PrefixKey, num_after: int) -> float:
    """The worker's prefill of the prompt's `num_after` tokens after the prefix but for those
    `reused` spares, after their PCIe load where they lie in its host tier."""
    scenario = worker.run.scenario
    return reuse_load_s(worker, reused) + _prefill_s(scenario, key, num_after, reused.num_tokens)


def _prefill_s(
    scenario: RemotePrefixScenario, key: PrefixKey, num_tokens: int, num_reused: int = 0
) -> float:
    """The prompt's `num_tokens` after the prefix prefilled alone, chunk by chunk, but for the
    first `num_reused`, whose KV the worker keeps."""
    rows = scenario.prefill_rows(num_tokens - num_reused, num_reused, key)
    return sum(scenario.forward_s([row]) for row in rows)
