"""Ray for `vericache serve`: its own instance on this machine (`--local`), or a running cluster.

`--local` never joins another instance: `address="local"` passes over $RAY_ADDRESS and the cluster
that /tmp/ray/ray_current_cluster names (a stopped `ray start --head` leaves it behind).

Ray binds its listeners by the node's address: the GCS, the raylet and object manager and every
core worker's gRPC server, the dashboard agent (gRPC, HTTP) and its metrics exporter, the
runtime-env agent, and the autoscaler's and dashboard head's metrics servers go to loopback when
that address is loopback, else to the machine's address or every interface. On Linux ray.init
cannot be given a loopback node address (it rewrites `_node_ip_address="127.0.0.1"` to the
machine's), so a server on loopback turns on Ray's single-machine setting
(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, the default on macOS and Windows), under which the node's
address is loopback; other machines cannot join such an instance, and none should.
"""

from __future__ import annotations

import ipaddress
import os

from vericache.errors import VeriCacheError

# Ray's single-machine setting: read once, when ray is imported, into ray_constants.
SINGLE_MACHINE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


class RayNotOnLoopbackError(VeriCacheError):
    """Ray's node came up on an address other than loopback although the server serves on
    loopback: its ports would be open to the network, so the server does not start."""


def is_loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name
        return False


def ray_init_options(args) -> dict:
    """ray.init's keywords: a fresh instance offering the workers' resources (`--local`), or the
    cluster at `--address`."""
    if not args.local:
        return dict(address=args.address, log_to_driver=False)
    return dict(
        address="local",
        resources={"verifier": args.verifiers, "drafter": args.drafters},
        include_dashboard=False,
        log_to_driver=False,
    )


def start_ray(args) -> None:
    is_on_loopback = args.local and is_loopback(args.host)
    if is_on_loopback:
        _single_machine_node()
    import ray

    ray.init(**ray_init_options(args))
    if is_on_loopback:
        _check_node_on_loopback(ray)


def _single_machine_node() -> None:
    # The environment reaches Ray's own processes and a ray imported later; the constant, a ray
    # already imported (the node's address is looked up when ray.init starts the node).
    os.environ[SINGLE_MACHINE_ENV] = "0"
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False


def _check_node_on_loopback(ray) -> None:
    # The single-machine setting is Ray's private one and may change in a later release: check
    # that it took, and fail closed.
    node_address = ray.util.get_node_ip_address()
    if not is_loopback(node_address):
        ray.shutdown()
        raise RayNotOnLoopbackError(
            f"Ray's node took the address {node_address}, not loopback, so its ports would be "
            "reachable from the network; this Ray release does not keep a local instance on "
            "loopback (--host 0.0.0.0 serves on every interface knowingly)"
        )
