"""Prefix sharing (issue 39): what one verifier and two drafters hold and move when 1, 8 or 32
sessions at once read one prefix or four, and how fast they decode, before sessions shared
their prefix's KV (`--before-commit`, whose sessions each copied their prefix) and after (the
working tree).

Each code runs in a process of its own (bench/prefix_sharing_host.py) with PYTHONPATH on its
tree, its own Ray instance (one verifier, `--drafters` drafters, one thread each: a worker stands
for one GPU, the drafters behind a `--link-mb-s` link) and its own store, where it registers the
same stdlib modules as prefixes. A cell is (mode, sessions, prefixes): max(sessions, prefixes)
requests over that many prefixes in turn (request i asks CONTEXT_PROMPTS[i // P % 3] about prefix
i % P), `sessions` in flight at once, greedy, one wave on prefixes the workers have not seen:
every prefix read from the store and sent over the link in the cell. Modes: VERICACHE (drafters
draft over compressed KV, the verifier verifies), FULL_LOCAL (the verifier decodes alone from its
store: the reference output), FULL_REMOTE (the drafters fetch full KV over the link and decode
alone). Per repeat, mode and session count, each code in turn starts a server on fresh workers
and serves that session count's cells, each on prefixes new to the server (the cells with P
prefixes read the same P on each server); the code served first alternates, so that each sample
is set against the other code's of the same cell, served beside it on the same machine. One
server is up at a time: at 32 sessions the before code's copies of the prefix fill most of a
24 GB machine.

Per cell and code: tokens/s (output tokens / the wave's wall seconds; the median of `--repeats`
samples, with the smallest and largest); store and link bytes per request (the client's
`Result.stats`); each worker's peak KV: its sessions' caches (the verifier's through
`residency()`) and its copies of the cell's prefixes, read every 0.25 s (the drafters' sessions
and every worker's copies of given prefixes through a probe of the actor's private state: no
handle reports them). Each worker holds prefixes within `--prefix-cache-mib`, the same for both
codes: a cell's prefixes fit, and the earlier cells' make room for them.

Summary, at the largest session count on one prefix (`headline_cell`), the working tree:
- store_bytes_per_request_over_prefix / link_bytes_per_request_over_prefix, per mode: (bytes
  per request - what the session's own tokens move on that path) / (one copy of the prefix on
  that path / sessions per prefix); target <= 1.1 (1.0: one copy per prefix, shared by all);
- peak_kv_over_allowance, per mode and worker: the peak over (its copies of the prefixes in use
  + its sessions at that reading x the most own tokens of a request, at the full KV of a
  token); target <= 1.0; peak_kv_bytes_by_code: the peaks themselves, before and after;
- vericache_gain_at_32_sessions: VERICACHE tokens/s after over before, each sample over the one
  served beside it: the median, with vericache_gain_at_32_sessions_range; target >= 2;
- identical: every sample's outputs equal FULL_LOCAL's on the same prefixes;
- meets_targets: each target over every cell of the working tree; `missed` lists the cells.
Run with OMP_NUM_THREADS=1 on a machine with a core per worker, nothing else busy and about
20 GB of memory free (the before code's 32 sessions).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import vericache
from vericache.bench.common import (
    compressor_from_label,
    environment,
    int_list,
    str_list,
    token_range,
)
from vericache.bench.prefix_sharing_plot import plot  # noqa: F401 - the CLI's plot(result, path)
from vericache.bench.prefix_sharing_summary import (
    CODES,
    DEFINITIONS,
    MODES,
    Layout,
    SharingSpec,
    cell_records,
    summarize,
)
from vericache.bench.remote_prefix_cells import request_stream
from vericache.bench.workloads import code_contexts
from vericache.engine.prompt import build_chat_prompt
from vericache.errors import InvalidRequestError
from vericache.model.loader import DEFAULT_MODEL, load_tokenizer, resolve_model_dir

# The last commit whose sessions each copied their prefix.
BEFORE_COMMIT = "19513a3"


def add_arguments(parser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--compressor", default="snapkv-4x-bf16", help="label, e.g. kivi-4bit")
    parser.add_argument(
        "--codes", type=str_list, help="before,after (the default); `after` needs no git history"
    )
    parser.add_argument("--before-commit", default=BEFORE_COMMIT)
    parser.add_argument(
        "--before-tree", type=Path, help="a checkout of the before code (default: the commit, "
        "exported with git archive into a temporary folder)",
    )  # fmt: skip
    parser.add_argument("--modes", type=str_list, help="vericache,full_local,full_remote")
    parser.add_argument("--sessions", type=int_list, help="in flight per cell (1,8,32; quick 1,8)")
    parser.add_argument("--prefixes", type=int_list, help="prefixes they read (1,4; quick 1,2)")
    parser.add_argument(
        "--prefix-tokens", type=token_range, help="MIN,MAX per prefix (2000,3000; quick 1000,1500)"
    )
    parser.add_argument("--max-tokens", type=int, help="output tokens per request (32; quick 16)")
    parser.add_argument("--draft-len", type=int, default=30)
    parser.add_argument("--repeats", type=int, help="samples per cell and code (3; quick 1)")
    parser.add_argument("--drafters", type=int, default=2)
    parser.add_argument("--link-mb-s", type=float, default=100.0, help="the drafters' link")
    parser.add_argument(
        "--prefix-cache-mib", type=int, default=1024,
        help="each worker's copies of prefixes (verifier) and prefix cache (drafter)",
    )  # fmt: skip


def sharing_spec(args) -> SharingSpec:
    def pick(value, full, quick):
        return value if value is not None else (quick if args.quick else full)

    return SharingSpec(
        codes=tuple(pick(args.codes, CODES, CODES)),
        modes=tuple(pick(args.modes, MODES, MODES)),
        session_counts=tuple(pick(args.sessions, (1, 8, 32), (1, 8))),
        prefix_counts=tuple(pick(args.prefixes, (1, 4), (1, 2))),
        prefix_tokens=pick(args.prefix_tokens, (2000, 3000), (1000, 1500)),
        max_tokens=pick(args.max_tokens, 32, 16),
        draft_len=args.draft_len,
        repeats=pick(args.repeats, 3, 1),
        compressor=args.compressor,
        num_drafters=args.drafters,
        link_bytes_per_s=args.link_mb_s * 1e6,
        prefix_cache_bytes=args.prefix_cache_mib << 20,
        before_commit=args.before_commit,
    )


# --- The codes -----------------------------------------------------------------------------------


def repository_root() -> Path:
    """The tree this process imports vericache from: the working tree."""
    return Path(vericache.__file__).resolve().parents[1]


@contextlib.contextmanager
def code_trees(spec: SharingSpec, before_tree: Path | None) -> Iterator[dict[str, Path]]:
    with contextlib.ExitStack() as stack:
        trees = {"after": repository_root()}
        if "before" in spec.codes:
            trees["before"] = (
                before_tree.resolve()
                if before_tree
                else stack.enter_context(exported(repository_root(), spec.before_commit))
            )
        for code in spec.codes:
            if not (trees[code] / "vericache" / "__init__.py").is_file():
                raise InvalidRequestError(f"{trees[code]} holds no vericache package")
        yield {code: trees[code] for code in spec.codes}


@contextlib.contextmanager
def exported(root: Path, commit: str) -> Iterator[Path]:
    """The commit's files in a temporary folder (`git archive`: no worktree to clean up)."""
    archive = subprocess.run(["git", "-C", str(root), "archive", commit], capture_output=True)
    if archive.returncode:
        raise InvalidRequestError(
            f"cannot export commit {commit} from {root} ({archive.stderr.decode().strip()}): "
            "pass --before-tree, or --codes after"
        )
    with tempfile.TemporaryDirectory(prefix="vc-before-") as directory:
        with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
            tar.extractall(directory, filter="data")
        yield Path(directory)


