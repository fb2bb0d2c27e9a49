"""AdmissionController as a pure state machine: ordering, hysteresis, dwell, reasons."""

from __future__ import annotations

import json

import pytest

from daemon.admission import (
    AdmissionConfig,
    AdmissionController,
    AdmissionSignals,
    AdmissionState,
    Threshold,
)
from edge_runtime.errors import AdmissionRejected
from edge_runtime.telemetry.budget import MemoryBudget
from edge_runtime.telemetry.reading import TelemetryReading

N, SHED, QUEUE, REJECT = (AdmissionState.NORMAL, AdmissionState.SHED_FINETUNE,
                          AdmissionState.QUEUE, AdmissionState.REJECT)
CALM = AdmissionSignals(memory_headroom_mb=30_000, gpu_util_pct=20, emc_util_pct=10,
                        max_temp_c=50, power_mw=10_000, queue_length=0)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def with_(**changes) -> AdmissionSignals:
    return AdmissionSignals(**{**CALM.__dict__, **changes})


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def ctl(clock) -> AdmissionController:
    return AdmissionController(AdmissionConfig(min_dwell_s=5.0, stale_after_s=30.0), clock)


def test_calm_signals_admit_everything(ctl):
    decision = ctl.observe(CALM)
    assert decision.state is N and decision.reason == "all signals within limits"
    assert ctl.admit("inference").action == "allow"
    assert ctl.admit("finetune").action == "allow"


@pytest.mark.parametrize("headroom, state", [(5000, N), (4000, SHED), (900, QUEUE), (100, REJECT)])
def test_memory_headroom_escalates_immediately(ctl, headroom, state):
    assert ctl.observe(with_(memory_headroom_mb=headroom)).state is state


def test_fine_tuning_is_shed_before_inference_is_touched(ctl):
    decision = ctl.observe(with_(memory_headroom_mb=3000))
    assert decision.state is SHED
    assert "memory headroom 3000 MiB < 4096 MiB (shed_finetune)" in decision.reason
    finetune, inference = ctl.admit("finetune"), ctl.admit("inference")
    assert finetune.action == "queue" and "fine-tuning paused" in finetune.reason
    assert inference.action == "allow"


def test_queue_state_makes_inference_wait(ctl):
    ctl.observe(with_(memory_headroom_mb=900))
    assert ctl.admit("inference").action == "queue"
    assert ctl.admit("finetune").action == "queue"


def test_reject_carries_reason_and_retry_after(ctl):
    ctl.observe(with_(max_temp_c=97.5))
    verdict = ctl.admit("inference")
    assert verdict.action == "reject"
    assert verdict.retry_after_s == 5.0
    assert "temperature 97.5 C >= 96.0 C (reject)" in verdict.reason
    with pytest.raises(AdmissionRejected) as err:
        ctl.require("inference")
    assert err.value.retry_after_s == 5.0 and "temperature" in err.value.reason
    assert ctl.require("finetune").action == "queue"  # internal work waits, never lost


def test_hovering_signal_does_not_flap(ctl, clock):
    for i in range(40):  # oscillates around the enter threshold (4096) but never above exit
        clock.now += 1
        ctl.observe(with_(memory_headroom_mb=4000 if i % 2 else 4200))
    assert ctl.state is SHED
    assert len(ctl.transitions) == 1


def test_recovery_waits_the_dwell_and_steps_down_one_state_at_a_time(ctl, clock):
    ctl.observe(with_(memory_headroom_mb=100))
    assert ctl.state is REJECT
    clock.now += 1
    decision = ctl.observe(CALM)
    assert decision.state is REJECT and "holding reject for another 4.0 s" in decision.reason
    seen = []
    for _ in range(20):
        clock.now += 1
        seen.append(ctl.observe(CALM).state)
    assert [s for i, s in enumerate(seen) if i == 0 or s is not seen[i - 1]] == [
        REJECT, QUEUE, SHED, N]
    steps = [t for t, _, _ in ctl.transitions]
    assert all(b - a >= 5.0 for a, b in zip(steps, steps[1:], strict=False))


def test_escalation_during_recovery_is_not_delayed(ctl, clock):
    ctl.observe(with_(memory_headroom_mb=3000))
    clock.now += 0.1
    assert ctl.observe(with_(memory_headroom_mb=100)).state is REJECT


def test_thermal_ladder_uses_orin_throttle_margins(ctl, clock):
    for temp, state in [(84.9, N), (85.0, SHED), (92.0, QUEUE), (96.0, REJECT)]:
        clock.now += 1
        assert ctl.observe(with_(max_temp_c=temp)).state is state, temp


def test_power_budget(ctl):
    assert ctl.observe(with_(power_mw=46_000)).state is SHED
    decision = ctl.observe(with_(power_mw=51_000))
    assert decision.state is QUEUE and "power 51.0 W >= 50.0 W (queue)" in decision.reason


