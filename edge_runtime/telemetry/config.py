"""Telemetry knobs and the one place that turns them into a source and a budgeter.

The daemon's config embeds `TelemetryConfig`; `maced --telemetry-replay FILE` sets `replay_file`.
"""

from __future__ import annotations

from dataclasses import dataclass

from edge_runtime.telemetry.budget import MemoryBudgeter
from edge_runtime.telemetry.sources import (
    JtopSource,
    PsutilSource,
    ReplaySource,
    TegrastatsSource,
    TelemetrySource,
    auto_source_name,
)

SOURCES = ("auto", "tegrastats", "jtop", "psutil", "replay")


@dataclass
class TelemetryConfig:
    source: str = "auto"  # one of SOURCES; auto = replay if replay_file, else jtop/tegrastats/psutil
    interval_s: float = 1.0  # tegrastats/jtop/psutil sampling period
    tegrastats_path: str = "tegrastats"
    replay_file: str | None = None
    replay_speed: float = 1.0  # 10 = ten times faster than recorded; <= 0 = no waiting
    replay_loop: bool = False
    # Kept free for the OS, the desktop and the other apps on the board (cameras, ROS nodes).
    memory_reserve_mb: float = 2048.0
    meminfo_path: str = "/proc/meminfo"

    def resolved_source(self) -> str:
        if self.source not in SOURCES:
            raise ValueError(f"telemetry source {self.source!r} is not one of {', '.join(SOURCES)}")
        if self.source == "auto":
            return auto_source_name(self.replay_file)
        return self.source


def select_source(config: TelemetryConfig) -> TelemetrySource:
    """Build the telemetry source named by the config (auto-selected by platform)."""
    name = config.resolved_source()
    if name == "replay":
        if not config.replay_file:
            raise ValueError("telemetry source 'replay' needs replay_file")
        return ReplaySource(
            config.replay_file,
            speed=config.replay_speed,
            interval_s=config.interval_s,
            loop=config.replay_loop,
        )
    if name == "tegrastats":
        return TegrastatsSource(config.interval_s, executable=config.tegrastats_path)
    if name == "jtop":
        return JtopSource(config.interval_s)
    return PsutilSource(config.interval_s)


def select_budgeter(config: TelemetryConfig) -> MemoryBudgeter:
    """A budgeter matching the source: a replay must not mix in this machine's /proc/meminfo."""
    replaying = config.resolved_source() == "replay"
    return MemoryBudgeter(
        reserve_mb=config.memory_reserve_mb,
        meminfo_path=None if replaying else config.meminfo_path,
    )