def _git(root: Path, *argv: str) -> str | None:
    done = subprocess.run(["git", "-C", str(root), *argv], capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else None


class CodeProcess:
    """One code's host process (bench/prefix_sharing_host.py), asked a JSON line at a time."""

    def __init__(self, code: str, tree: Path, spec: SharingSpec, model: str, log_dir: Path):
        self.code, self.tree = code, tree
        self.log_path = log_dir / f"{code}.log"
        read_fd, write_fd = os.pipe()
        paths = [str(tree), *filter(None, [os.environ.get("PYTHONPATH")])]
        # A fresh Ray instance of its own, whatever else runs on the machine.
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths), RAY_ADDRESS="local")
        argv = [
            sys.executable, "-m", "vericache.bench.prefix_sharing_host", "--model", model,
            "--drafters", str(spec.num_drafters), "--reply-fd", str(write_fd),
            "--link-bytes-per-s", str(spec.link_bytes_per_s),
            "--prefix-cache-bytes", str(spec.prefix_cache_bytes),
        ]  # fmt: skip
        with open(self.log_path, "w") as log:
            self._process = subprocess.Popen(
                argv, cwd=tree, env=env, stdin=subprocess.PIPE, stdout=log,
                stderr=subprocess.STDOUT, pass_fds=(write_fd,), text=True,
            )  # fmt: skip
        os.close(write_fd)
        self._replies = os.fdopen(read_fd)
        self.vericache_file: str | None = None  # the host's first line says, once it runs
        self.seconds: dict[str, float] = {}  # per operation, in all

    def send(self, op: str, **fields) -> None:
        self._process.stdin.write(json.dumps({"op": op, **fields}) + "\n")
        self._process.stdin.flush()

    def receive(self) -> dict:
        line = self._replies.readline()
        reply = json.loads(line) if line else {"error": "the process ended"}
        if "error" in reply:
            tail = self.log_path.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{self.code} code: {reply['error']}\n{self.log_path}:\n{tail}")
        return reply

    def call(self, op: str, **fields) -> dict:
        started = time.perf_counter()
        self.send(op, **fields)
        reply = self.receive()
        self.seconds[op] = self.seconds.get(op, 0.0) + time.perf_counter() - started
        return reply

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._process.stdin.close()
        try:
            self._process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._replies.close()


