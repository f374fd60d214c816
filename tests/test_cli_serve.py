"""`vericache prefix`, `vericache generate --server` and `vericache serve`'s option checks."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.serve_fixtures import CONTEXT, start_server
from tests.test_cli import run_cli
from vericache.cli import serve
from vericache.cli.local_ray import (
    SINGLE_MACHINE_ENV,
    RayNotOnLoopbackError,
    ray_init_options,
    start_ray,
)
from vericache.cli.main import build_parser
from vericache.cli.serve import worker_configs
from vericache.errors import InvalidRequestError


@pytest.fixture(scope="module")
def server(tiny_chat_checkpoint, tmp_path_factory):
    with start_server(tiny_chat_checkpoint, tmp_path_factory.mktemp("cli"), num_drafters=1) as s:
        yield s


def test_prefix_put_list_get_delete(server, tmp_path, capsys):
    context = tmp_path / "context.py"
    context.write_text(CONTEXT)
    target = ["--server", server.target]
    put = ["prefix", "put", str(context), "--compressor", "snapkv", "--ratio", "4"]
    code, out, err = run_cli([*put, "--compressed-dtype", "bfloat16", *target], capsys)
    assert code == 0 and "prefill" in err
    prefix_id = out.strip()
    assert prefix_id.startswith("pfx-")
    code, out, _ = run_cli(["prefix", "list", *target], capsys)
    assert prefix_id in {p["prefix_id"] for p in json.loads(out)}
    code, out, _ = run_cli(["prefix", "get", prefix_id, *target], capsys)
    expected = {"name": "snapkv", "ratio": 4.0, "bits": None, "dtype": "bfloat16"}
    assert json.loads(out)["compressor"] == expected
    code, out, _ = run_cli(["prefix", "delete", prefix_id, *target], capsys)
    assert json.loads(out) == {"deleted": True}
    code, _, err = run_cli(["prefix", "get", prefix_id, *target], capsys)
    assert code == 2 and err.count("\n") == 1 and "no prefix" in err


def test_generate_on_a_server_matches_full_local(server, tmp_path, capsys):
    context = tmp_path / "context.py"
    context.write_text(CONTEXT)
    put = ["prefix", "put", str(context), "--quiet", "--server", server.target]
    _, out, _ = run_cli([*put, "--compressor", "streamingllm", "--ratio", "4"], capsys)
    prefix_id = out.strip()
    outputs = {}
    for mode in ("full_local", "vericache", "full"):
        argv = ["generate", "--server", server.target, "--prefix-id", prefix_id, "--json"]
        argv += ["--prompt", "Explain.", "--mode", mode, "--max-tokens", "20", "--draft-len", "4"]
        code, out, _ = run_cli(argv, capsys)
        assert code == 0
        outputs[mode] = json.loads(out)
    assert outputs["vericache"]["token_ids"] == outputs["full_local"]["token_ids"]
    assert outputs["full"]["mode"] == "full_local"  # the in-process name, mapped
    assert outputs["vericache"]["stats"]["rounds"] >= 1
    sampled = {}
    for mode in ("full_local", "vericache"):
        argv = ["generate", "--server", server.target, "--prefix-id", prefix_id, "--json"]
        argv += ["--prompt", "Explain.", "--mode", mode, "--max-tokens", "20"]
        code, out, _ = run_cli(
            [*argv, "--temperature", "0.8", "--top-p", "0.9", "--seed", "5"], capsys
        )
        assert code == 0
        sampled[mode] = json.loads(out)
    assert sampled["vericache"]["token_ids"] == sampled["full_local"]["token_ids"]
    assert sampled["vericache"]["stats"]["seed"] == 5


@pytest.mark.parametrize(
    "argv, message",
    [
        (["generate", "--prompt", "hi", "--mode", "full_remote"], "need --server"),
        (["generate", "--prompt", "hi", "--server", "x:1", "--context-file", "f"], "prefix put"),
        (["serve", "--local", "--link-bandwidth", "fast"], "bandwidth 'fast'"),
        (["serve", "--local", "--resident-bytes", "lots"], "size 'lots'"),
        (["serve", "--local", "--dtype", "float8"], "invalid choice"),
        (["serve"], "one of --local, --address or --long-context"),
        (["serve", "--local", "--long-context"], "drop --local/--address"),
        (["serve", "--local", "--memory-budget", "2GiB"], "need --long-context"),
        (["serve", "--long-context", "--pcie-bandwidth", "fast"], "is not like '1.2GB/s'"),
        (["serve", "--local", "--pcie-bandwidth", "fast"], "is not like '1.2GB/s'"),
        (["serve", "--local", "--scheduling", "round-robin"], "invalid choice"),
        (["serve", "--local", "--drain-timeout", "-1"], "--drain-timeout must be >= 0"),
        (["serve", "--local", "--ratio", "4"], "unrecognized arguments"),
        (["serve", "--local", "--served-model-name", "m"], "names the model of --http-port"),
    ],
)
def test_bad_options_fail_before_anything_starts(capsys, argv, message):
    code, out, err = run_cli(argv, capsys)
    assert code == 2 and out == ""
    assert message in err and err.count("\n") == 1


@pytest.mark.parametrize(
    "options, bound",
    [
        ([], "127.0.0.1"),  # a server on loopback keeps its KV transfer there too
        (["--host", "localhost"], "localhost"),
        (["--host", "0.0.0.0"], None),  # the verifier node's own address, found on the node
        (["--host", "0.0.0.0", "--transfer-host", "10.1.2.3"], "10.1.2.3"),
    ],
)
def test_the_kv_transfer_service_binds_only_where_told(options, bound):
    args = build_parser().parse_args(["serve", "--local", *options])
    verifier, _ = worker_configs(args)
    assert verifier.transfer_host == bound


@pytest.mark.parametrize(
    "options, address",
    [
        (["--local"], "local"),  # never $RAY_ADDRESS, nor the cluster /tmp/ray last named
        (["--address", "auto"], "auto"),
        (["--address", "10.1.2.3:6379"], "10.1.2.3:6379"),
    ],
)
def test_local_starts_its_own_ray_instance(options, address):
    options = ray_init_options(build_parser().parse_args(["serve", *options]))
    assert options["address"] == address
    assert ("resources" in options) is (address == "local")  # a cluster's nodes offer their own


@pytest.fixture
def fake_ray(monkeypatch):
    """ray.init and the node's address, recorded and answered without starting Ray; Ray's
    single-machine setting restored afterwards."""
    ray = pytest.importorskip("ray")
    from ray._private import ray_constants

    monkeypatch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", True)
    monkeypatch.setenv(SINGLE_MACHINE_ENV, "1")
    calls = {"init": [], "shutdown": 0, "node": "127.0.0.1"}
    monkeypatch.setattr(ray, "init", lambda **options: calls["init"].append(options))
    monkeypatch.setattr(ray, "shutdown", lambda: calls.update(shutdown=calls["shutdown"] + 1))
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: calls["node"])
    return calls, ray_constants


@pytest.mark.parametrize("host, is_single_machine", [("127.0.0.1", True), ("0.0.0.0", False)])
def test_a_loopback_server_puts_its_ray_node_on_loopback(fake_ray, host, is_single_machine):
    calls, ray_constants = fake_ray
    args = build_parser().parse_args(["serve", "--local", "--host", host, "--drafters", "3"])
    calls["node"] = "127.0.0.1" if is_single_machine else "192.0.2.2"
    start_ray(args)
    assert calls["init"] == [ray_init_options(args)]
    assert calls["init"][0]["resources"] == {"verifier": 1, "drafter": 3}
    assert ray_constants.ENABLE_RAY_CLUSTER is not is_single_machine
    assert (os.environ[SINGLE_MACHINE_ENV] == "0") is is_single_machine


def test_a_ray_node_off_loopback_stops_a_loopback_server(fake_ray):
    calls, _ = fake_ray
    calls["node"] = "192.0.2.2"  # as if a later Ray ignored its single-machine setting
    with pytest.raises(RayNotOnLoopbackError, match="192.0.2.2, not loopback"):
        start_ray(build_parser().parse_args(["serve", "--local"]))
    assert calls["shutdown"] == 1


def _no_workers(*_):
    raise InvalidRequestError("the workers would start here")


@pytest.mark.parametrize("where", [["--local"], ["--long-context"]])
@pytest.mark.parametrize(
    "device, num_cuda_devices, message",
    [
        ("cuda", 0, "device 'cuda' asked for, but CUDA is not available"),
        ("cuda:0", 0, "CUDA is not available"),
        ("cuda:1", 1, "device 'cuda:1' asked for, but CUDA has 1 device(s)"),
        ("tpu", 0, "unknown device 'tpu'"),
        ("cuda:0", 1, "the workers would start here"),
        ("auto", 0, "the workers would start here"),  # the CPU, where CUDA is missing
    ],
)
def test_a_device_this_machine_lacks_fails_before_any_worker_starts(
    monkeypatch, capsys, where, device, num_cuda_devices, message
):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: num_cuda_devices > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: num_cuda_devices)
    monkeypatch.setattr(serve, "start_on_ray", _no_workers)
    monkeypatch.setattr(serve, "start_long_context", _no_workers)
    argv = ["serve", *where, "--device", device, "--insecure-no-auth"]
    code, out, err = run_cli(argv, capsys)
    assert code == 2 and out == ""
    assert message in err and err.count("\n") == 1


def test_a_cluster_s_devices_are_its_nodes_to_check(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(serve, "start_on_ray", _no_workers)
    argv = ["serve", "--address", "auto", "--device", "cuda", "--insecure-no-auth"]
    code, _, err = run_cli(argv, capsys)
    assert code == 2 and "the workers would start here" in err
