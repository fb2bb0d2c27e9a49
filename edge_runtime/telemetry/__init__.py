"""Telemetry: tegrastats parser, sources (tegrastats, jtop, psutil/NVML, replay), memory budget.

Feeds the memory ledger and admission control with clean numbers; never imports torch.
"""

from __future__ import annotations

from edge_runtime.telemetry.budget import MemoryBudget, MemoryBudgeter, read_meminfo
from edge_runtime.telemetry.config import TelemetryConfig, select_budgeter, select_source
from edge_runtime.telemetry.reading import TelemetryReading, reading_from_sample
from edge_runtime.telemetry.sources import (
    JtopSource,
    PsutilSource,
    ReplaySource,
    TegrastatsSource,
    TelemetrySource,
    TelemetryUnavailable,
)
from edge_runtime.telemetry.tegrastats import TegrastatsSample, parse_line

__all__ = [
    "JtopSource",
    "MemoryBudget",
    "MemoryBudgeter",
    "PsutilSource",
    "ReplaySource",
    "TegrastatsSample",
    "TegrastatsSource",
    "TelemetryConfig",
    "TelemetryReading",
    "TelemetrySource",
    "TelemetryUnavailable",
    "parse_line",
    "read_meminfo",
    "reading_from_sample",
    "select_budgeter",
    "select_source",
]
