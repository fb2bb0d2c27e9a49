"""How long fine-tuning has gone without progress (a trained item or a decided candidate) while work
was under way: the figure `macectl status` and `/metrics` report, and a warning in the log once a
stretch passes a bound (issue #32: a 433 s stretch went unreported)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


class ProgressWatch:
    """`progressed()` at each finished item or decided candidate; `check(busy)` every turn of the
    fine-tuner's loop. A stretch counts only while work is in flight or being judged (not while
    idle or paused by admission, which says so itself)."""

    def __init__(self, warn_s: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.warn_s = warn_s
        self.clock = clock
        self.longest_s = 0.0
        self.warnings = 0
        self._since = clock()
        self._warned = False

    def progressed(self) -> None:
        self._since = self.clock()
        self._warned = False

    def check(self, busy: bool, describe: Callable[[], str] = lambda: "") -> float:
        """Seconds of the current stretch (0 when not busy); warns once per stretch past `warn_s`."""
        now = self.clock()
        if not busy:
            self._since, self._warned = now, False
            return 0.0
        gap = now - self._since
        self.longest_s = max(self.longest_s, gap)
        if gap > self.warn_s and not self._warned:
            self._warned = True
            self.warnings += 1
            log.warning("fine-tuning made no progress for %.0f s (no item trained, no candidate decided): %s",
                        gap, describe())
        return gap
