"""Run a test module's function in a fresh interpreter: for measurements of the process's own
resident memory, which threads and heaps left by earlier tests in the same session disturb."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def in_fresh_process(module: str, function: str, *args: str, timeout_s: float = 300) -> None:
    """`module.function(*args)` in a new Python; its failure (output included) fails the caller."""
    code = f"import sys, {module} as m; m.{function}(*sys.argv[1:])"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout_s)
    assert proc.returncode == 0, f"{module}.{function} failed in a fresh interpreter:\n{proc.stdout}\n{proc.stderr}"
