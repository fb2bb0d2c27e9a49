"""C test harnesses built as other machines build them: natively and for aarch64 (Jetson Orin), the
aarch64 ones run under qemu. The compilers and emulator found here, and the skip (a platform
reason) naming what is missing."""

from __future__ import annotations

import platform
import shutil
import subprocess
from pathlib import Path

import pytest

CC = shutil.which("cc") or shutil.which("gcc")
CROSS, QEMU = shutil.which("aarch64-linux-gnu-gcc"), shutil.which("qemu-aarch64")
NATIVE = "-march=native" if platform.machine() in ("x86_64", "AMD64") else "-mcpu=native"
ORIN = "-mcpu=cortex-a78ae"  # Jetson Orin's core (gcc >= 11 knows it)


def compiler(arm: bool) -> str:
    """The C compiler for a native or an aarch64 build; skips where it, or qemu to run an aarch64
    build, is missing."""
    cc = CROSS if arm else CC
    if cc is None or (arm and QEMU is None):
        pytest.skip("no aarch64 cross compiler or qemu-aarch64 here" if arm else "no C compiler here")
    return cc


def run(arm: bool, exe: Path, *args: str) -> None:
    """Run a built harness: under qemu (a CPU with every extension, aarch64's libraries) where it is
    an aarch64 build."""
    command = [QEMU, "-cpu", "max", "-L", "/usr/aarch64-linux-gnu", str(exe), *args] if arm else [str(exe), *args]
    subprocess.run(command, check=True, capture_output=True, timeout=300)
