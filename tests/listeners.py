"""The sockets a process tree listens on, read from /proc as `ss -tlnp` and `ss -ulnp` read them
(without ss's dependence on being installed): TCP sockets in LISTEN, UDP sockets unconnected."""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

TCP_LISTEN = "0A"
UDP_UNCONNECTED = "07"


@dataclass(frozen=True)
class Listener:
    pid: int
    command: str  # the process's name, as `ps -o comm` shows it
    protocol: str  # tcp, tcp6, udp or udp6
    address: ipaddress.IPv4Address | ipaddress.IPv6Address
    port: int

    @property
    def is_loopback(self) -> bool:
        mapped = getattr(self.address, "ipv4_mapped", None)  # [::ffff:127.0.0.1]
        return self.address.is_loopback or (mapped is not None and mapped.is_loopback)


def descendants(root: int) -> set[int]:
    """`root` and every process below it, now."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process ended meanwhile
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, pending = set(), [root]
    while pending:
        pid = pending.pop()
        if pid not in found:
            found.add(pid)
            pending.extend(children.get(pid, []))
    return found


def listeners(pids: set[int]) -> list[Listener]:
    """Every listening socket any of `pids` holds."""
    owners = {inode: pid for pid in pids for inode in _socket_inodes(pid)}
    found = []
    for protocol, state in [("tcp", TCP_LISTEN), ("tcp6", TCP_LISTEN)] + [
        ("udp", UDP_UNCONNECTED),
        ("udp6", UDP_UNCONNECTED),
    ]:
        for address, port, inode in _sockets(protocol, state):
            if inode in owners:
                pid = owners[inode]
                found.append(Listener(pid, _command(pid), protocol, address, port))
    return found


def _socket_inodes(pid: int) -> set[int]:
    inodes = set()
    try:
        for fd in os.scandir(f"/proc/{pid}/fd"):
            target = os.readlink(fd.path)
            if target.startswith("socket:["):
                inodes.add(int(target[len("socket:[") : -1]))
    except OSError:  # ended, or not ours to read
        pass
    return inodes


def _sockets(protocol: str, state: str):
    lines = Path(f"/proc/net/{protocol}").read_text().splitlines()[1:]
    for line in lines:
        fields = line.split()
        if fields[3] == state:
            host, port = fields[1].split(":")
            yield _address(host), int(port, 16), int(fields[9])


def _address(hex_host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    # The kernel prints each 32-bit word of the address in host (little-endian) byte order.
    raw = bytes.fromhex(hex_host)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return ipaddress.ip_address(words)


def _command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"
