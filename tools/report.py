"""What every benchmark in tools/ writes beside its own figures: percentiles, the machine and its
load (a shared machine slows every figure, so each result file says how loaded it was, and how
much CPU other processes took), and the result files themselves (JSON, markdown tables, PNG
plots) under tools/results/.

Standard library and psutil at import; matplotlib is imported when a plot is drawn.
"""

from __future__ import annotations

import json
import math
import os
import platform
import resource
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "tools" / "results"


# -- percentiles ----------------------------------------------------------------------------------
# Two definitions are in use and both stay: changing one would move figures already quoted in
# README.md and docs/. Each benchmark names the one its result files were written with.


def percentile(values: Sequence[float], q: float) -> float | None:
    """The value at index round(q * (n - 1)) of the sorted values (q in 0..1; None when there
    are none): bench_e2e.py, loadgen.py."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def nearest_rank(values: Sequence[float], q: float) -> float | None:
    """The textbook nearest-rank percentile, the ceil(q * n)-th smallest value (None when there
    are none): bench_coserve.py."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(math.ceil(q * len(ordered))) - 1)]


# -- the machine ----------------------------------------------------------------------------------


def load_average(digits: int = 2) -> list[float]:
    """The 1, 5 and 15-minute load averages, rounded."""
    return [round(x, digits) for x in os.getloadavg()]


def cpu_name(fallback: str = "") -> str:
    """The CPU's model name from /proc/cpuinfo (`fallback` where there is none, e.g. macOS)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return fallback
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), fallback)


def peak_rss_mb() -> float:
    """This process's peak resident memory so far, in MiB (Linux's ru_maxrss is in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class OtherCPU:
    """CPU time other processes used since `start()`, in cores (all CPU time minus this
    process's): the part of the machine this benchmark did not have."""

    def __init__(self) -> None:
        self.start()

    def start(self) -> None:
        self._t, self._all, self._own = time.monotonic(), self._all_cpu(), self._own_cpu()

    @staticmethod
    def _all_cpu() -> float:
        t = psutil.cpu_times()
        return t.user + t.system + getattr(t, "nice", 0.0) + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)

    @staticmethod
    def _own_cpu() -> float:
        t = psutil.Process().cpu_times()
        return t.user + t.system

    def cores(self) -> float:
        elapsed = max(1e-6, time.monotonic() - self._t)
        return max(0.0, (self._all_cpu() - self._all) - (self._own_cpu() - self._own)) / elapsed


def wait_until_quiet(limit_s: float, threshold_cores: float = 0.2) -> float:
    """Wait (up to `limit_s`) for a 2-second window in which other processes use less than
    `threshold_cores`, so the unloaded figures that define "load" describe this machine rather
    than whatever else ran; returns the other processes' share in the last window."""
    deadline = time.monotonic() + limit_s
    while True:
        probe = OtherCPU()
        time.sleep(2.0)
        others = probe.cores()
        if others < threshold_cores or time.monotonic() >= deadline:
            return others


def platform_line() -> str:
    """`platform.platform()` and the CPU count, the way the co-serving results name a machine."""
    return f"{platform.platform()}, {os.cpu_count()} CPUs"


# -- result files ---------------------------------------------------------------------------------


def write_json(path: str | Path, data: Any, indent: int = 1, default: Callable[[Any], Any] | None = None) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=indent, default=default) + "\n")
    return path


def write_markdown(path: str | Path, lines: Sequence[str]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))
    return path


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]], align: str = "") -> list[str]:
    """A markdown table's lines; `align` has one letter per column, "l" or "r" (default: left)."""
    marks = ["---:" if (align[i] if i < len(align) else "l") == "r" else "---" for i in range(len(header))]
    return ["| " + " | ".join(header) + " |", "|" + "|".join(marks) + "|",
            *("| " + " | ".join(str(cell) for cell in row) + " |" for row in rows)]


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: str | Path, dpi: int = 120) -> str:
    """Lay out, save and close a figure; returns the file's name (for the result's plot list)."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return Path(path).name
