"""The serving side of the prefix-sharing benchmark (bench/prefix_sharing.py): one code's process.

`python -m vericache.bench.prefix_sharing_host` runs with PYTHONPATH on one source tree (the code
before prefix sharing, or the working tree) and its working directory there, so that it and the
Ray workers it starts import that tree's `vericache`; the benchmark's own modules come from the
installed `vericache.bench`, using only what both codes offer. It starts a Ray instance of its own
(one verifier, `--drafters` drafters) and answers each JSON line on its stdin with one JSON line
on `--reply-fd` (its stdout and stderr are its log):
- {"op": "register", "texts": [...], "compressor": {"compressor": name, "ratio": ...}}: registers
  each text as a prefix (the compressor as `Client.put_prefix` takes it) on
  fresh workers, and measures the bytes one FULL_REMOTE fetch of its full KV puts on the link;
- {"op": "start", "max_running": n, "draft_len": x}: a server on fresh workers (one wave of
  cells, each on prefixes the workers have not seen yet);
- {"op": "serve", "jobs": [[prefix_id, prompt], ...], "mode": m, "concurrency": c, ...}: one
  sample of a cell: its requests, c at a time, their outputs and traffic, and the KV each
  worker held meanwhile (`KVMeter`);
- {"op": "stop"}: the server goes; end of input: the process ends.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import ray

import vericache
from vericache.bench.serving import ray_server, ray_session, serve_stream, stream_record
from vericache.client import Client
from vericache.engine.link import LinkSpec
from vericache.serve.config import CoordinatorConfig, DrafterConfig, VerifierConfig

# The sampling period of the workers' KV while a cell is served.
METER_PERIOD_S = 0.25


@dataclass
class WorkerPeak:
    """What one worker held while a cell was served, in bytes of KV."""

    max_sessions: int = 0
    sessions_kv_peak_bytes: int = 0  # the sessions' own caches (before sharing: with the prefix)
    prefix_kv_bytes: int = 0  # its copies of the cell's prefixes (shared, or a drafter's LRU)
    peak_kv_bytes: int = 0  # the most of the two together, at one reading
    sessions_at_peak: int = 0  # its sessions at that reading
    num_readings: int = 0


def _probes():
    """Readings that no worker handle offers, run inside the Ray actor (`__ray_call__`) on its
    private state, as both codes keep it. Defined in a function so that Ray sends them by value:
    the worker need not import this module, whichever tree it runs."""

    def verifier_kv(worker, prefix_ids: list[str]) -> tuple[int, int]:
        """(sessions, bytes of its shared copies of these prefixes' full KV)."""
        records = [worker.get_prefix(prefix_id) for prefix_id in prefix_ids]
        keys = {(record.tenant, record.token_ids) for record in records}
        held = list(worker._prefix_copies._held.items())
        return len(worker._sessions), sum(h.nbytes for key, h in held if key in keys)

    def drafter_kv(worker, prefix_ids: list[str]) -> tuple[int, int, int]:
        """(sessions, their caches' bytes, bytes of its copies of these prefixes' KV): the
        copies are a SharedPrefixes after sharing, each fetcher's LRU before it."""
        with worker._lock:
            caches = [session.cache for session in worker._sessions.values()]
        nbytes = 0
        for cache in caches:
            with contextlib.suppress(AttributeError):  # released meanwhile
                nbytes += cache.nbytes
        if hasattr(worker, "_prefixes"):
            copies = [(key, h.cache) for key, h in list(worker._prefixes._held.items())]
        else:
            copies = [
                (key, cache)
                for fetcher in list(worker._fetchers.values())
                for key, cache in list(fetcher.cached._entries.items())
            ]
        prefix = sum(cache.nbytes for (prefix_id, _), cache in copies if prefix_id in prefix_ids)
        return len(caches), nbytes, prefix

    def vericache_file(worker) -> str:
        return sys.modules["vericache"].__file__

    return verifier_kv, drafter_kv, vericache_file


VERIFIER_KV, DRAFTER_KV, VERICACHE_FILE = _probes()


@dataclass
class KVMeter:
    """Reads every worker's KV each METER_PERIOD_S while a cell is served: the verifier's
    sessions through its handle (`residency()`, whose peak also catches a high between
    readings), the rest through `_probes`, counting only the copies of the cell's prefixes."""

    server: object
    prefix_ids: list[str]
    verifier_sessions: int  # the most the verifier holds: the cell's, where the mode opens them
    peaks: dict[str, WorkerPeak] = field(default_factory=dict)
    _residency_peak: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> KVMeter:
        self._residency_peak = self._verifier_residency().peak_bytes
        self.peaks = {name: WorkerPeak() for name in self._read()}
        self._thread = threading.Thread(target=self._run, name="kv-meter", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._record(self._read())  # the cell's last state: its copies are still held
        # The verifier's own peak is exact where the cell set a new high.
        peak = self._verifier_residency().peak_bytes
        verifier = self.peaks["verifier-0"]
        if peak > self._residency_peak:
            verifier.sessions_kv_peak_bytes = max(verifier.sessions_kv_peak_bytes, peak)
            if peak + verifier.prefix_kv_bytes > verifier.peak_kv_bytes:
                verifier.peak_kv_bytes = peak + verifier.prefix_kv_bytes
                verifier.sessions_at_peak = self.verifier_sessions

    def _run(self) -> None:
        while not self._stop.wait(METER_PERIOD_S):
            try:
                self._record(self._read())
            except Exception as error:  # noqa: BLE001 - a missed reading, not a failed cell
                print(f"[prefix-sharing] KV reading failed: {error!r}", file=sys.stderr)

    def _record(self, readings: dict[str, tuple[int, int, int]]) -> None:
        for name, (sessions, sessions_bytes, prefix_bytes) in readings.items():
            peak = self.peaks[name]
            peak.max_sessions = max(peak.max_sessions, sessions)
            peak.sessions_kv_peak_bytes = max(peak.sessions_kv_peak_bytes, sessions_bytes)
            peak.prefix_kv_bytes = max(peak.prefix_kv_bytes, prefix_bytes)
            if sessions_bytes + prefix_bytes > peak.peak_kv_bytes:
                peak.peak_kv_bytes = sessions_bytes + prefix_bytes
                peak.sessions_at_peak = sessions
            peak.num_readings += 1

    def _read(self) -> dict[str, tuple[int, int, int]]:
        """Worker name -> (sessions, sessions' KV bytes, bytes of copies of the cell's
        prefixes)."""
        backend = self.server.coordinator.backend
        (verifier,) = backend.verifiers
        sessions, prefix_bytes = ray.get(
            verifier.worker.__ray_call__.remote(VERIFIER_KV, self.prefix_ids)
        )
        readings = {"verifier-0": (sessions, self._verifier_residency().bytes, prefix_bytes)}
        for i, drafter in enumerate(backend.drafters):
            call = drafter.worker.__ray_call__.remote(DRAFTER_KV, self.prefix_ids)
            readings[f"drafter-{i}"] = ray.get(call)
        return readings

    def _verifier_residency(self):
        (verifier,) = self.server.coordinator.backend.verifiers
        return self.server.run(verifier.residency())


class Host:
    """One code's Ray instance, store and current server."""

    def __init__(self, model: str, num_drafters: int, link_bytes_per_s: float, cache_bytes: int):
        self.num_drafters = num_drafters
        self._root = Path(tempfile.mkdtemp(prefix="vc-prefix-sharing-"))
        self.verifier = VerifierConfig(
            model=model, root=self._root, link=LinkSpec(link_bytes_per_s),
            prefix_cache_bytes=cache_bytes,
        )  # fmt: skip
        self.drafter = DrafterConfig(model=model, kv_cache_bytes=cache_bytes)
        self._open = LinkSpec()  # registration: an open link
        self._server = None
        self._stack = contextlib.ExitStack()

    def register(self, texts: list[str], compressor: dict) -> dict:
        verifier = replace(self.verifier, link=self._open)
        with ray_server(verifier, self.drafter, 1) as server, Client(server.target) as client:
            backend = server.coordinator.backend
            workers = [handle.worker for handle in [*backend.verifiers, *backend.drafters]]
            files = ray.get([worker.__ray_call__.remote(VERICACHE_FILE) for worker in workers])
            prefixes = [_register(client, text, compressor) for text in texts]
        return {"prefixes": prefixes, "worker_vericache_files": files}

    def start(self, max_running: int, draft_len: int) -> dict:
        self.stop()
        config = CoordinatorConfig(default_draft_len=draft_len, max_running=max_running)
        started = time.perf_counter()
        self._server = self._stack.enter_context(
            ray_server(self.verifier, self.drafter, self.num_drafters, config)
        )
        return {"startup_s": time.perf_counter() - started}

    def serve(self, jobs, mode: str, max_tokens: int, draft_len: int, concurrency: int) -> dict:
        jobs = [tuple(job) for job in jobs]
        prefix_ids = sorted({prefix_id for prefix_id, _ in jobs})
        on_verifier = concurrency if mode in ("vericache", "full_local") else 0
        with KVMeter(self._server, prefix_ids, on_verifier) as meter:
            wall_s, results, _, _ = serve_stream(
                self._server.target, jobs, mode, max_tokens, draft_len, concurrency
            )
        sample = stream_record(wall_s, results)
        sample["workers"] = {name: asdict(peak) for name, peak in meter.peaks.items()}
        sample["requests"] = [
            {k: result.stats[k] for k in ("store_bytes", "link_bytes", "num_tokens")}
            for result in results
        ]
        return {"sample": sample, "outputs": [result.token_ids for result in results]}

    def operations(self) -> dict:
        """What the driver may ask, by the name its request line gives."""
        return {
            "register": self.register,
            "start": self.start,
            "serve": self.serve,
            "stop": self.stop,
        }

    def stop(self) -> dict:
        self._stack.close()
        self._server = None
        return {}

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self._root, ignore_errors=True)


def _register(client, text: str, compressor: dict) -> dict:
    """Registers one prefix; one FULL_REMOTE request (one output token) measures the bytes its
    full KV puts on the link."""
    prefix_id = client.put_prefix(text=text, **compressor)
    info = client.get_prefix(prefix_id)
    fetch = client.generate("?", prefix_id=prefix_id, mode="full_remote", max_tokens=1)
    return {
        "prefix_id": prefix_id,
        "num_tokens": info.num_tokens,
        "full_kv_bytes": info.full_kv_bytes,
        "compressed_wire_bytes": info.compressed_kv_bytes,
        "full_wire_bytes": fetch.stats["link_bytes"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--drafters", type=int, default=2)
    parser.add_argument("--link-bytes-per-s", type=float, required=True)
    parser.add_argument("--prefix-cache-bytes", type=int, required=True)
    parser.add_argument("--reply-fd", type=int, required=True, help="where the replies go")
    args = parser.parse_args()
    os.set_inheritable(args.reply_fd, False)  # Ray's processes must not hold it open
    replies = os.fdopen(args.reply_fd, "w", buffering=1)
    with ray_session(args.drafters):
        host = Host(args.model, args.drafters, args.link_bytes_per_s, args.prefix_cache_bytes)
        replies.write(json.dumps({"vericache_file": vericache.__file__}) + "\n")
        try:
            for line in sys.stdin:
                request = json.loads(line)
                op = request.pop("op")
                try:
                    reply = host.operations()[op](**request)
                except Exception as error:  # noqa: BLE001 - the driver reports it and stops
                    reply = {"error": f"{op}: {type(error).__name__}: {error}"}
                replies.write(json.dumps(reply) + "\n")
        finally:
            host.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
