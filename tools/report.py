"""What every benchmark in tools/ writes beside its own figures: percentiles, the machine and its
load (a shared machine slows every figure, so each result file says how loaded it was), and the
result files themselves (JSON, markdown tables, PNG plots) under tools/results/.

Standard library only at import; matplotlib is imported when a plot is drawn.
"""

from __future__ import annotations

import json
import math
import os
import platform
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

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
