"""Per-request acceptance bookkeeping: how many drafted tokens the target model accepted, and
whether speculating still pays for this request (a warm-up, a threshold, a cool-down)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Acceptance:
    """The "auto" rule: after `warmup` drafted tokens, a request whose acceptance rate over its
    window is below `threshold` stops speculating; it tries again (a fresh window) once
    `cooldown` more tokens were generated without it, since text often turns repetitive later
    (a summary that starts quoting its source). `cooldown` 0 = never again."""

    warmup: int = 16
    threshold: float = 0.3
    cooldown: int = 64
    drafted: int = 0  # over the request's life (stats)
    accepted: int = 0
    verifies: int = 0
    window_drafted: int = 0  # since the window opened
    window_accepted: int = 0
    paused_for: int = 0  # plain decode steps left before the next try (0: speculating)
    pauses: int = 0

    @property
    def rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def active(self) -> bool:
        return self.paused_for == 0

    def record(self, drafted: int, accepted: int) -> None:
        """One verify step: `accepted` of its `drafted` tokens were what the model chose."""
        self.drafted += drafted
        self.accepted += accepted
        self.verifies += 1
        self.window_drafted += drafted
        self.window_accepted += accepted
        if self.window_drafted >= self.warmup and self.window_accepted < self.threshold * self.window_drafted:
            self.paused_for = self.cooldown if self.cooldown > 0 else -1
            self.pauses += 1
            self.window_drafted = self.window_accepted = 0
        elif self.window_drafted >= 4 * self.warmup:
            # Halve the window: the rule follows the text's recent behaviour, not its start.
            self.window_drafted //= 2
            self.window_accepted //= 2

    def plain_step(self) -> None:
        """A decode step without drafts while paused: the cool-down runs down (-1: never)."""
        if self.paused_for > 0:
            self.paused_for -= 1