# --- The benchmark -------------------------------------------------------------------------------


def run(args) -> dict:
    spec = sharing_spec(args)
    model = _model_argument(args.model)
    tokenizer = load_tokenizer(resolve_model_dir(model))
    contexts = code_contexts(tokenizer, *spec.prefix_tokens, sum(spec.prefix_counts), truncate=True)
    texts = [context.text for context in contexts]
    with (
        code_trees(spec, args.before_tree) as trees,
        tempfile.TemporaryDirectory(prefix="vc-prefix-sharing-") as log_dir,
        contextlib.ExitStack() as stack,
    ):
        started = time.perf_counter()
        hosts = {}
        for code, tree in trees.items():
            hosts[code] = CodeProcess(code, tree, spec, model, Path(log_dir))
            stack.callback(hosts[code].close)
        codes = _register(hosts, texts, spec)
        plans = _plans(spec, contexts, codes, tokenizer)
        registered = time.perf_counter()
        samples, startup_s = _serve_all(hosts, spec, plans)
        served = time.perf_counter()
    stage_s = {
        "start_and_register": registered - started,
        "serve": served - registered,
        **{f"{code} {op}": s for code, host in hosts.items() for op, s in host.seconds.items()},
    }
    cells = cell_records(samples, plans, spec)
    return {
        "benchmark": "prefix-sharing",
        "summary": summarize(cells, spec),
        "definitions": DEFINITIONS,
        "config": {**asdict(spec), "model": args.model, "quick": args.quick},
        "environment": environment(),
        "codes": {
            code: {k: v for k, v in info.items() if k != "prefixes"} for code, info in codes.items()
        },
        "prefixes": _prefix_records(spec, contexts, codes),
        "stage_s": stage_s,
        "server_startup_s": startup_s,
        "cells": cells,
    }


def _register(hosts: dict[str, CodeProcess], texts: list[str], spec: SharingSpec) -> dict:
    """Every code registers every prefix, at the same time; each code's record, checked to run
    the tree it was given (the host and its Ray workers)."""
    for host in hosts.values():  # queued while the hosts start, each with its Ray instance
        host.send("register", texts=texts, compressor=_put_prefix_compressor(spec.compressor))
    codes = {}
    for code, host in hosts.items():
        host.vericache_file = host.receive()["vericache_file"]
        reply = host.receive()
        for imported in (host.vericache_file, *reply["worker_vericache_files"]):
            if not Path(imported).resolve().is_relative_to(host.tree.resolve()):
                raise RuntimeError(f"the {code} code imported {imported}, not {host.tree}")
        commit = _git(host.tree, "rev-parse", "HEAD") or _git(
            repository_root(), "rev-parse", spec.before_commit
        )
        codes[code] = {
            "tree": str(host.tree),
            "commit": commit,
            "uncommitted_changes": bool(_git(host.tree, "status", "--porcelain")),
            "vericache_file": host.vericache_file,
            "worker_vericache_files": reply["worker_vericache_files"],
            "prefixes": reply["prefixes"],
        }
        print(f"[prefix-sharing] {code}: {len(texts)} prefixes registered")
    return codes


