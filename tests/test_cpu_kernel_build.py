"""Building the CPU attention kernels: a build killed midway leaves torch's `lock` file behind,
and the next load must not wait on it forever (a first `make demo` stopped with Ctrl-C would
otherwise hang every later run without a word)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from vericache.kernels import cpu_attention

LOAD = "from vericache.kernels import cpu_attention; assert cpu_attention._ops() is not None"


def test_a_lock_left_by_a_killed_build_does_not_stop_the_next_load():
    if cpu_attention._ops() is None:
        pytest.skip("no C++ compiler here: the kernels are not built")
    directory = cpu_attention.build_directory(*cpu_attention.extension())
    with cpu_attention.build_lock(directory):  # no live build can own the file planted here
        (directory / "lock").touch()
    subprocess.run([sys.executable, "-c", LOAD], check=True, timeout=120)
    assert not (directory / "lock").exists()


def test_each_source_tree_and_flag_set_builds_in_a_folder_of_its_own(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    name, cflags = cpu_attention.extension()
    here = cpu_attention.build_directory(name, cflags)
    assert here.parent == tmp_path and here.name.startswith(name)
    assert cpu_attention.build_directory(name, cflags) == here
    assert cpu_attention.build_directory(name, [*cflags, "-DOTHER"]) != here
    elsewhere = [tmp_path / "checkout" / source.name for source in cpu_attention._SOURCES]
    for source, copy in zip(cpu_attention._SOURCES, elsewhere):
        copy.parent.mkdir(exist_ok=True)
        copy.write_bytes(source.read_bytes())
    monkeypatch.setattr(cpu_attention, "_SOURCES", elsewhere)
    assert cpu_attention.build_directory(name, cflags) != here
