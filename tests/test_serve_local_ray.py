"""`vericache serve --local --host 127.0.0.1` as a process: its own Ray instance, whatever
cluster the machine last knew, with every port of it (Ray's and the server's) on loopback."""

from __future__ import annotations

import contextlib
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from tests.listeners import descendants, listeners
from tests.serve_fixtures import CONTEXT
from vericache.client import Client

pytestmark = pytest.mark.ray

START_TIMEOUT_S = 90.0


@pytest.fixture
def ray_tmpdir():
    """Ray's temporary directory for one server, naming a cluster that no longer runs, as a
    stopped `ray start --head` leaves /tmp/ray/ray_current_cluster. Short: Ray's socket paths
    under it must fit in 107 bytes."""
    path = Path(tempfile.mkdtemp(prefix="vcray-", dir="/tmp"))
    (path / "ray").mkdir()
    (path / "ray" / "ray_current_cluster").write_text("127.0.0.1:9\n")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_a_loopback_server_starts_its_own_ray_on_loopback(tiny_chat_checkpoint, ray_tmpdir):
    argv = [sys.executable, "-m", "vericache.cli.main", "serve", "--local", "--host", "127.0.0.1"]
    argv += ["--port", "0", "--insecure-no-auth", "--drafters", "1", "--device", "cpu"]
    argv += ["--model", str(tiny_chat_checkpoint), "--root", str(ray_tmpdir / "store")]
    argv += ["--threads-per-worker", "1", "--log-interval", "0"]
    env = {**os.environ, "RAY_TMPDIR": str(ray_tmpdir)}
    env.pop("RAY_ADDRESS", None)
    with open(ray_tmpdir / "server.err", "w") as err:
        process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
    started: set[int] = {process.pid}
    try:
        target = _serving_target(process, ray_tmpdir / "server.err")
        with Client(target, timeout=60) as client:  # drafters fetch KV from the verifier
            prefix_id = client.put_prefix(CONTEXT, compressor="streamingllm", ratio=4)
            client.generate("Explain.", prefix_id=prefix_id, max_tokens=4, draft_len=2)
        started |= descendants(process.pid)
        bound = listeners(started)
        assert {"gcs_server", "raylet"} <= {listener.command for listener in bound}
        exposed = [listener for listener in bound if not listener.is_loopback]
        assert exposed == [], exposed
    finally:
        _stop(process, started)


def _serving_target(process: subprocess.Popen, err_path: Path) -> str:
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(line) for line in process.stdout])
    reader.daemon = True
    reader.start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=1.0)
        except queue.Empty:
            if process.poll() is not None:
                break
            continue
        if line.startswith("VeriCache serving on"):
            return line.split()[-1]
    raise AssertionError(f"the server did not start: {err_path.read_text()[-3000:]}")


def _stop(process: subprocess.Popen, pids: set[int]) -> None:
    """SIGTERM drains the server and its Ray instance goes with it; whatever of the tree is
    still there afterwards is killed by its PID (if that PID still names the same process)."""
    started = {pid: _start_time(pid) for pid in pids}
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(10)
    deadline = time.monotonic() + 10
    alive = started
    while alive and time.monotonic() < deadline:
        time.sleep(0.2)
        alive = {pid: at for pid, at in alive.items() if at and _start_time(pid) == at}
    for pid in alive:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _start_time(pid: int) -> int | None:
    """When the process `pid` started (clock ticks since boot); None once it ended or is a
    zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else int(fields[19])
