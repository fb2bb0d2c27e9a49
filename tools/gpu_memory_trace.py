"""What holds a stage's peak GPU memory: the CUDA caching allocator's trace (torch's memory
history) read back per stage, each allocation alive at the stage's peak charged to the innermost
frame of this project's code that made it. Used by tools/bench_gpu_decode.py's train step."""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch


class StageTrace:
    """Records the allocator's history while enabled; `mark()` before a stage, `holders()` after."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.enabled = False
        self.live: dict[int, tuple[int, str]] = {}  # addr -> (bytes, where), alive before the mark
        self.seen = 0  # trace events already read

    def start(self) -> None:
        try:
            torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python",
                                                     max_entries=2_000_000)
            self.enabled = True
        except Exception:  # noqa: BLE001 - a build without it: no holders, nothing else changes
            self.enabled = False

    def stop(self) -> None:
        if self.enabled:
            torch.cuda.memory._record_memory_history(enabled=None)

    def _events(self) -> list[dict[str, Any]]:
        traces = torch.cuda.memory._snapshot().get("device_traces", [])
        index = self.device.index or 0
        return traces[index] if index < len(traces) else []

    def mark(self) -> None:
        """Bring the live set up to now (call before a stage)."""
        if not self.enabled:
            return
        events = self._events()
        for event in events[self.seen:]:
            _apply(self.live, event)
        self.seen = len(events)

    def holders(self, top: int = 8) -> list[dict[str, Any]]:
        """The allocations alive at the stage's peak (since the last mark) that the stage made,
        summed per frame, largest first; and one row for what was alive before the stage."""
        if not self.enabled:
            return []
        events = self._events()[self.seen:]
        live = dict(self.live)
        before = set(live)
        total = sum(size for size, _ in live.values())
        best, best_at = total, -1
        for i, event in enumerate(events):
            total += _apply(live, event)
            if total > best:
                best, best_at = total, i
        live = dict(self.live)
        for event in events[: best_at + 1]:
            _apply(live, event)
        sums: Counter[str] = Counter()
        for addr, (size, where) in live.items():
            if addr not in before:
                sums[where] += size
        rows = [{"where": where, "mib": round(size / 2**20, 2)} for where, size in sums.most_common(top)]
        rows.append({"where": "(alive before the stage)", "mib": round(sum(self.live[a][0] for a in before) / 2**20, 2)})
        return rows


def _where(event: dict[str, Any]) -> str:
    frames = event.get("frames") or []
    ours = [f for f in frames if "edge_runtime" in f.get("filename", "") or "/tools/" in f.get("filename", "")]
    pick = ours[0] if ours else (frames[0] if frames else {})
    name = pick.get("filename", "?").rsplit("/", 2)[-2:]
    return f"{'/'.join(name)}:{pick.get('line', '?')} {pick.get('name', '?')}"


def _apply(live: dict[int, tuple[int, str]], event: dict[str, Any]) -> int:
    """Apply one trace event to the live set; the change in live bytes."""
    action, addr = event.get("action"), event.get("addr")
    if action == "alloc":
        size = int(event.get("size", 0))
        live[addr] = (size, _where(event))
        return size
    if action in ("free_requested", "free") and addr in live:
        return -live.pop(addr)[0]
    return 0
