"""edge_runtime sets OMP_WAIT_POLICY=PASSIVE before torch loads libgomp (torch's OpenMP workers
otherwise spin after every op on the cores the GGUF kernels' threads need), and a user's own
setting wins."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# The policy is read once, when torch loads libgomp: importing edge_runtime must set it with torch
# not loaded yet.
_PROBE = "import os, sys, edge_runtime; print(os.environ.get('OMP_WAIT_POLICY'), 'torch' in sys.modules)"


@pytest.mark.parametrize("given, want", [(None, "PASSIVE"), ("ACTIVE", "ACTIVE")])
def test_wait_policy_is_set_before_torch_loads_openmp(given, want):
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if given is not None:
        env["OMP_WAIT_POLICY"] = given
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, check=True,
                         timeout=120)
    assert out.stdout.split() == [want, "False"]
