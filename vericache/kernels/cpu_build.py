"""Building a C++ extension once per machine and install, whatever process asks for it.

torch's `cpp_extension.load` runs ninja in every process that loads an extension, and ninja
rebuilds whenever its log does not know the compile command, as when two ninja binaries on two
processes' PATHs each discard the other's log. Here a build happens once, and every later process
loads the library it left: no ninja, no compiler, no lock, so a restarted worker never compiles.

Folders: `<root>/<name>-<sources key>/<compiler key>`. The sources key covers what the library is
built from: torch (version, and its headers where this torch lies), Python's headers, the flags,
and the sources' paths and contents; the compiler key, the compiler torch runs ($CXX or c++) and
its version. Once a library is whole, a `built` stamp names it with its digest (a damaged file is
rebuilt, never loaded). A process with a compiler loads its own compiler's build; one without
(a runtime image, a node started from another shell) loads any whole build of the same sources.
Concurrent first uses serialise on an flock; the ones that waited find the stamp.

`python -m vericache.kernels.cpu_build` builds the CPU kernels ahead of their first use
(`make install`, the Docker image).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

STAMP = "built"  # JSON: the library's file name and the key's parts, written once it is whole


@dataclass(frozen=True)
class Extension:
    """What a C++ extension is built from."""

    name: str
    sources: tuple[Path, ...]
    cflags: tuple[str, ...]
    ldflags: tuple[str, ...] = ()


def kernel_source(name: str) -> Path:
    """A C++ source of the kernels: in an installed package, vericache/_kernels/ (the wheel ships
    the repository's kernels/*.cpp there as package data); in a source checkout, kernels/ at the
    repository root."""
    package = Path(__file__).resolve().parents[1]
    for folder in (package / "_kernels", package.parent / "kernels"):
        if (folder / name).is_file():
            return folder / name
    raise FileNotFoundError(f"{name}: not in {package / '_kernels'}, nor in a checkout's kernels/")


class NoCompilerError(RuntimeError):
    """No whole build of these sources, and no compiler to make one."""


def load(extension: Extension) -> Path:
    """Registers the extension's ops in this process, building it first if no process on this
    machine has (raises where it cannot be built). Returns the library's path."""
    sources, compiler = sources_directory(extension), compiler_identity()
    library = _built_in(sources, compiler)
    if library is None:
        directory = _compiler_directory(sources, compiler)
        with build_lock(directory):
            library = built_library(directory) or _build(extension, directory, compiler)
    torch.ops.load_library(str(library))
    return library


def built_for(extension: Extension) -> Path | None:
    """The whole build this process loads: its compiler's, or without a compiler any one of
    these sources (raises NoCompilerError where there is none)."""
    return _built_in(sources_directory(extension), compiler_identity())


def _built_in(sources: Path, compiler: list[str] | None) -> Path | None:
    if compiler is not None:
        return built_library(sources / _key_of(compiler, "cc"))
    for directory in sorted(sources.glob("cc-*")):
        library = built_library(directory)
        if library is not None:
            return library
    raise NoCompilerError("no C++ compiler ($CXX or c++) and no build of the kernels to load")


def built_library(directory: Path) -> Path | None:
    """The library a finished build left in `directory`, or None: also when the library is not
    the one the build stamped (a half-copied or damaged file is rebuilt, never loaded)."""
    try:
        stamp = json.loads((directory / STAMP).read_text())
        library = directory / Path(stamp["library"]).name
        is_whole = _digest(library) == stamp["digest"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not is_whole:
        logger.warning("the built %s differs from its build's record: building again", library.name)
        return None
    return library


def _digest(path: Path) -> str:
    return hashlib.blake2b(path.read_bytes(), digest_size=16).hexdigest()


def build_directory(extension: Extension) -> Path:
    """Where this process's compiler builds the extension (see the module's docstring)."""
    return _compiler_directory(sources_directory(extension), compiler_identity())


def _compiler_directory(sources: Path, compiler: list[str] | None) -> Path:
    if compiler is None:
        raise NoCompilerError("no C++ compiler ($CXX or c++) to build the kernels")
    directory = sources / _key_of(compiler, "cc")
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def sources_directory(extension: Extension) -> Path:
    """The folder of every build of these sources, under $TORCH_EXTENSIONS_DIR or torch's
    default root."""
    from torch.utils import cpp_extension

    contents = [source.read_bytes().decode(errors="replace") for source in extension.sources]
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    return Path(root) / _key_of([*key_parts(extension), *contents], extension.name)


def key_parts(extension: Extension) -> list[str]:
    """What enters the compile and link commands, but for the compiler and the sources' contents."""
    from torch.utils import cpp_extension

    return [
        torch.__version__,
        *cpp_extension.include_paths(),  # torch's headers, where this torch lies (CPU)
        sysconfig.get_path("include", scheme="posix_prefix") or "",  # Python.h
        *extension.cflags,
        "--",
        *extension.ldflags,
        *map(str, extension.sources),
    ]


def compiler_identity() -> list[str] | None:
    """The C++ compiler torch would run ($CXX or c++) and the version it reports; None where
    there is none. (Its version, not its path: ccache in front of it reports the compiler's.)"""
    from torch.utils import cpp_extension

    compiler = cpp_extension.get_cxx_compiler()
    found = shutil.which(compiler)
    if found is None:
        return None
    try:
        answer = subprocess.run([found, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return [compiler, *answer.stdout.splitlines()[:1]]


def _key_of(parts: list[str], name: str) -> str:
    key = hashlib.blake2b(digest_size=8)
    for part in parts:
        key.update(part.encode() + b"\0")
    return f"{name}-{key.hexdigest()}"


@contextlib.contextmanager
def build_lock(directory: Path) -> Iterator[None]:
    """Holds an flock on the build folder while torch builds there. torch marks a build with a
    `lock` file that a killed build leaves behind, and every later build waits on it forever; an
    flock dies with its process, so whoever holds it knows any `lock` file is left over from a
    dead build and removes it."""
    with open(directory / "build.flock", "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)  # released when the file closes, or the process dies
        stale = directory / "lock"
        if stale.exists():
            logger.warning("removing the lock of a kernel build that did not finish")
            stale.unlink()
        yield


def _build(extension: Extension, directory: Path, compiler: list[str]) -> Path:
    """Compiles and links under the lock, then stamps the folder (written whole, then renamed
    into place, so a reader sees no stamp or a complete one)."""
    from torch.utils import cpp_extension

    logger.warning("building the %s kernels once for this machine (about a minute)", extension.name)
    _ninja_on_path()
    for leftover in directory.iterdir():  # a killed or damaged build's files: start clean
        if leftover.name != "build.flock" and leftover.is_file():
            leftover.unlink()
    library = cpp_extension.load(
        name=extension.name,
        sources=[str(source) for source in extension.sources],
        extra_cflags=list(extension.cflags),
        extra_ldflags=list(extension.ldflags),
        build_directory=str(directory),
        is_python_module=False,
        verbose=False,
    )
    library = Path(library)
    key = {"sources": key_parts(extension), "compiler": compiler}
    stamp = {"library": library.name, "digest": _digest(library), "key": key}
    partial = directory / f"{STAMP}.partial"
    partial.write_text(json.dumps(stamp, indent=1))
    partial.replace(directory / STAMP)
    return library


def _ninja_on_path() -> None:
    """torch runs `ninja` from PATH. A virtual environment's tools run without activating it
    (`.venv/bin/vericache`) see no ninja where the system has none: the `ninja` wheel this
    package depends on lies beside the interpreter, so its folder is added."""
    beside = Path(sys.executable).parent
    if shutil.which("ninja") is None and (beside / "ninja").is_file():
        os.environ["PATH"] = f"{beside}{os.pathsep}{os.environ.get('PATH', '')}"


def main() -> int:
    from vericache.kernels import cpu_attention

    try:
        library = load(cpu_attention.extension())
    except Exception as error:  # noqa: BLE001 - reported in one line; attention falls back
        print(f"CPU kernels not built ({error}): library attention instead", file=sys.stderr)
        return 1
    print(f"CPU kernels ready: {library}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
