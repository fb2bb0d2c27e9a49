"""Memory budget from live telemetry: how many more bytes the process may take right now.

Owns the one rule for "free memory" per platform and the /proc/meminfo parser. It reports; the
memory ledger decides what to shed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import psutil

from edge_runtime.telemetry.reading import TelemetryReading

log = logging.getLogger(__name__)

MIB = 1024 * 1024


@dataclass(frozen=True)
class MemoryBudget:
    """Memory the process may still allocate, with what it was derived from.

    `headroom_mb` = available - reserve. Negative headroom means something else on the
    machine grew and the ledger must shed now. The ledger's own allocations are already
    counted as used in `available`, so the ledger may hold `held + headroom` in total.
    """

    kind: str  # "unified" (Jetson DRAM shared by CPU and GPU), "discrete" (GPU), "host" (CPU)
    available_mb: float
    reserve_mb: float
    source: str  # where `available_mb` came from: "tegrastats", "meminfo", "nvml", "psutil", ...
    total_mb: float | None = None
    nvmap_used_mb: float | None = None  # Jetson NvMap allocations (GPU buffers), for the log
    swap_used_mb: float | None = None
    lfb_mb: float | None = None  # tegrastats' largest free block: fragmentation indicator

    @property
    def headroom_mb(self) -> float:
        return self.available_mb - self.reserve_mb

    @property
    def headroom_bytes(self) -> int:
        return int(self.headroom_mb * MIB)

    def ledger_capacity_bytes(self, held_bytes: int) -> int:
        """Total bytes the ledger may hold, given what it already holds (never negative)."""
        return max(0, held_bytes + self.headroom_bytes)

    def describe(self) -> str:
        """One line for logs and `macectl status`."""
        parts = [
            f"{self.kind} memory: {self.available_mb:.0f} MiB available ({self.source})",
            f"reserve {self.reserve_mb:.0f} MiB",
            f"headroom {self.headroom_mb:.0f} MiB",
        ]
        if self.nvmap_used_mb is not None:
            parts.append(f"NvMap {self.nvmap_used_mb:.0f} MiB")
        if self.swap_used_mb is not None:
            parts.append(f"swap used {self.swap_used_mb:.0f} MiB")
        if self.lfb_mb is not None:
            parts.append(f"largest free block {self.lfb_mb:g} MiB")
        return ", ".join(parts)


def read_meminfo(path: str | Path = "/proc/meminfo") -> dict[str, int]:
    """Parse /proc/meminfo into {field: value}; `kB` values are converted to bytes."""
    values: dict[str, int] = {}
    for line in Path(path).read_text().splitlines():
        name, _, rest = line.partition(":")
        fields = rest.split()
        if not fields or not fields[0].isdigit():
            continue
        scale = 1024 if len(fields) > 1 and fields[1] == "kB" else 1
        values[name.strip()] = int(fields[0]) * scale
    return values


class MemoryBudgeter:
    """Turns each reading into a `MemoryBudget` using the platform's rule.

    - unified (Jetson): MemAvailable minus the reserve. cudaMemGetInfo counts page cache as
      used there (see JETSON.md), so it is never consulted. The reading's figure and a fresh
      /proc/meminfo are both MemAvailable-like; the smaller one wins because the reading may
      be up to one tegrastats interval old.
    - discrete GPU: device free memory (NVML) minus the reserve.
    - host (CPU only): available RAM minus the reserve.
    """

    def __init__(self, reserve_mb: float = 2048.0, meminfo_path: str | Path | None = "/proc/meminfo"):
        self.reserve_mb = reserve_mb
        self.meminfo_path = meminfo_path
        self.latest: MemoryBudget | None = None

    def update(self, reading: TelemetryReading) -> MemoryBudget:
        if reading.gpu_mem_free_mb is not None and not reading.unified_memory:
            budget = MemoryBudget(
                kind="discrete",
                available_mb=reading.gpu_mem_free_mb,
                total_mb=reading.gpu_mem_total_mb,
                reserve_mb=self.reserve_mb,
                source="nvml",
            )
        else:
            budget = self._system_budget(reading)
        log.debug("memory budget: %s", budget.describe())
        self.latest = budget
        return budget

    def _system_budget(self, reading: TelemetryReading) -> MemoryBudget:
        meminfo = self._meminfo()
        candidates: list[tuple[float, str]] = []
        if reading.mem_available_mb is not None:
            candidates.append((reading.mem_available_mb, reading.source))
        if "MemAvailable" in meminfo:
            candidates.append((meminfo["MemAvailable"] / MIB, "meminfo"))
        if not candidates:  # a source that saw no memory at all: ask the kernel directly
            candidates.append((psutil.virtual_memory().available / MIB, "psutil"))
        available, source = min(candidates)
        total = reading.ram_total_mb
        if total is None and "MemTotal" in meminfo:
            total = meminfo["MemTotal"] / MIB
        nvmap = meminfo.get("NvMapMemUsed")  # absent on Thor and off Jetson
        swap_used = reading.swap_used_mb
        if swap_used is None and "SwapTotal" in meminfo and "SwapFree" in meminfo:
            swap_used = (meminfo["SwapTotal"] - meminfo["SwapFree"]) / MIB
        return MemoryBudget(
            kind="unified" if reading.unified_memory else "host",
            available_mb=available,
            total_mb=total,
            reserve_mb=self.reserve_mb,
            source=source,
            nvmap_used_mb=nvmap / MIB if nvmap is not None else None,
            swap_used_mb=swap_used,
            lfb_mb=reading.lfb_mb,
        )

    def _meminfo(self) -> dict[str, int]:
        if self.meminfo_path is None:
            return {}
        try:
            return read_meminfo(self.meminfo_path)
        except OSError as exc:  # not Linux, or a sandbox without /proc: the reading must do
            log.debug("cannot read %s: %s", self.meminfo_path, exc)
            return {}
