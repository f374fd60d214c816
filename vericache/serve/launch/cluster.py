"""Starting workers: in this process (tests, benchmarks) or as Ray actors placed by resource.

Verifier actors need the custom resource `verifier` (nodes beside the store), drafter actors the
resource `drafter` (remote GPUs). An actor whose resource no node offers waits forever, so
placement waits at most `placement_timeout_s` and then says which resource is missing. Drafter
handles pay the verifier link's emulated latency on every call (`LinkSpec.latency`). Workers get
the server's secret in their configs (a new one, unless the configs carry one); the drafter
handles issue, with it, each session's grant to fetch its prefix's KV.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid

from vericache.errors import WorkerUnavailableError
from vericache.model.loader import load_tokenizer, resolve_model_dir
from vericache.serve.backends.distributed import DistributedBackend
from vericache.serve.cluster_secret import ClusterSecret
from vericache.serve.config import CoordinatorConfig, DrafterConfig, VerifierConfig
from vericache.serve.front.coordinator import Coordinator
from vericache.serve.workers.drafter import Drafter
from vericache.serve.workers.handles import (
    MAX_CONCURRENT_CALLS,
    PROBE_GROUP,
    DrafterHandle,
    InProcess,
    OverRay,
    VerifierHandle,
)
from vericache.serve.workers.verifier import Verifier

VERIFIER_RESOURCE = "verifier"
DRAFTER_RESOURCE = "drafter"


async def start_coordinator(
    verifiers: list[VerifierHandle],
    drafters: list[DrafterHandle],
    model: str,
    config: CoordinatorConfig | None = None,
) -> Coordinator:
    tokenizer = load_tokenizer(resolve_model_dir(model))
    config = config or CoordinatorConfig()
    backend = DistributedBackend(verifiers, drafters, config)
    try:
        return await Coordinator(backend, tokenizer, model, config).start()
    except BaseException:
        await asyncio.gather(*(w.shutdown() for w in [*verifiers, *drafters]))
        raise


def in_process_workers(
    verifier: VerifierConfig, drafter: DrafterConfig, num_drafters: int
) -> tuple[list[VerifierHandle], list[DrafterHandle]]:
    """One verifier and `num_drafters` drafters, each on a thread pool of its own here."""
    verifier, drafter = with_secret(verifier, drafter)
    verifiers = [VerifierHandle(Verifier(verifier), InProcess("verifier-0"), "verifier-0")]
    latency, secret = verifier.link.latency, verifier.secret
    drafters = [
        DrafterHandle(Drafter(drafter), InProcess(f"drafter-{i}"), f"drafter-{i}", secret, latency)
        for i in range(num_drafters)
    ]
    return verifiers, drafters


def with_secret(
    verifier: VerifierConfig, drafter: DrafterConfig
) -> tuple[VerifierConfig, DrafterConfig]:
    """Both configs carrying one secret: the verifier's, or a new one."""
    secret = verifier.secret or ClusterSecret.generate()
    return (
        dataclasses.replace(verifier, secret=secret),
        dataclasses.replace(drafter, secret=secret),
    )


def ray_workers(
    verifier: VerifierConfig,
    drafter: DrafterConfig,
    num_verifiers: int,
    num_drafters: int,
    placement_timeout_s: float = 120.0,
    num_cpus_per_worker: float = 0.0,
) -> tuple[list[VerifierHandle], list[DrafterHandle]]:
    """Ray actors placed by resource. The KVTransfer service of each verifier listens on
    `verifier.transfer_host`, or on the address of the node it lands on when that is None.
    Call after `ray.init`."""
    import ray

    verifier, drafter = with_secret(verifier, drafter)
    group = uuid.uuid4().hex[:6]  # several servers may share one cluster

    def actor(cls, resource: str, config, name: str):
        # A crashed actor restarts (its store and catalog persist on disk); calls that find it
        # gone fail at once, and the coordinator moves their requests elsewhere. Task events
        # (Ray's per-call records for its dashboard) add about a third to a worker's CPU per
        # call: the round's calls go without them.
        options = dict(
            resources={resource: 1}, num_cpus=num_cpus_per_worker, name=name,
            max_concurrency=MAX_CONCURRENT_CALLS, max_restarts=-1, max_task_retries=0,
            enable_task_events=False,
        )  # fmt: skip
        # Probes on a thread of their own (handles.PROBE_GROUP): the class's, not a call's option.
        remote_class = ray.remote(concurrency_groups={PROBE_GROUP: 1})(cls)
        return remote_class.options(**options).remote(config)

    verifiers = [
        actor(_RayVerifier, VERIFIER_RESOURCE, verifier, f"vericache-{group}-verifier-{i}")
        for i in range(num_verifiers)
    ]
    drafters = [
        actor(Drafter, DRAFTER_RESOURCE, drafter, f"vericache-{group}-drafter-{i}")
        for i in range(num_drafters)
    ]
    _wait_placed(verifiers, drafters, placement_timeout_s)
    latency = verifier.link.latency
    return (
        [
            VerifierHandle(actor, OverRay(f"verifier-{i}"), f"verifier-{i}")
            for i, actor in enumerate(verifiers)
        ],
        [
            DrafterHandle(actor, OverRay(f"drafter-{i}"), f"drafter-{i}", verifier.secret, latency)
            for i, actor in enumerate(drafters)
        ],
    )


class _RayVerifier(Verifier):
    """A verifier whose KVTransfer service listens on the address of the node it was placed on
    (`transfer_host=None`), which only the actor knows."""

    def __init__(self, config: VerifierConfig):
        if config.transfer_host is None:
            config = dataclasses.replace(config, transfer_host=_this_node_address())
        super().__init__(config)


def _this_node_address() -> str:
    import ray

    node_id = ray.get_runtime_context().get_node_id()
    for node in ray.nodes():
        if node["NodeID"] == node_id:
            return node["NodeManagerAddress"]
    raise WorkerUnavailableError(f"this actor's node {node_id} is not in the Ray cluster")


def _wait_placed(verifiers: list, drafters: list, timeout_s: float) -> None:
    import ray

    pending = {actor.describe.remote(): (actor, VERIFIER_RESOURCE) for actor in verifiers} | {
        actor.describe.remote(): (actor, DRAFTER_RESOURCE) for actor in drafters
    }
    deadline = time.monotonic() + timeout_s
    while pending:
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=deadline - time.monotonic())
        if not ready:
            missing = sorted({resource for _, resource in pending.values()})
            for actor in [*verifiers, *drafters]:
                ray.kill(actor)
            raise WorkerUnavailableError(_placement_message(missing, timeout_s))
        ray.get(ready[0])  # raises the actor's own start-up error
        del pending[ready[0]]


def _placement_message(missing: list[str], timeout_s: float) -> str:
    import ray

    offered = ray.cluster_resources()
    lacking = [r for r in missing if offered.get(r, 0) <= 0]
    if lacking:
        return (
            f"no node of the Ray cluster offers the resource(s) {', '.join(lacking)}: start "
            "verifier and drafter nodes with e.g. `ray start --resources "
            "'{\"verifier\": 1}'` (cluster resources now: "
            f"{dict(sorted(offered.items()))})"
        )
    return (
        f"{', '.join(missing)} actors were not placed within {timeout_s:.0f} s: every node "
        "offering the resource is busy, or the actor is still loading the model"
    )
