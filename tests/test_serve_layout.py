"""serve/ is laid out by role (vericache/serve/__init__.py): a few shared modules, then store/,
workers/, backends/, front/ and launch/, each importing only the parts listed before it, so that
a reader can tell from a module's folder what it may depend on."""

from __future__ import annotations

import ast
import pathlib

import vericache.serve

SERVE = pathlib.Path(vericache.serve.__file__).parent
# The parts in import order: a module may import its own part and those before it.
PARTS = ("", "store", "workers", "backends", "front", "launch")
SHARED_MODULES = {"api_types", "cluster_secret", "config", "logs"}


def _part_of(module: str) -> str:
    """The part of a `vericache.serve...` module: "" for the shared modules."""
    names = module.split(".")[2:]
    return names[0] if len(names) > 1 else ""


def _serve_imports(path: pathlib.Path) -> set[str]:
    """Every vericache.serve module the file imports, wherever in it (functions and
    TYPE_CHECKING blocks too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "vericache.serve":  # `from vericache.serve import part`
                found.update(f"vericache.serve.{alias.name}" for alias in node.names)
            elif node.module.startswith("vericache.serve."):
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("vericache.serve."))
    return found


def _modules() -> list[tuple[str, pathlib.Path]]:
    return [
        (".".join(("vericache.serve", *path.relative_to(SERVE).with_suffix("").parts)), path)
        for path in sorted(SERVE.rglob("*.py"))
    ]


def test_every_module_belongs_to_a_part():
    for module, _ in _modules():
        part = _part_of(module)
        assert part in PARTS, module
        if part == "":
            assert module.rsplit(".", 1)[1] in SHARED_MODULES | {"__init__"}, (
                f"{module}: a new module goes into the part it belongs to"
            )


def test_every_part_says_what_it_owns_and_may_import():
    for part in PARTS[1:]:
        docstring = ast.get_docstring(ast.parse((SERVE / part / "__init__.py").read_text()))
        assert docstring and "import" in docstring.lower(), part


def test_imports_point_from_later_parts_to_earlier_ones():
    wrong = []
    for module, path in _modules():
        rank = PARTS.index(_part_of(module))
        for imported in _serve_imports(path):
            if PARTS.index(_part_of(imported)) > rank:
                wrong.append(f"{module} imports {imported}")
    assert not wrong, "\n".join(wrong)


def test_the_check_sees_an_import_against_the_direction(tmp_path):
    # A test that could not fail would hold nothing: an upward import is found.
    upward = tmp_path / "upward.py"
    upward.write_text("def f():\n    from vericache.serve.front.coordinator import Coordinator\n")
    assert _serve_imports(upward) == {"vericache.serve.front.coordinator"}
    assert PARTS.index(_part_of("vericache.serve.front.coordinator")) > PARTS.index("workers")
