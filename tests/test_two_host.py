"""VeriCache across two real hosts: network namespaces joined by a veth pair that `tc` limits.

Host A runs the Ray head (resource `verifier`), the driver and its API server (on A's loopback);
host B a Ray worker node (resource `drafter`). KV reaches the drafter over the veth at the rate tc
allows, with the application's own throttle off. Needs root:
`pytest -m slow tests/test_two_host.py`.

The driver runs on A as `python -m tests.test_two_host ARGS` (`_drive`); the test checks what it
reports. On any failure, `netns.linked_hosts` ends every process on both hosts and deletes them.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import secrets
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests import netns

TC_RATE = "8mbit"
TC_BYTES_PER_S = 1e6
RAY_PORT = 6379  # on host A, whose ports no other process shares
# VERICACHE's fetch of the compressed KV opens the drafter's channel before FULL_REMOTE's is timed.
MODES = ("full_local", "vericache", "full_remote", "lossy")
PROMPT = "Summarize the above."
NUM_PREFIX_TOKENS = 1500
# 4 layers x 4 KV heads x head_dim 32 in float32: 4 KiB of full KV per token, so the prefix's full
# KV (~4.5 MB as streamed) takes ~5 s at TC_RATE, its 4-bit KIVI KV ~0.7 s.
MODEL_SHAPE = dict(
    hidden_size=128,
    num_attention_heads=4,
    num_key_value_heads=4,
    num_hidden_layers=4,
    vocab_size=49152,  # the embedded tokenizer's
    max_position_embeddings=2048,
)
RAY_START_TIMEOUT_S = 90
DRIVER_TIMEOUT_S = 180
REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.ray
def test_vericache_is_lossless_across_a_tc_limited_link(tmp_path, request):
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    model = _save_model(tmp_path / "model", request.getfixturevalue("embedded_dir"))
    env = _ray_env()
    # Ray's unix sockets live under its temp dir, whose path must stay short.
    ray_temp = Path(tempfile.mkdtemp(prefix="vc2h-", dir="/tmp"))
    try:
        with netns.linked_hosts(TC_RATE) as (host_a, host_b):
            head = f"{host_a.address}:{RAY_PORT}"
            # A temp dir per node, as on two machines.
            _ray_start(host_a, env, ray_temp / "a", "verifier", "--head", f"--port={RAY_PORT}")
            _ray_start(host_b, env, ray_temp / "b", "drafter", f"--address={head}")
            report = _run_driver(host_a, env, head, model, tmp_path)
    finally:
        shutil.rmtree(ray_temp, ignore_errors=True)

    assert sorted(report["node_addresses"]) == [host_a.address, host_b.address]
    assert report["transfer_address"].startswith(f"{host_a.address}:")
    results = report["results"]
    assert results["vericache"]["token_ids"] == results["full_local"]["token_ids"]
    assert results["full_remote"]["token_ids"] == results["full_local"]["token_ids"]
    vericache = results["vericache"]["stats"]
    assert sum(vericache["accepted_per_round"]) > 0  # drafts were used, not only corrections
    # FULL_REMOTE's link stats are its drafter's fetch of the full KV over the veth, alone.
    full = results["full_remote"]["stats"]
    assert full["link_wait_s"] > 2.0, "too short a transfer to measure the rate"
    rate = full["link_bytes"] / full["link_wait_s"]
    assert rate == pytest.approx(TC_BYTES_PER_S, rel=0.15), f"{rate / 1e6:.3f} MB/s"
    # VERICACHE's: the compressed KV fetched, plus the exact KV handed over each round.
    assert report["compressed_kv_bytes"] <= vericache["link_bytes"] < full["link_bytes"]


def _skip_reason() -> str | None:
    if importlib.util.find_spec("ray") is None:
        return "ray is not installed"
    return netns.unavailable_reason()


def _save_model(path: Path, embedded_dir: Path) -> Path:
    """A tiny random Llama with the embedded model's tokenizer (the API takes text prompts)."""
    from tests.conftest import save_tiny_checkpoint

    save_tiny_checkpoint("llama", path, **MODEL_SHAPE)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (embedded_dir / name).is_file():
            shutil.copy(embedded_dir / name, path / name)
    return path


