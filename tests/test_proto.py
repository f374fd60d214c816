"""The generated stubs in vericache/v1 are those `make proto` makes from proto/ now."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROTOS = sorted((ROOT / "proto" / "vericache" / "v1").glob("*.proto"))
GENERATED = [
    f"{p.stem}{suffix}" for p in PROTOS for suffix in ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi")
]


def test_generated_stubs_are_current(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", f"-I{ROOT / 'proto'}",
         f"--python_out={tmp_path}", f"--grpc_python_out={tmp_path}", f"--pyi_out={tmp_path}",
         *map(str, PROTOS)],
        check=True,
    )  # fmt: skip
    for name in GENERATED:
        fresh = (tmp_path / "vericache" / "v1" / name).read_text()
        committed = (ROOT / "vericache" / "v1" / name).read_text()
        assert committed == fresh, f"vericache/v1/{name} is stale: run `make proto`"


def test_stubs_import_without_torch():
    code = (
        "import sys; from vericache.v1 import kv_transfer_pb2_grpc, vericache_pb2_grpc; "
        "assert 'torch' not in sys.modules and 'ray' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
