"""`TelemetryReading`: the one record every telemetry source yields, whatever the hardware.

Budget and admission read only this; they never see tegrastats text, jtop dicts or NVML handles.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from edge_runtime.telemetry.tegrastats import TegrastatsSample


@dataclass(frozen=True)
class TelemetryReading:
    """A snapshot of the machine's pressure, in MB / percent / degrees C / mW.

    `unified_memory` is True on Jetson (CPU and GPU share DRAM), where the memory figures are
    the whole system's. None means "this source cannot see it", never zero.
    """

    t: float  # time.monotonic() when the reading was taken or received
    source: str  # "tegrastats", "jtop", "psutil", "replay"
    unified_memory: bool
    ram_used_mb: float | None = None
    ram_total_mb: float | None = None
    mem_available_mb: float | None = None  # what the OS could still hand out (MemAvailable)
    swap_used_mb: float | None = None
    swap_total_mb: float | None = None
    lfb_mb: float | None = None  # largest free block, Jetson only
    gpu_util_pct: float | None = None
    emc_util_pct: float | None = None
    gpu_mem_free_mb: float | None = None  # discrete GPUs only (NVML)
    gpu_mem_total_mb: float | None = None
    max_temp_c: float | None = None
    temps_c: dict[str, float] = field(default_factory=dict)
    total_power_mw: float | None = None
    power_limit_mw: float | None = None  # the GPU's enforced power limit (NVML; discrete GPUs)
    power_mw: dict[str, float] = field(default_factory=dict)
    sample: TegrastatsSample | None = None  # the parsed line, for tegrastats-based sources


def reading_from_sample(sample: TegrastatsSample, t: float, source: str) -> TelemetryReading:
    """Turn one parsed tegrastats line into a reading (Jetson: unified memory)."""
    available = None
    if sample.ram_used_mb is not None and sample.ram_total_mb is not None:
        # tegrastats' `used` already leaves out page cache and buffers, so total - used is
        # the kernel's MemAvailable to within a sample period.
        available = float(sample.ram_total_mb - sample.ram_used_mb)
    return TelemetryReading(
        t=t,
        source=source,
        unified_memory=True,
        ram_used_mb=_float(sample.ram_used_mb),
        ram_total_mb=_float(sample.ram_total_mb),
        mem_available_mb=available,
        swap_used_mb=_float(sample.swap_used_mb),
        swap_total_mb=_float(sample.swap_total_mb),
        lfb_mb=sample.lfb_block_mb,
        gpu_util_pct=sample.gpu_util_pct,
        emc_util_pct=sample.emc_util_pct,
        max_temp_c=sample.max_temp_c(),
        temps_c=dict(sample.temps_c),
        total_power_mw=_float(sample.total_power_mw()),
        power_mw={k: float(v) for k, v in sample.power_mw.items()},
        sample=sample,
    )


def _float(value: int | float | None) -> float | None:
    return None if value is None else float(value)
