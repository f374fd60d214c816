"""The C++ kernel sources (kernels/ at the repository root): the build finds them in a checkout,
the wheel ships them where an installed package looks for them, and the folder never hides
Hugging Face's `kernels` package, which transformers imports."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import shutil
import sys
import warnings
from pathlib import Path

from setuptools.dist import Distribution

from vericache.kernels import cpu_attention, cpu_build

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [source.name for source in cpu_attention.extension().sources]


def wheel_files(monkeypatch) -> dict[Path, Path]:
    """What setuptools' build_py copies into the wheel as package data, from pyproject.toml:
    {path in the wheel: source in the checkout}."""
    monkeypatch.chdir(ROOT)
    dist = Distribution()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # setuptools' deprecation notices about the project table
        dist.parse_config_files(["pyproject.toml"])
    # The declared package-data alone, without the egg_info run (git file listing) that
    # include-package-data adds: the sources must not depend on it.
    dist.include_package_data = False
    build_py = dist.get_command_obj("build_py")
    build_py.ensure_finalized()
    return {
        Path(build_dir).relative_to(build_py.build_lib) / name: ROOT / source_dir / name
        for _, source_dir, build_dir, names in build_py.data_files
        for name in names
    }


def test_a_checkout_builds_from_the_top_level_kernels_folder():
    for source in cpu_attention.extension().sources:
        assert source.parent == ROOT / "kernels" and source.is_file()
    assert sorted(SOURCES) == sorted(path.name for path in (ROOT / "kernels").glob("*.cpp"))


def test_an_installed_wheel_finds_every_source(tmp_path, monkeypatch):
    shipped = wheel_files(monkeypatch)
    installed = tmp_path / "site-packages"
    for in_wheel, source in shipped.items():
        (installed / in_wheel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, installed / in_wheel)
    # Beside the package, as in site-packages: Hugging Face's `kernels`, with no C++ in it.
    (installed / "kernels").mkdir()
    module = installed / "vericache" / "kernels" / "cpu_build.py"
    module.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(cpu_build.__file__, module)
    spec = importlib.util.spec_from_file_location("installed_cpu_build", module)
    installed_build = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, installed_build)  # its dataclasses look it up
    spec.loader.exec_module(installed_build)

    for name in SOURCES:
        found = installed_build.kernel_source(name)
        assert found.parent == installed / "vericache" / "_kernels"
        assert found.read_bytes() == (ROOT / "kernels" / name).read_bytes()


def test_the_kernels_folder_never_hides_hugging_faces_package():
    assert not (ROOT / "kernels" / "__init__.py").exists()
    # The lookup `import kernels` makes with the repository root first on sys.path (pytest's
    # rootdir, `python -c` run there): the folder is at most a namespace portion, which transformers
    # reports as no `kernels` installed and which any installed package outranks.
    spec = importlib.machinery.PathFinder.find_spec("kernels", [str(ROOT), *sys.path])
    if spec is not None and spec.origin is not None:
        assert not Path(spec.origin).is_relative_to(ROOT / "kernels")
