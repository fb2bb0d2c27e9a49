"""Every C source the runtime builds at run time (found from the modules that call
`qkernel.build_library`) compiles and links for Jetson Orin (aarch64, -mcpu=cortex-a78ae) with the
runtime's own flags: -Wall -Werror, no -Wextra warning the machine's own build lacks, no unresolved
symbol in the shared library."""

from __future__ import annotations

import importlib
import re
import subprocess
from pathlib import Path

import pytest

import edge_runtime
from edge_runtime.model import qkernel
from tests.cross_builds import CC, CROSS, NATIVE, ORIN

PACKAGE = Path(edge_runtime.__file__).parent
_WARNING = re.compile(r"^(?P<file>[^:\s]+):(?P<line>\d+):\d+: warning: .*\[(?P<flag>-W[^\]]+)\]$", re.M)


def _builders() -> list:
    """The modules that build a C source at run time: each calls build_library(SOURCE, _FLAGS[, INCLUDES])."""
    mods = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        if re.search(r"(?<!def )\bbuild_library\(", text):
            name = ".".join(("edge_runtime", *path.relative_to(PACKAGE).with_suffix("").parts))
            mods.append(importlib.import_module(name))
    return mods


def _builds() -> list[tuple[Path, list[str], tuple[Path, ...]]]:
    return [(m.SOURCE, list(m._FLAGS), tuple(getattr(m, "INCLUDES", ()))) for m in _builders()]


def test_the_builds_cover_every_c_source_in_the_package():
    """No C file is shipped that no build reads, and no build reads one outside the package (the
    list below is derived, not kept by hand: a new kernel is checked once its module calls
    build_library)."""
    builds = _builds()
    assert {qkernel.SOURCE.name, "gguf_native.c", "attention.c"} <= {source.name for source, _, _ in builds}
    read = {p.resolve() for source, _, includes in builds for p in (source, *includes)}
    assert read == {p.resolve() for p in PACKAGE.rglob("*.c")}


def test_every_c_source_a_build_reads_ships_in_the_package():
    """What test_gguf_kernel checks for gguf_native.c's files, for every build: an installed wheel
    carries each source beside its module."""
    tomllib = pytest.importorskip("tomllib")
    pyproject = PACKAGE.parent / "pyproject.toml"
    shipped = tomllib.loads(pyproject.read_text())["tool"]["setuptools"]["package-data"]["edge_runtime"]
    for source, _, includes in _builds():
        for path in (source, *includes):
            assert path.relative_to(PACKAGE).as_posix() in shipped, path.name


def _compile(cc: str, source: Path, flags: list[str], out: Path) -> str:
    """Build `source` into a shared library as build_library does (flags before the source), with
    unresolved symbols refused at link time (-lm: attention.c's tanhf, which the runtime's library
    takes from the Python process); the compiler's diagnostics."""
    done = subprocess.run([cc, *flags, str(source), "-o", str(out), "-Wl,--no-undefined", "-lm"], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stderr


def _warnings(diagnostics: str) -> set[tuple[str, int, str]]:
    return {(Path(m["file"]).name, int(m["line"]), m["flag"]) for m in _WARNING.finditer(diagnostics)}


@pytest.mark.parametrize("source", [s.name for s, _, _ in _builds()])
def test_each_c_source_builds_for_orin_with_the_runtimes_flags(source, tmp_path):
    if CROSS is None:
        pytest.skip("no aarch64 cross compiler here")
    path, flags, _ = next(b for b in _builds() if b[0].name == source)
    _compile(CROSS, path, [*flags, ORIN, "-Wall", "-Werror"], tmp_path / "orin.so")
    orin = _warnings(_compile(CROSS, path, [*flags, ORIN, "-Wall", "-Wextra"], tmp_path / "orin-extra.so"))
    if CC is not None:
        here = _warnings(_compile(CC, path, [*flags, NATIVE, "-Wall", "-Wextra"], tmp_path / "here.so"))
        assert orin <= here, sorted(orin - here)
