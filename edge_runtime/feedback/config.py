"""Knobs of the feedback store: input limits, retention, held-out fraction, group-commit size.

Defaults fit a single Jetson with a handful of users; paths are not here (the store takes them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DAY_S = 86_400.0


@dataclass(frozen=True)
class FeedbackStoreConfig:
    heldout_fraction: float = 0.10  # share of pairs kept for evaluation, chosen by pair hash
    max_text_bytes: int = 64 * 1024  # per prompt, candidate or edit, UTF-8 encoded
    max_candidates: int = 16
    max_model_chars: int = 256
    max_timing_fields: int = 32
    retention_max_age_s: float | None = 365 * DAY_S  # None: keep until erased
    retention_max_interactions_per_user: int | None = 20_000  # None: no cap
    # The store applies retention itself: once when it opens, then at this period (None: only
    # when `apply_retention()` is called).
    retention_interval_s: float | None = 3600.0
    max_batch: int = 512  # writes folded into one group commit
    busy_timeout_ms: int = 5_000
    # A full VACUUM after forget() rewrites every page, so no stale copy of erased text survives
    # in page slack; it costs a copy of the database, which is fine for a rare operation.
    vacuum_on_forget: bool = True

    def __post_init__(self) -> None:
        if not (0.0 <= self.heldout_fraction < 1.0):
            raise ValueError(f"heldout_fraction must be in [0, 1); got {self.heldout_fraction}")
        if self.max_text_bytes < 1 or self.max_candidates < 1 or self.max_batch < 1:
            raise ValueError("max_text_bytes, max_candidates and max_batch must be >= 1")
        age = self.retention_max_age_s
        if age is not None and not (age > 0 and math.isfinite(age)):
            raise ValueError(f"retention_max_age_s must be positive or None; got {age}")
        period = self.retention_interval_s
        if period is not None and not (period > 0 and math.isfinite(period)):
            raise ValueError(f"retention_interval_s must be positive or None; got {period}")
        cap = self.retention_max_interactions_per_user
        if cap is not None and cap < 1:
            raise ValueError(f"retention_max_interactions_per_user must be >= 1 or None; got {cap}")
