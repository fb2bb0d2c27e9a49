"""MemoryBudgeter: MemAvailable on unified memory, device free on discrete GPUs, RAM on CPU."""

from __future__ import annotations

import pytest

from edge_runtime.telemetry.budget import MIB, MemoryBudget, MemoryBudgeter, read_meminfo
from edge_runtime.telemetry.reading import TelemetryReading, reading_from_sample
from edge_runtime.telemetry.tegrastats import parse_line

# SYNTHETIC /proc/meminfo in the kernel's format, with the Jetson-only NvMapMemUsed field;
# the numbers are made up to be easy to check (MemAvailable 9000 MiB, NvMap 1500 MiB).
MEMINFO = """\
MemTotal:       64348096 kB
MemFree:         2048000 kB
MemAvailable:    9216000 kB
Buffers:          102400 kB
Cached:          6144000 kB
SwapTotal:      32174080 kB
SwapFree:       32086016 kB
HugePages_Total:       0
NvMapMemFree:      12288 kB
NvMapMemUsed:    1536000 kB
"""

ORIN_LINE = ("05-09-2026 18:42:06 RAM 18207/62841MB (lfb 466x4MB) SWAP 86/31420MB (cached 0MB) "
             "CPU [14%@2188,5%@2112] EMC_FREQ 3%@2133 GR3D_FREQ 0%@[0,0] cpu@52.562C")


@pytest.fixture
def meminfo(tmp_path):
    path = tmp_path / "meminfo"
    path.write_text(MEMINFO)
    return path


def test_read_meminfo_converts_kb_to_bytes(meminfo):
    info = read_meminfo(meminfo)
    assert info["MemAvailable"] == 9216000 * 1024
    assert info["NvMapMemUsed"] == 1536000 * 1024
    assert info["HugePages_Total"] == 0


def test_unified_budget_follows_the_tegrastats_reading():
    reading = reading_from_sample(parse_line(ORIN_LINE), t=0.0, source="tegrastats")
    budget = MemoryBudgeter(reserve_mb=2048, meminfo_path=None).update(reading)
    assert budget.kind == "unified"
    assert budget.available_mb == 62841 - 18207
    assert budget.headroom_mb == 62841 - 18207 - 2048
    assert (budget.swap_used_mb, budget.lfb_mb, budget.source) == (86, 4.0, "tegrastats")


def test_unified_budget_takes_the_smaller_of_reading_and_meminfo(meminfo):
    reading = reading_from_sample(parse_line(ORIN_LINE), t=0.0, source="tegrastats")
    budget = MemoryBudgeter(reserve_mb=1024, meminfo_path=meminfo).update(reading)
    assert budget.available_mb == 9000 and budget.source == "meminfo"
    assert budget.nvmap_used_mb == 1500
    assert budget.headroom_mb == 9000 - 1024
    text = budget.describe()
    assert "NvMap 1500 MiB" in text and "swap used 86 MiB" in text and "largest free block 4" in text


def test_discrete_gpu_budget_is_device_free_memory(meminfo):
    reading = TelemetryReading(t=0, source="psutil", unified_memory=False, mem_available_mb=50_000,
                               gpu_mem_free_mb=6000, gpu_mem_total_mb=24_000)
    budget = MemoryBudgeter(reserve_mb=512, meminfo_path=meminfo).update(reading)
    assert (budget.kind, budget.available_mb, budget.source) == ("discrete", 6000, "nvml")
    assert budget.headroom_mb == 5488


def test_cpu_host_budget_is_available_ram():
    reading = TelemetryReading(t=0, source="psutil", unified_memory=False, mem_available_mb=3000,
                               swap_used_mb=10)
    budget = MemoryBudgeter(reserve_mb=1000, meminfo_path=None).update(reading)
    assert (budget.kind, budget.available_mb, budget.headroom_mb) == ("host", 3000, 2000)


def test_reading_without_memory_falls_back_to_the_kernel():
    reading = TelemetryReading(t=0, source="jtop", unified_memory=True)
    budget = MemoryBudgeter(meminfo_path="/nonexistent/meminfo").update(reading)
    assert budget.source == "psutil" and budget.available_mb > 0


def test_ledger_capacity_counts_what_the_ledger_already_holds():
    budget = MemoryBudget(kind="unified", available_mb=3000, reserve_mb=2000, source="tegrastats")
    assert budget.ledger_capacity_bytes(held_bytes=10 * 1024 * MIB) == (10 * 1024 + 1000) * MIB
    squeezed = MemoryBudget(kind="unified", available_mb=500, reserve_mb=2000, source="meminfo")
    assert squeezed.headroom_mb == -1500  # something else grew: the ledger must shed
    assert squeezed.ledger_capacity_bytes(held_bytes=1000 * MIB) == 0
