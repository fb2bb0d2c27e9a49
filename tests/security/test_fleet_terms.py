"""A hostile aggregator against a real `maced` (issue #29 item 6): a round asking for no noise, a
huge clip or one example is refused by the device's own floors, a spent epsilon budget refuses
further rounds, and `fleet.evaluate` (a membership test with one pair) has a floor, a budget and a
rate. Nothing is trained or sent for a refused request."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from daemon.sdk import RemoteError
from edge_runtime.model.config import ModelConfig
from edge_runtime.train.dp import gaussian_rounds_epsilon
from tests.daemon.conftest import start_daemon, tiny_model  # noqa: F401 - fixtures
from tests.daemon.test_cli import macectl
from tests.daemon.test_fleet_round import LORA, add_edits, global_adapter

FLEET_ON = ["--set", "fleet.enabled=true", "--set", "finetune.enabled=false",
            "--set", "feedback.heldout_fraction=0.0"]
# What an honest aggregator asks: within the default terms (noise >= 0.5, clip <= 10, max_pairs >= 8).
HONEST = {"steps": 1, "lr": 0.02, "beta": 0.1, "clip": 1.0, "noise_multiplier": 1.1, "seed": 1,
          "max_pairs": 64, "heldout_fraction": 0.0}


def refused(call: Callable[[], object]) -> RemoteError:
    with pytest.raises(RemoteError) as info:
        call()
    assert info.value.code == "privacy_refused", info.value
    return info.value


def test_a_round_below_the_devices_floors_is_refused_naming_the_floor(start_daemon: Callable,  # noqa: F811
                                                                       tiny_model: Path) -> None:  # noqa: F811
    d = start_daemon(extra_args=FLEET_ON)
    given = global_adapter(ModelConfig.from_dir(tiny_model))
    with d.client(timeout_s=120) as c:
        add_edits(c, "terms-ann", 5)
        add_edits(c, "terms-ben", 5)
        for change, floor in (({"noise_multiplier": 0.0}, "fleet.min_noise_multiplier"),
                              ({"clip": 1e6}, "fleet.max_clip"),
                              ({"max_pairs": 1}, "fleet.min_examples")):
            error = refused(lambda change=change: c.fleet_round(1, given, LORA, {**HONEST, **change}))
            assert floor in error.message and error.param == f"config.{next(iter(change))}"
        assert c.status()["fleet"]["rounds_sent"] == 0  # nothing trained, nothing accounted
        honest = c.fleet_round(2, given, LORA, HONEST)
        assert honest["status"] == "trained" and honest["num_examples"] == 10


def test_a_round_with_a_single_user_sends_nothing(start_daemon: Callable, tiny_model: Path) -> None:  # noqa: F811
    d = start_daemon(extra_args=FLEET_ON)
    given = global_adapter(ModelConfig.from_dir(tiny_model))
    with d.client(timeout_s=120) as c:
        add_edits(c, "terms-cat", 9)  # enough examples, one user: min_users = 2
        reply = c.fleet_round(1, given, LORA, HONEST)
        assert reply["status"] == "no_material" and reply["delta"] == {} and reply["privacy"]["rounds"] == 0


def test_a_spent_epsilon_budget_refuses_the_next_round_and_status_shows_the_figures(
        start_daemon: Callable, tiny_model: Path) -> None:  # noqa: F811
    one, two = (gaussian_rounds_epsilon([1.1] * n, 1e-5) for n in (1, 2))
    budget = (one + two) / 2  # room for one round at sigma 1.1, not two
    d = start_daemon(extra_args=[*FLEET_ON, "--set", f"fleet.epsilon_budget={budget!r}"])
    given = global_adapter(ModelConfig.from_dir(tiny_model))
    with d.client(timeout_s=120) as c:
        add_edits(c, "terms-dan", 5)
        add_edits(c, "terms-eve", 5)
        first = c.fleet_round(1, given, LORA, HONEST)
        assert first["status"] == "trained" and first["privacy"]["epsilon"] == pytest.approx(one)
        error = refused(lambda: c.fleet_round(2, given, LORA, HONEST))
        assert "epsilon budget" in error.message and f"{budget:g}" in error.message
        fleet = c.status()["fleet"]
        assert fleet["rounds_sent"] == 1 and fleet["epsilon"] == pytest.approx(one)
        assert fleet["epsilon_budget"] == pytest.approx(budget) and fleet["epsilon_last_round"] == pytest.approx(one)
        assert c.fleet_status()["rounds"]["epsilon_budget"] == pytest.approx(budget)
    shown = macectl(d.endpoint, "status").stdout
    assert f"epsilon {one:.3f} of budget {budget:.3f}" in shown


def test_evaluate_has_a_floor_a_budget_and_a_rate(start_daemon: Callable, tiny_model: Path) -> None:  # noqa: F811
    d = start_daemon(extra_args=[*FLEET_ON, "--set", "fleet.evaluate_per_hour=2",
                                 "--set", "fleet.evaluate_budget=3"])
    given = global_adapter(ModelConfig.from_dir(tiny_model))
    with d.client(timeout_s=120) as c:
        add_edits(c, "terms-fay", 5)
        add_edits(c, "terms-gus", 5)
        split = {"heldout_fraction": 0.9}
        # One pair would say whether that user's pair moved: a membership test.
        error = refused(lambda: c.fleet_evaluate(given, LORA, {**split, "max_pairs": 1}))
        assert "fleet.min_heldout_pairs" in error.message
        assert c.fleet_evaluate(given, LORA, split)["status"] == "evaluated"
        assert c.fleet_evaluate(given, LORA, split)["status"] == "evaluated"
        with pytest.raises(RemoteError) as info:
            c.fleet_evaluate(given, LORA, split)
        assert info.value.code == "busy" and "fleet.evaluate_per_hour" in info.value.message
        assert c.status()["fleet"]["evaluations"] == 2
