"""tools/bench_qweights_cuda.py runs end to end on tiny shapes (the GPU where there is one, else
Triton's interpreter on the CPU), so the GPU run it exists for cannot fail on a slip of the tool."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_the_bench_writes_its_figures(tmp_path):
    out = tmp_path / "bench.json"
    device = "cuda" if torch.cuda.is_available() else "cpu"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_qweights_cuda.py"), "--device", device,
                           "--tiny", "--out", str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert len(report["results"]) == 6
    for row in report["results"]:
        assert row["kernel_us"] > 0 and row["torch_us"] > 0 and row["bytes"] > 0
        assert row["max_rel_err_vs_torch"] < 1e-2
