"""The trainer's AdamW against torch.optim.AdamW (which it replaced: torch.optim imports
torch._dynamo, ~120 MiB resident, #28): the same parameters, bit for bit, step after step."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from edge_runtime.train.optim import LoraOptimizer, OptimizerSettings


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_adamw_matches_torch_optim_bit_for_bit(weight_decay: float) -> None:
    torch.manual_seed(0)
    ours = [torch.randn(8, 5, requires_grad=True), torch.randn(3, requires_grad=True)]
    theirs = [p.detach().clone().requires_grad_(True) for p in ours]
    settings = OptimizerSettings(learning_rate=5e-3, betas=(0.9, 0.99), weight_decay=weight_decay, max_grad_norm=None)
    opt = LoraOptimizer(ours, settings)
    ref = torch.optim.AdamW(theirs, lr=5e-3, betas=(0.9, 0.99), weight_decay=weight_decay)
    for step in range(5):
        grads = [torch.randn_like(p) for p in ours]
        for i, (a, b, g) in enumerate(zip(ours, theirs, grads, strict=True)):
            if step == 2 and i == 1:  # a parameter without a gradient takes no step, in both
                continue
            a.grad, b.grad = g.clone(), g.clone()
        opt.accumulate()
        ref.step()
        ref.zero_grad(set_to_none=True)
        for a, b in zip(ours, theirs, strict=True):
            assert torch.equal(a, b)
            assert a.grad is None


def test_clear_state_restarts_the_moments() -> None:
    p = torch.ones(4, requires_grad=True)
    opt = LoraOptimizer([p], OptimizerSettings(max_grad_norm=None))
    p.grad = torch.ones(4)
    opt.accumulate()
    assert opt.moments[0].t == 1
    opt.clear_state()
    assert opt.moments == {}


def test_a_training_step_does_not_import_torch_dynamo() -> None:
    code = ("import sys, torch\n"
            "from edge_runtime.train.optim import LoraOptimizer, OptimizerSettings\n"
            "p = torch.ones(4, requires_grad=True); p.grad = torch.ones(4)\n"
            "LoraOptimizer([p], OptimizerSettings()).accumulate()\n"
            "assert 'torch._dynamo' not in sys.modules, 'torch._dynamo was imported'\n")
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root, env=env)
