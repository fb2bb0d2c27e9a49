"""The device's own terms for fleet rounds (issue #29, docs/fleet.md "The device's terms"): the floors
a round must meet (noise, clip, examples, users), the epsilon budget, the evaluate budget and rate,
and the privacy record that accounts them across restarts. Refuses with `privacy_refused`, naming
the floor; never raises a request's value quietly. Knows numbers and one JSON file, not training.
"""

from __future__ import annotations

import json
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from daemon.wire import FleetRoundConfig, ProtocolError
from edge_runtime import durable
from edge_runtime.train.dp import gaussian_rounds_epsilon

REFUSED = "privacy_refused"
HOUR_S = 3600.0


@dataclass(frozen=True)
class DeviceTerms:
    """The `[fleet]` settings that are this device's terms (documented defaults, docs/fleet.md): a
    round or evaluate asking for less is refused (privacy_refused naming the floor), never quietly
    raised to it."""

    min_noise_multiplier: float = 0.5  # sigma at least this (0 would send a raw update)
    max_clip: float = 10.0  # the L2 bound C at most this
    min_examples: int = 8  # a round's max_pairs at least this; fewer local examples: no_material
    min_users: int = 2  # distinct consenting users a round trains on; fewer: no_material
    epsilon_budget: float = 10.0  # at fleet.delta, over all this device's rounds; past it: refused
    min_heldout_pairs: int = 8  # an evaluate's max_pairs at least this; fewer held out: no_material
    evaluate_budget: int = 1000  # fleet.evaluate answers over the device's life (kept with epsilon)
    evaluate_per_hour: int = 12  # fleet.evaluate answers per hour (a round's gate needs two)
    publish_dir: str = ""  # fleet.publish reads only inside it; "" = <state_dir>/fleet-staging

    def problem(self) -> str | None:
        """What is wrong with these settings, for the config loader; None when nothing."""
        if (self.min_noise_multiplier < 0 or not self.max_clip > 0 or not self.epsilon_budget > 0
                or min(self.min_examples, self.min_users, self.min_heldout_pairs) < 1
                or min(self.evaluate_budget, self.evaluate_per_hour) < 0):
            return ("fleet: min_noise_multiplier must be >= 0, max_clip and epsilon_budget > 0, min_examples, "
                    "min_users and min_heldout_pairs >= 1, evaluate_budget and evaluate_per_hour >= 0")
        return None


def refuse(message: str, param: str) -> ProtocolError:
    return ProtocolError(REFUSED, message, param=param)


def check_round_floors(config: FleetRoundConfig, terms: DeviceTerms) -> None:
    """Refuse a round that asks for less privacy than this device grants (a requester could
    otherwise ask for noise 0, a huge clip or one example: one user's raw gradient)."""
    if config.noise_multiplier < terms.min_noise_multiplier:
        raise refuse(f"fleet.round: noise_multiplier {config.noise_multiplier:g} is below this device's floor "
                     f"fleet.min_noise_multiplier = {terms.min_noise_multiplier:g}", "config.noise_multiplier")
    if config.clip > terms.max_clip:
        raise refuse(f"fleet.round: clip {config.clip:g} is above this device's ceiling fleet.max_clip = "
                     f"{terms.max_clip:g}", "config.clip")
    if config.max_pairs < terms.min_examples:
        raise refuse(f"fleet.round: max_pairs {config.max_pairs} is below this device's floor fleet.min_examples "
                     f"= {terms.min_examples}", "config.max_pairs")


def check_evaluate_floor(max_pairs: int | None, terms: DeviceTerms) -> None:
    if max_pairs is not None and max_pairs < terms.min_heldout_pairs:
        raise refuse(f"fleet.evaluate: max_pairs {max_pairs} is below this device's floor "
                     f"fleet.min_heldout_pairs = {terms.min_heldout_pairs}", "config.max_pairs")


