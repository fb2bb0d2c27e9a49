"""The real subprocess path: a fake `tegrastats` on PATH prints a recorded trace through a memory
squeeze and a thermal event; TegrastatsSource + MemoryBudgeter + AdmissionController react."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from pathlib import Path

import pytest
from telemetry_fixtures import SQUEEZE_TRACE

from daemon.admission import AdmissionConfig, AdmissionController, AdmissionSignals, AdmissionState
from edge_runtime.telemetry.budget import MemoryBudgeter
from edge_runtime.telemetry.sources import TegrastatsSource, TelemetryUnavailable

N, SHED, QUEUE, REJECT = (AdmissionState.NORMAL, AdmissionState.SHED_FINETUNE,
                          AdmissionState.QUEUE, AdmissionState.REJECT)

FAKE_TEGRASTATS = '''#!{python}
"""Stand-in for NVIDIA tegrastats: prints a recorded trace at the requested interval."""
import os, sys, time
args = sys.argv[1:]
interval_ms = int(args[args.index("--interval") + 1]) if "--interval" in args else 1000
with open({starts!r}, "a") as f:
    f.write(f"{{os.getpid()}}\\n")
lines = [l.rstrip("\\n") for l in open({trace!r}) if l.strip() and not l.startswith("#")]
if {exit_after} > 0:
    lines = lines[:{exit_after}]
while True:
    for line in lines:
        print(line, flush=True)
        time.sleep(interval_ms / 1000)
    if {exit_after} >= 0:
        break
sys.exit({exit_code})
'''


def install_fake_tegrastats(tmp_path: Path, monkeypatch, trace: Path, exit_after: int = 0,
                            exit_code: int = 0) -> Path:
    """Write an executable `tegrastats` into tmp_path/bin and put it first on PATH.

    exit_after > 0: print that many lines then exit; 0: print the whole trace then exit;
    < 0: loop over the trace forever.
    """
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    starts = tmp_path / "starts.txt"
    script = bindir / "tegrastats"
    script.write_text(FAKE_TEGRASTATS.format(python=sys.executable, starts=str(starts),
                                             trace=str(trace), exit_after=exit_after,
                                             exit_code=exit_code))
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}")
    return starts


class StepClock:
    """Admission time advances one second per tegrastats line, whatever the machine's load."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def run_pipeline(count: int):
    clock = StepClock()
    source = TegrastatsSource(interval_s=0.005)
    budgeter = MemoryBudgeter(reserve_mb=2048, meminfo_path=None)  # budget from the trace only
    controller = AdmissionController(AdmissionConfig(min_dwell_s=2.0, stale_after_s=60.0), clock)
    steps = []
    async with contextlib.aclosing(source.readings()) as readings:
        async for reading in readings:
            clock.now += 1.0
            budget = budgeter.update(reading)
            decision = controller.observe(AdmissionSignals.from_telemetry(reading, budget, 0))
            steps.append((reading, budget, decision, controller.admit("inference").action,
                          controller.admit("finetune").action))
            if len(steps) == count:
                break
    return source, steps


def test_squeeze_and_thermal_event_drive_admission_through_real_subprocess(tmp_path, monkeypatch):
    trace_lines = [x for x in SQUEEZE_TRACE.read_text().splitlines() if x and x[0] != "#"]
    install_fake_tegrastats(tmp_path, monkeypatch, SQUEEZE_TRACE, exit_after=-1)
    source, steps = asyncio.run(asyncio.wait_for(run_pipeline(len(trace_lines)), timeout=30))
    assert source.starts == 1

    states = [d.state for _, _, d, _, _ in steps]
    changes = [s for i, s in enumerate(states) if i == 0 or s is not states[i - 1]]
    assert changes == [N, SHED, QUEUE, REJECT, QUEUE, SHED, N,  # memory squeeze and release
                       SHED, QUEUE, REJECT, QUEUE, SHED, N]  # thermal event and cool-down

    # Fine-tuning is shed first: the first non-normal step still serves inference.
    first = next(i for i, s in enumerate(states) if s is not N)
    assert steps[first][3:] == ("allow", "queue")
    assert "memory headroom 3793 MiB < 4096 MiB" in steps[first][2].reason
    # ... and resumed last: inference is back (allow) before fine-tuning is.
    after_reject = states.index(REJECT)
    inference_back = next(i for i in range(after_reject, len(steps)) if steps[i][3] == "allow")
    finetune_back = next(i for i in range(after_reject, len(steps)) if steps[i][4] == "allow")
    assert inference_back < finetune_back
    rejected = [s for s in steps if s[3] == "reject"]
    assert rejected and all(s[2].retry_after_s == 2.0 for s in rejected)
    thermal = [s[2].reason for s in steps if s[2].state is REJECT and "temperature" in s[2].reason]
    assert thermal and "temperature 97.1 C >= 96.0 C (reject)" in thermal[0]

    # The budget follows every reading: MemAvailable-like (total - used) minus the reserve.
    for reading, budget, _, _, _ in steps:
        assert budget.kind == "unified"
        assert budget.available_mb == reading.ram_total_mb - reading.ram_used_mb
        assert budget.headroom_mb == reading.ram_total_mb - reading.ram_used_mb - 2048
    headrooms = sorted({b.headroom_mb for _, b, _, _, _ in steps})
    assert headrooms == [143, 893, 3793, 42586]


def test_tegrastats_is_restarted_when_it_dies(tmp_path, monkeypatch):
    starts = install_fake_tegrastats(tmp_path, monkeypatch, SQUEEZE_TRACE, exit_after=2,
                                     exit_code=1)

    async def collect():
        source = TegrastatsSource(interval_s=0.001, backoff_s=0.01)
        got = []
        async with contextlib.aclosing(source.readings()) as readings:
            async for reading in readings:
                got.append(reading)
                if len(got) == 7:
                    break
        return source, got

    source, got = asyncio.run(asyncio.wait_for(collect(), timeout=30))
    assert len(got) == 7 and all(r.ram_total_mb == 62841 for r in got)
    assert source.starts == 4  # 2 lines per life: 7 readings need a fourth process
    assert len(starts.read_text().split()) == 4


def test_closing_the_source_stops_tegrastats(tmp_path, monkeypatch):
    starts = install_fake_tegrastats(tmp_path, monkeypatch, SQUEEZE_TRACE, exit_after=-1)

    async def one_reading():
        source = TegrastatsSource(interval_s=0.001)
        async with contextlib.aclosing(source.readings()) as readings:
            async for _ in readings:
                break

    asyncio.run(asyncio.wait_for(one_reading(), timeout=30))
    pid = int(starts.read_text().split()[0])
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # terminated and reaped, not left printing into a closed pipe


def test_missing_tegrastats_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))

    async def first():
        async with contextlib.aclosing(TegrastatsSource().readings()) as readings:
            async for _ in readings:
                pass

    with pytest.raises(TelemetryUnavailable, match="not found on PATH"):
        asyncio.run(first())
