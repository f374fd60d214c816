"""Two hosts on one machine: network namespaces joined by a veth pair whose bandwidth `tc` limits.

Needs root. Everything lives inside the namespaces the caller creates: the veth ends are made there
(never in the machine's own namespace), the addresses are private and visible only there, and on
exit every process still in a namespace is ended (by pid, as `ip netns pids` lists them) before the
namespace is deleted, so a failed test leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass

SUBNET = "10.203.7"  # a /30 of it: .1 and .2, seen only inside the two namespaces


@dataclass(frozen=True)
class Host:
    namespace: str
    device: str  # this host's end of the veth pair
    address: str

    def command(self, *args: str) -> list[str]:
        """`args` run inside this host's network namespace."""
        return ["ip", "netns", "exec", self.namespace, *args]

    def pids(self) -> list[int]:
        listed = _ip("netns", "pids", self.namespace, check=False).stdout.split()
        return [int(pid) for pid in listed if pid.isdigit()]


def unavailable_reason() -> str | None:
    """Why network namespaces cannot be used here, or None if they can."""
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    probe = f"vc-probe-{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` is not permitted: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


@contextlib.contextmanager
def linked_hosts(
    rate: str, burst: str = "32kbit", latency: str = "50ms"
) -> Iterator[tuple[Host, Host]]:
    """Two namespaces joined by a veth pair; `tc` shapes both directions to `rate` (a tc rate,
    e.g. "8mbit") with a token bucket filter. Names carry the pid so parallel runs never meet."""
    tag = f"vc{os.getpid()}"
    a = Host(f"{tag}-a", "veth-a", f"{SUBNET}.1")
    b = Host(f"{tag}-b", "veth-b", f"{SUBNET}.2")
    created: list[Host] = []
    try:
        for host in (a, b):
            _ip("netns", "add", host.namespace)
            created.append(host)
            _ip("-n", host.namespace, "link", "set", "lo", "up")
        _ip(
            "-n", a.namespace, "link", "add", a.device, "type", "veth",
            "peer", "name", b.device, "netns", b.namespace,
        )  # fmt: skip
        for host in (a, b):
            _ip("-n", host.namespace, "addr", "add", f"{host.address}/30", "dev", host.device)
            _ip("-n", host.namespace, "link", "set", host.device, "up")
            shape = ["qdisc", "add", "dev", host.device, "root", "tbf", "rate", rate]
            _run(host.command("tc", *shape, "burst", burst, "latency", latency))
        yield a, b
    finally:
        for host in created:
            end_processes(host)
            _ip("netns", "del", host.namespace, check=False)


def end_processes(host: Host, grace_s: float = 10.0) -> None:
    """SIGTERM to every process in the host's namespace, SIGKILL to those left after `grace_s`."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        for pid in host.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait_s
        while host.pids() and time.monotonic() < deadline:
            time.sleep(0.2)
        if not host.pids():
            return


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return _run(["ip", *args], check)


def _run(command: list[str], check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(command, capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed: {done.stderr.strip()}")
    return done
