"""dtype=auto on a CPU: bf16 only where bf16 GEMMs keep greedy output batch-invariant."""

from __future__ import annotations

import pytest
import torch

from edge_runtime import device
from edge_runtime.model.llama import linear


def _rows_invariant_by_hand() -> bool:
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(3072, 576, generator=gen).to(torch.bfloat16)
    rows = torch.randn(128, 576, generator=gen).to(torch.bfloat16)
    with torch.no_grad():
        full = linear(rows, weight)
        return all(torch.equal(linear(rows[:m], weight), full[:m]) for m in (1, 3, 16, 40, 100))


def test_the_probe_reads_this_cpu_as_a_direct_check_does() -> None:
    if not device.cpu_has_fast_bf16():
        pytest.skip("no native bf16 on this CPU: auto never considers bf16 here")
    probe = device.cpu_bf16_rows_invariant()
    if probe:  # the probe's shapes passed; other shapes and sizes must pass too
        assert _rows_invariant_by_hand()
    expected = torch.bfloat16 if probe else torch.float32
    assert device.pick_dtype("auto", torch.device("cpu")) is expected


@pytest.mark.parametrize(("fast", "invariant", "expected"), [
    (True, True, torch.bfloat16), (True, False, torch.float32), (False, True, torch.float32)])
def test_auto_takes_bf16_only_with_native_and_row_invariant_kernels(
        monkeypatch: pytest.MonkeyPatch, fast: bool, invariant: bool, expected: torch.dtype) -> None:
    monkeypatch.setattr(device, "cpu_has_fast_bf16", lambda: fast)
    monkeypatch.setattr(device, "cpu_bf16_rows_invariant", lambda: invariant)
    assert device.pick_dtype("auto", torch.device("cpu")) is expected
    assert device.pick_dtype("bfloat16", torch.device("cpu")) is torch.bfloat16  # an explicit setting wins