def _ray_env() -> dict[str, str]:
    """Token auth with a token of this test's own for both nodes and the driver."""
    return os.environ | {
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": secrets.token_hex(16),
        "RAY_USAGE_STATS_ENABLED": "0",
        "OMP_NUM_THREADS": "1",
    }


def _ray_start(host: netns.Host, env, temp_dir: Path, resource: str, *options: str) -> None:
    ray = str(Path(sys.executable).parent / "ray")
    head_only = ["--include-dashboard=false"] if "--head" in options else []
    command = host.command(
        ray, "start", *options, *head_only,
        f"--node-ip-address={host.address}",
        f"--resources={json.dumps({resource: 1})}",
        "--num-cpus=1",
        "--object-store-memory=100000000",
        "--disable-usage-stats",
        f"--temp-dir={temp_dir}",
    )  # fmt: skip
    done = subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=RAY_START_TIMEOUT_S
    )
    assert done.returncode == 0, f"ray start on {host.namespace} failed:\n{done.stderr[-4000:]}"


def _run_driver(host: netns.Host, env, ray_address: str, model: Path, tmp_path: Path) -> dict:
    report_path = tmp_path / "report.json"
    args = dict(
        ray_address=ray_address,
        node_address=host.address,
        model=str(model),
        store_root=str(tmp_path / "store"),
        report=str(report_path),
    )
    command = host.command(sys.executable, "-m", "tests.test_two_host", json.dumps(args))
    log_path = tmp_path / "driver.log"
    with open(log_path, "w") as log:
        done = subprocess.run(
            command, env=env, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
            timeout=DRIVER_TIMEOUT_S,
        )  # fmt: skip
    assert done.returncode == 0, f"the driver failed:\n{log_path.read_text()[-6000:]}"
    return json.loads(report_path.read_text())


def _drive(args: dict) -> None:
    """On host A: workers placed on the two Ray nodes, an API server on loopback, every mode."""
    import ray

    from vericache.client import Client
    from vericache.engine.link import LinkSpec
    from vericache.serve.config import DrafterConfig, VerifierConfig
    from vericache.serve.launch.cluster import ray_workers
    from vericache.serve.launch.server import distributed_server

    model = args["model"]
    # The application throttle off; transfer_host None: KVTransfer listens on A's veth address.
    verifier = VerifierConfig(
        model=model, root=Path(args["store_root"]), link=LinkSpec(), num_threads=1
    )
    drafter = DrafterConfig(model=model, num_threads=1)
    # A repeating prefix: the drafter's 4-bit KV then predicts some tokens of the full KV's.
    period = random.Random(0).choices(range(1000, 40000), k=60)
    prefix = (period * NUM_PREFIX_TOKENS)[:NUM_PREFIX_TOKENS]
    ray.init(args["ray_address"], _node_ip_address=args["node_address"], logging_level="WARNING")
    try:
        factory = lambda: ray_workers(verifier, drafter, 1, 1, placement_timeout_s=90)  # noqa: E731
        with (
            distributed_server(factory, model) as server,
            Client(server.target, timeout=60) as client,
        ):
            prefix_id = client.put_prefix(token_ids=prefix, compressor="kivi", bits=4)
            info = client.get_prefix(prefix_id)
            results = {}
            for mode in MODES:
                result = client.generate(
                    PROMPT, prefix_id=prefix_id, mode=mode, max_tokens=24, draft_len=4
                )
                results[mode] = {"token_ids": result.token_ids, "stats": result.stats}
            verifier_actor = server.coordinator.backend.verifiers[0].worker
            transfer_address = ray.get(verifier_actor.describe.remote()).transfer_address
        node_addresses = [node["NodeManagerAddress"] for node in ray.nodes() if node["Alive"]]
    finally:
        ray.shutdown()
    report = dict(
        results=results,
        compressed_kv_bytes=info.compressed_kv_bytes,
        transfer_address=transfer_address,
        node_addresses=node_addresses,
    )
    Path(args["report"]).write_text(json.dumps(report))


if __name__ == "__main__":
    _drive(json.loads(sys.argv[1]))