def _put_prefix_compressor(label: str) -> dict:
    """A compressor label as `Client.put_prefix`'s arguments, resolved here: a host runs the
    before code, whose modules may lack the label parser's imports."""
    params = compressor_from_label(label).spec()["params"]
    names = ("ratio", "bits", "dtype")
    return {"compressor": label.split("-", 1)[0], **{k: params.get(k) for k in names}}


def _plans(spec: SharingSpec, contexts, codes: dict, tokenizer) -> dict[Layout, dict]:
    """Per layout: its prefixes (each code's records: the cells with P prefixes read the same
    ones, on servers of their own), each code's requests, and the tokens of each request's prompt
    after its prefix."""
    plans = {}
    for layout in spec.layouts:
        chosen = _prefix_group(spec, layout.num_prefixes)
        jobs = {
            code: request_stream(
                [info["prefixes"][i]["prefix_id"] for i in chosen], layout.num_requests
            )
            for code, info in codes.items()
        }
        prompts = request_stream(list(chosen), layout.num_requests)
        suffix_tokens = []
        for index, prompt in prompts:
            ids = build_chat_prompt(tokenizer, contexts[index].text, prompt)
            suffix_tokens.append(len(ids.token_ids) - ids.num_prefix_tokens)
        plans[layout] = {
            "prefixes": {
                code: [info["prefixes"][i] for i in chosen] for code, info in codes.items()
            },
            "jobs": jobs,
            "suffix_tokens": suffix_tokens,
        }
    return plans


def _prefix_group(spec: SharingSpec, num_prefixes: int) -> range:
    """The prefixes (indices into the contexts) of the cells that read `num_prefixes`."""
    start = sum(spec.prefix_counts[: spec.prefix_counts.index(num_prefixes)])
    return range(start, start + num_prefixes)


def _prefix_records(spec: SharingSpec, contexts, codes: dict) -> list[dict]:
    """Each prefix: its module, the cells that read it, and what each code registered."""
    return [
        {
            "name": contexts[i].name,
            "cells": f"p={count}",
            **{code: info["prefixes"][i] for code, info in codes.items()},
        }
        for count in spec.prefix_counts
        for i in _prefix_group(spec, count)
    ]


def _serve_all(hosts: dict[str, CodeProcess], spec: SharingSpec, plans: dict) -> tuple:
    """Per repeat, mode and session count, a server of each code on fresh workers in turn (one
    at a time: the before code's sessions fill the machine's memory), serving the cells of
    that session count, each on prefixes of its own; the first code alternates."""
    samples = {}
    startup_s = {code: [] for code in hosts}
    for repeat in range(spec.repeats):
        for m, mode in enumerate(spec.modes):
            for s, num_sessions in enumerate(spec.session_counts):
                order = list(hosts) if (repeat + m + s) % 2 == 0 else list(hosts)[::-1]
                for code in order:
                    host = hosts[code]
                    started = host.call("start", max_running=num_sessions, draft_len=spec.draft_len)
                    startup_s[code].append(started["startup_s"])
                    for layout in (Layout(num_sessions, p) for p in spec.prefix_counts):
                        samples.setdefault((code, mode, layout), []).append(
                            _serve(host, mode, layout, plans[layout], spec)
                        )
                    host.call("stop")
    return samples, startup_s


def _serve(host: CodeProcess, mode: str, layout: Layout, plan: dict, spec: SharingSpec) -> dict:
    reply = host.call(
        "serve", jobs=plan["jobs"][host.code], mode=mode, max_tokens=spec.max_tokens,
        draft_len=spec.draft_len, concurrency=layout.num_sessions,
    )  # fmt: skip
    rate = reply["sample"]["tokens_per_s"]
    print(f"[prefix-sharing] {host.code} {mode} {layout.name}: {rate:.1f} tokens/s")
    return reply


def _model_argument(model: str) -> str:
    """A model path made absolute: the host processes run in their own trees."""
    path = Path(model).expanduser()
    return str(path.resolve()) if path.exists() else model