class PrivacyRecord:
    """The noise multipliers of every round this device sent an update in, and how many held-out
    evaluations it answered, in `<state>/fleet/privacy.json` (written atomically before the answer
    leaves), so a restart resets neither. A record that cannot be read stops rounds and evaluations
    rather than start over."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.rounds: list[dict[str, Any]] = []
        self.evaluations = 0
        self.error: str | None = None
        if path.exists():
            try:
                data = json.loads(path.read_text())
                self.rounds = [dict(r) for r in data["rounds"]]
                [float(r["noise_multiplier"]) for r in self.rounds]
                self.evaluations = int(data.get("evaluations", 0))
            except (OSError, ValueError, KeyError, TypeError) as exc:
                self.error = f"the fleet privacy record {path} cannot be read ({exc}); move it aside only if " \
                             "no update of this device left it"

    def epsilon(self, delta: float, extra: tuple[float, ...] = ()) -> float:
        """Spent so far at `delta` (with `extra` rounds of these noise multipliers added: what a
        next round would bring it to); unknown (infinite) while the record cannot be read."""
        if self.error is not None:
            return math.inf
        return gaussian_rounds_epsilon([*(float(r["noise_multiplier"]) for r in self.rounds), *extra], delta)

    def _write(self, rounds: list[dict[str, Any]], evaluations: int) -> None:
        if self.error is not None:
            raise ProtocolError("internal", self.error)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        durable.write_json(self.path, {"rounds": rounds, "evaluations": evaluations})
        self.rounds, self.evaluations = rounds, evaluations

    def add(self, round_number: int, clip: float, noise_multiplier: float) -> None:
        self._write([*self.rounds, {"round": round_number, "clip": clip, "noise_multiplier": noise_multiplier,
                                    "time": time.time()}], self.evaluations)

    def add_evaluation(self) -> None:
        self._write(self.rounds, self.evaluations + 1)


class FleetTerms:
    """The floors and budgets applied to one device's rounds and evaluations, with the record."""

    def __init__(self, record: PrivacyRecord, settings: Callable[[], DeviceTerms], delta: Callable[[], float],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.record = record
        self.settings = settings
        self.delta = delta  # fleet.delta: epsilon is accounted at it
        self.clock = clock
        self._evaluated_at: deque[float] = deque()

    def check_round(self, config: FleetRoundConfig) -> None:
        """Before any training: the floors, then whether this round's epsilon fits the budget."""
        terms = self.settings()
        if self.record.error is not None:
            raise ProtocolError("internal", self.record.error)
        check_round_floors(config, terms)
        delta = self.delta()
        spent = self.record.epsilon(delta)
        after = self.record.epsilon(delta, (config.noise_multiplier,))
        if after > terms.epsilon_budget:
            per_round = gaussian_rounds_epsilon([config.noise_multiplier], delta)
            raise refuse(f"fleet.round: this device's epsilon budget is spent: {spent:.4g} spent of "
                         f"fleet.epsilon_budget = {terms.epsilon_budget:g} (at delta {delta:g}); this round "
                         f"(noise_multiplier {config.noise_multiplier:g}, epsilon {per_round:.4g} alone) would "
                         f"bring it to {after:.4g}", "config.noise_multiplier")

    def check_evaluate(self, max_pairs: int | None) -> None:
        """The evaluate floor, budget and rate (each answer scores users' held-out pairs)."""
        terms = self.settings()
        if self.record.error is not None:
            raise ProtocolError("internal", self.record.error)
        check_evaluate_floor(max_pairs, terms)
        if self.record.evaluations >= terms.evaluate_budget:
            raise refuse(f"fleet.evaluate: this device's evaluate budget is spent: {self.record.evaluations} of "
                         f"fleet.evaluate_budget = {terms.evaluate_budget} answered", "adapter")
        now = self.clock()
        while self._evaluated_at and now - self._evaluated_at[0] >= HOUR_S:
            self._evaluated_at.popleft()
        if len(self._evaluated_at) >= terms.evaluate_per_hour:
            wait = HOUR_S - (now - self._evaluated_at[0])
            raise ProtocolError("busy", f"fleet.evaluate: at most fleet.evaluate_per_hour = "
                                f"{terms.evaluate_per_hour} per hour on this device", retry_after_s=round(wait, 1))

    def evaluated(self) -> None:
        """Account one evaluate answer (before it leaves)."""
        self._evaluated_at.append(self.clock())
        self.record.add_evaluation()

    def status(self) -> dict[str, Any]:
        """The figures `macectl status` and fleet.status show: spent, budget, the last round's
        epsilon alone, the floors, evaluations answered of their budget."""
        terms = self.settings()
        last = self.record.rounds[-1]["noise_multiplier"] if self.record.rounds else None
        return {"epsilon_budget": terms.epsilon_budget,
                "epsilon_last_round": None if last is None else gaussian_rounds_epsilon([float(last)], self.delta()),
                "floors": {"min_noise_multiplier": terms.min_noise_multiplier, "max_clip": terms.max_clip,
                           "min_examples": terms.min_examples, "min_users": terms.min_users,
                           "min_heldout_pairs": terms.min_heldout_pairs},
                "evaluations": self.record.evaluations, "evaluate_budget": terms.evaluate_budget,
                "evaluate_per_hour": terms.evaluate_per_hour}
