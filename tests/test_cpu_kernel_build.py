"""Building the CPU attention kernels once per machine (vericache/kernels/cpu_build.py): processes
started with other environments (a Ray worker, the CLI with another ninja first on PATH) load the
library already built and compile nothing; concurrent first uses build it once, past the `lock`
file a killed build left; a damaged library is never loaded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vericache.kernels import cpu_attention, cpu_build

LOAD = (
    "from vericache.kernels import cpu_attention; "
    "assert cpu_attention._ops() is not None, 'the kernels did not load'"
)
OBJECTS = ("cpu_attention.o", "cpu_store.o", "cpu_packed_attention.o")


def built_here() -> Path:
    if cpu_attention._ops() is None:
        pytest.skip("no C++ compiler here: the kernels are not built")
    directory = cpu_build.build_directory(cpu_attention.extension())
    assert cpu_build.built_library(directory) is not None
    return directory


def spy_tools(folder: Path, calls: Path) -> Path:
    """A folder whose `ninja` records that it ran, then fails: first on PATH, it shows whether a
    process built anything (it is another ninja than the one that built the library)."""
    folder.mkdir(exist_ok=True)
    spy = folder / "ninja"
    spy.write_text(f'#!/bin/sh\necho "ninja $*" >> {calls}\nexit 1\n')
    spy.chmod(0o755)
    return folder


def folder_state(directory: Path) -> dict[str, object]:
    log = directory / ".ninja_log"
    files = {p.name: p.stat().st_mtime_ns for p in directory.iterdir() if p.name != "build.flock"}
    return {"log": log.read_text() if log.exists() else None, "files": files}


def ninja_log_outputs(directory: Path) -> list[str]:
    lines = (directory / ".ninja_log").read_text().splitlines()
    return [line.split("\t")[3] for line in lines if not line.startswith("#")]


@pytest.mark.ray
def test_a_ray_worker_and_the_cli_with_another_ninja_load_what_was_built(ray_cluster, tmp_path):
    import ray

    directory = built_here()
    before = folder_state(directory)
    calls = tmp_path / "calls"
    spies = spy_tools(tmp_path / "bin", calls)
    path = f"{spies}{os.pathsep}{os.environ['PATH']}"

    @ray.remote(num_cpus=0, resources={"drafter": 0.01})
    def load_in_a_worker() -> bool:
        from vericache.kernels import cpu_attention

        return cpu_attention._ops() is not None

    in_worker = load_in_a_worker.options(runtime_env={"env_vars": {"PATH": path}}).remote()
    assert ray.get(in_worker, timeout=120)
    cli = [sys.executable, "-m", "vericache.kernels.cpu_build"]
    subprocess.run(cli, check=True, timeout=120, env={**os.environ, "PATH": path})
    assert not calls.exists(), calls.read_text()  # neither ran ninja
    assert folder_state(directory) == before  # nothing rebuilt, relinked or rewritten


def test_concurrent_first_uses_build_once_past_a_killed_builds_lock(tmp_path, monkeypatch):
    if cpu_attention._ops() is None:
        pytest.skip("no C++ compiler here: the kernels are not built")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    env = {**os.environ}
    directory = cpu_build.build_directory(cpu_attention.extension())
    (directory / "lock").touch()  # what a build killed midway leaves behind
    starts = [
        subprocess.Popen([sys.executable, "-c", LOAD], env=env, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    errors = [started.communicate(timeout=600)[1] for started in starts]
    assert [started.returncode for started in starts] == [0, 0], errors
    assert sorted(ninja_log_outputs(directory)) == sorted([*OBJECTS, _library_name(directory)])
    assert sum("building the" in error for error in errors) == 1
    assert not (directory / "lock").exists()


def test_a_damaged_library_is_not_loaded(tmp_path):
    directory = tmp_path / "built"
    directory.mkdir()
    library = directory / "kernels.so"
    library.write_bytes(b"\x7fELF" + bytes(1000))
    stamp = {"library": library.name, "digest": cpu_build._digest(library), "key": []}
    (directory / cpu_build.STAMP).write_text(json.dumps(stamp))
    assert cpu_build.built_library(directory) == library
    library.write_bytes(b"\x7fELF" + bytes(999) + b"\x01")  # one byte off
    assert cpu_build.built_library(directory) is None
    library.unlink()
    assert cpu_build.built_library(directory) is None


def test_the_folder_key_covers_flags_sources_and_compiler(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    extension = cpu_attention.extension()
    here = cpu_build.build_directory(extension)
    assert here.parent.parent == tmp_path and here.parent.name.startswith(extension.name)
    assert cpu_build.build_directory(extension) == here
    other_flags = cpu_build.Extension(
        extension.name, extension.sources, (*extension.cflags, "-DOTHER"), extension.ldflags
    )
    assert cpu_build.build_directory(other_flags) != here
    copies = [tmp_path / "checkout" / source.name for source in extension.sources]
    for source, copy in zip(extension.sources, copies):
        copy.parent.mkdir(exist_ok=True)
        copy.write_bytes(source.read_bytes())
    moved = cpu_build.Extension(extension.name, tuple(copies), extension.cflags, extension.ldflags)
    moved_here = cpu_build.build_directory(moved)
    assert moved_here != here
    copies[0].write_bytes(copies[0].read_bytes() + b"\n// edited\n")
    assert cpu_build.build_directory(moved) != moved_here
    compiler = tmp_path / "other-c++"
    compiler.write_text("#!/bin/sh\necho 'other-c++ 1.0'\n")
    compiler.chmod(0o755)
    monkeypatch.setenv("CXX", str(compiler))
    elsewhere = cpu_build.build_directory(extension)
    assert elsewhere != here and elsewhere.parent == here.parent  # the same sources' folder


def test_without_a_compiler_a_build_of_the_same_sources_is_loaded(tmp_path, monkeypatch):
    directory = built_here()
    library = cpu_build.built_library(directory)
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    assert cpu_build.built_for(cpu_attention.extension()) == library  # no build is tried
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # nothing built here
    with pytest.raises(cpu_build.NoCompilerError, match="no C\\+\\+ compiler"):
        cpu_build.load(cpu_attention.extension())


def _library_name(directory: Path) -> str:
    return json.loads((directory / cpu_build.STAMP).read_text())["library"]
