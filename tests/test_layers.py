"""How the code is put together, checked: layers point one way, the generated stubs stay at the
edge, and every worker call can be followed from its protocol to the worker's method."""

from __future__ import annotations

import ast
import inspect
import typing
from pathlib import Path

import pytest

import vericache
from vericache.serve.cluster_secret import ClusterSecret
from vericache.serve.workers.drafter import Drafter
from vericache.serve.workers.handles import DrafterHandle, InProcess, OverRay, VerifierHandle
from vericache.serve.workers.verifier import Verifier
from vericache.serve.workers.worker_api import DrafterAPI, VerifierAPI

PACKAGE = Path(vericache.__file__).parent
# Each core layer may import only the layers after it (and vericache.errors).
LAYERS = ["engine", "compress", "model", "kv", "kernels"]
PURE_PYTHON = ["scheduler"]  # plans with numbers only
FORBIDDEN_IN_CORE = ("ray", "grpc", "vericache.serve", "vericache.cli", "vericache.client",
                     "vericache.v1")  # fmt: skip
# The servicer of the public API, its converter, the internal KV transfer service (servicer and
# fetcher), and the client SDK.
STUB_USERS = {"serve/front/api.py", "serve/front/wire.py", "serve/workers/kv_transfer.py"}


def _imports(path: Path) -> list[str]:
    """Modules a file imports at run time (not under `if TYPE_CHECKING:`)."""
    tree = ast.parse(path.read_text())
    type_only = {
        id(node)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and ast.unparse(block.test).endswith("TYPE_CHECKING")
        for node in ast.walk(block)
    }
    names = []
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.append(node.module)
    return names


def _files(package: str) -> list[Path]:
    root = PACKAGE / package
    return sorted(root.rglob("*.py"))


@pytest.mark.parametrize("layer", LAYERS + PURE_PYTHON)
def test_the_core_imports_no_serving_code_and_no_layer_above_it(layer):
    above = LAYERS[: LAYERS.index(layer)] if layer in LAYERS else LAYERS
    for path in _files(layer):
        for name in _imports(path):
            where = f"{path.name} of {layer} imports {name}"
            assert not name.startswith(FORBIDDEN_IN_CORE), where
            assert not any(name.startswith(f"vericache.{upper}") for upper in above), where
            if layer in PURE_PYTHON:
                assert name.split(".")[0] != "torch", where


def test_only_the_edge_imports_the_generated_stubs():
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative.startswith(("v1/", "client/")) or relative in STUB_USERS:
            continue
        for name in _imports(path):
            assert not name.startswith("vericache.v1"), f"{relative} imports {name}"


def _protocol_methods(protocol) -> list[str]:
    return [
        name
        for name, member in vars(protocol).items()
        if inspect.iscoroutinefunction(member) and not name.startswith("_")
    ]


PAIRS = [(VerifierAPI, VerifierHandle, Verifier), (DrafterAPI, DrafterHandle, Drafter)]


@pytest.mark.parametrize(("protocol", "handle", "worker"), PAIRS, ids=["verifier", "drafter"])
def test_each_protocol_method_calls_the_worker_method_of_its_name(protocol, handle, worker):
    """The handle defines every method itself and the worker has its namesake, with the same
    parameters and types: a reader (or a tool) goes from the protocol to the code that runs."""
    extra = (ClusterSecret.generate(),) if handle is DrafterHandle else ()
    for transport in (InProcess("probe"), OverRay("probe")):
        assert isinstance(handle(object(), transport, "probe", *extra), protocol)
    for name in _protocol_methods(protocol):
        assert name in vars(handle) or name == "shutdown", f"{handle.__name__}.{name}"
        expected = typing.get_type_hints(getattr(protocol, name))
        served = typing.get_type_hints(getattr(worker, name))
        assert served == expected, f"{worker.__name__}.{name}: {served} != {expected}"
        assert _parameters(worker, name) == _parameters(protocol, name), f"{worker.__name__}.{name}"


def _parameters(cls, name: str) -> list[str]:
    # Ray's actor decorator adds a tracing parameter to the class it was given.
    parameters = inspect.signature(getattr(cls, name)).parameters
    return [p for p in parameters if p != "_ray_trace_ctx"]


def test_handles_dispatch_by_method_not_by_name():
    source = (PACKAGE / "serve" / "workers" / "handles.py").read_text()
    calls = [
        node.func.id
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
    ]
    assert "getattr" not in calls