def test_power_is_measured_against_the_devices_own_limit_where_it_reports_one(clock):
    """A discrete GPU reports its enforced limit (NVML): an H100 idles near 70 W, above the
    Jetson's 50 W, and must not queue everyone for it (seen on an H100 before this fix)."""
    ctl = AdmissionController(clock=clock)
    assert ctl.observe(with_(power_mw=72_000, power_limit_mw=700_000)).state is N
    assert ctl.power_budget_mw() == 700_000
    assert ctl.observe(with_(power_mw=640_000, power_limit_mw=700_000)).state is SHED
    clock.now += 1
    fixed = AdmissionController(AdmissionConfig(power_budget_mw=60_000), clock=clock)
    assert fixed.observe(with_(power_mw=72_000, power_limit_mw=700_000)).state is QUEUE  # configured wins
    ignored = AdmissionController(AdmissionConfig(power_budget_mw=0), clock=clock)
    assert ignored.observe(with_(power_mw=10**7)).state is N and ignored.power_budget_mw() is None
    assert AdmissionController(clock=clock).power_budget_mw() == 50_000  # no limit reported: Jetson's


def test_gpu_and_emc_saturation_only_shed_fine_tuning(ctl):
    assert ctl.observe(with_(gpu_util_pct=99, emc_util_pct=95)).state is SHED


def test_full_queue_rejects(ctl):
    assert ctl.observe(with_(queue_length=8)).state is SHED
    assert ctl.observe(with_(queue_length=300)).state is REJECT


def test_unmeasured_signals_are_ignored(ctl):
    # Thor prints no GPU load; a CPU-only box has no temperatures or power rails.
    signals = AdmissionSignals(memory_headroom_mb=20_000)
    assert ctl.observe(signals).state is N


def test_silent_telemetry_sheds_fine_tuning(ctl, clock):
    ctl.observe(CALM)
    clock.now += 31
    decision = ctl.tick()
    assert decision.state is SHED and "no telemetry for 31 s" in decision.reason


def test_queue_changes_between_readings_do_not_hide_stale_telemetry(ctl, clock):
    ctl.observe(CALM)
    clock.now += 1
    assert ctl.observe_queue(300).state is REJECT
    for _ in range(30):
        clock.now += 1
        ctl.observe_queue(0)
    decision = ctl.observe_queue(0)
    assert decision.state is not N and "no telemetry for 31 s" in decision.reason


def test_status_is_json_ready_and_explains(ctl, clock):
    ctl.observe(with_(memory_headroom_mb=900))
    clock.now += 2
    status = json.loads(json.dumps(ctl.status()))
    assert status["state"] == "queue"
    assert "memory headroom 900 MiB" in status["reason"]
    assert status["in_state_s"] == 2.0
    assert status["signals"]["memory_headroom_mb"] == 900
    assert status["transitions"][-1]["state"] == "queue"


def test_threshold_exit_must_be_on_the_safe_side():
    with pytest.raises(ValueError):
        Threshold(enter=80, exit=90)
    with pytest.raises(ValueError):
        Threshold(enter=1000, exit=500, higher_is_worse=False)


def test_signals_from_telemetry():
    reading = TelemetryReading(t=0, source="tegrastats", unified_memory=True, gpu_util_pct=None,
                               emc_util_pct=3.0, max_temp_c=52.5, total_power_mw=8726.0)
    budget = MemoryBudget(kind="unified", available_mb=44634, reserve_mb=2048, source="tegrastats")
    signals = AdmissionSignals.from_telemetry(reading, budget, queue_length=3)
    assert signals == AdmissionSignals(memory_headroom_mb=42586, gpu_util_pct=None,
                                       emc_util_pct=3.0, max_temp_c=52.5, power_mw=8726.0,
                                       queue_length=3)


def test_device_allows_inference_when_only_the_backlog_rejects(ctl, clock):
    """A backlog (which clients make) alone lets the service admit light clients; the device's
    own pressure never does."""
    assert ctl.observe(with_(queue_length=300)).state is REJECT
    assert ctl.admit("inference").action == "reject" and ctl.device_allows_inference()
    clock.now += 1
    assert ctl.observe(with_(queue_length=0)).state is REJECT  # held by the dwell time
    assert ctl.device_allows_inference()
    clock.now += 10
    ctl.observe(CALM)
    assert ctl.observe(with_(queue_length=300, memory_headroom_mb=50)).state is REJECT
    assert not ctl.device_allows_inference()
    clock.now += 10
    ctl.observe(CALM)
    clock.now += 10
    ctl.observe(CALM)
    assert ctl.observe(with_(queue_length=300, max_temp_c=99)).state is REJECT
    assert not ctl.device_allows_inference()
