"""Replay, psutil/NVML and jtop sources, trace loading, and auto-selection from config."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import types

import pytest
from telemetry_fixtures import FIXTURES, SQUEEZE_TRACE

from edge_runtime.telemetry import config as telemetry_config
from edge_runtime.telemetry.config import TelemetryConfig, select_budgeter, select_source
from edge_runtime.telemetry.sources import (
    JtopSource,
    PsutilSource,
    ReplaySource,
    TegrastatsSource,
    TelemetryUnavailable,
    load_trace,
    reading_from_jtop,
)
from edge_runtime.telemetry.tegrastats import parse_line


async def take(source, n: int) -> list:
    got = []
    async with contextlib.aclosing(source.readings()) as readings:
        async for reading in readings:
            got.append(reading)
            if len(got) == n:
                break
    return got


class RecordingSleep:
    def __init__(self) -> None:
        self.delays: list[float] = []

    async def __call__(self, delay: float) -> None:
        self.delays.append(delay)


def test_replay_follows_printed_timestamps_scaled_by_speed():
    sleep = RecordingSleep()
    readings = asyncio.run(take(ReplaySource(SQUEEZE_TRACE, speed=4.0, sleep=sleep), 5))
    assert [r.source for r in readings] == ["replay"] * 5
    assert sleep.delays == [0.25] * 4  # 1 s apart in the trace, played 4x faster


def test_replay_without_timestamps_uses_the_interval_and_can_loop(tmp_path):
    path = tmp_path / "old.log"
    path.write_text("RAM 1923/3964MB (lfb 2x2MB) CPU [5%@1224]\n\nRAM 1900/3964MB CPU [1%@1224]\n")
    sleep = RecordingSleep()
    source = ReplaySource(path, speed=2.0, interval_s=0.5, loop=True, sleep=sleep)
    readings = asyncio.run(take(source, 5))
    assert [r.ram_used_mb for r in readings] == [1923, 1900, 1923, 1900, 1923]
    assert sleep.delays == [0.25] * 4  # starting over keeps the spacing too


def test_replay_speed_zero_never_waits():
    sleep = RecordingSleep()
    readings = asyncio.run(take(ReplaySource(SQUEEZE_TRACE, speed=0, sleep=sleep), 38))
    assert len(readings) == 38 and sleep.delays == []


def test_replay_of_an_empty_file_is_an_error(tmp_path):
    path = tmp_path / "empty.log"
    path.write_text("# nothing recorded\n")
    with pytest.raises(TelemetryUnavailable):
        asyncio.run(take(ReplaySource(path), 1))


def test_load_trace_reads_raw_lines_parse_output_and_fixture_records(tmp_path):
    line = "RAM 1923/3964MB (lfb 2x2MB) CPU [5%@1224,off] GPU@40C POM_5V_IN 1750/1628"
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join([
        "# comment",
        line,
        json.dumps(parse_line(line).to_dict()),
        json.dumps({"line": line, "device_kind": "Nano"}),
    ]))
    samples = load_trace(path)
    assert len(samples) == 3 and samples[0] == samples[1] == samples[2]
    assert len(load_trace(FIXTURES / "tegrastats_lines.jsonl")) >= 20


def test_psutil_source_reads_this_machine():
    reading = PsutilSource(use_nvml=False).read_once()
    assert reading.source == "psutil"
    assert 0 < reading.mem_available_mb <= reading.ram_total_mb
    assert reading.gpu_mem_free_mb is None


def fake_pynvml(free_mb: float = 6000) -> types.ModuleType:
    nv = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    def unsupported(*_):
        raise NVMLError("Not Supported")

    nv.NVMLError = NVMLError
    nv.NVML_TEMPERATURE_GPU = 0
    nv.nvmlInit = lambda: None
    nv.nvmlDeviceGetCount = lambda: 1
    nv.nvmlDeviceGetHandleByIndex = lambda i: "gpu0"
    nv.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=37)
    nv.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(free=free_mb * 2**20,
                                                                 total=24576 * 2**20)
    nv.nvmlDeviceGetTemperature = lambda h, kind: 61
    nv.nvmlDeviceGetPowerUsage = unsupported  # some boards do not report power
    nv.nvmlDeviceGetEnforcedPowerLimit = lambda h: 700_000  # an H100 SXM's limit
    return nv


def test_psutil_source_with_nvml_reports_discrete_gpu(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml())
    source = PsutilSource()
    source.unified = False  # a discrete-GPU box, whatever this test machine is
    reading = source.read_once()
    assert (reading.gpu_util_pct, reading.gpu_mem_free_mb, reading.gpu_mem_total_mb) == (
        37.0, 6000.0, 24576.0)
    assert reading.temps_c["nvml_gpu"] == 61.0 and reading.total_power_mw is None
    assert reading.power_limit_mw == 700_000.0


class FakeJtop:
    """The shape of jetson-stats 4.x properties (memory in kB, power in mW)."""

    answers = 2

    def __init__(self, interval: float = 1.0) -> None:
        self.interval = interval
        self.closed = False
        self.memory = {"RAM": {"tot": 64348096, "used": 18644992},
                       "SWAP": {"tot": 32174080, "used": 88064},
                       "EMC": {"online": True, "val": 3}}
        self.gpu = {"gpu": {"status": {"load": 41.5}}}
        self.temperature = {"cpu": {"online": True, "temp": 52.5},
                            "cv0": {"online": False, "temp": -256},
                            "PMIC": {"online": True, "temp": 100}}
        self.power = {"rail": {"VDD_GPU_SOC": {"power": 2412}, "VDD_CPU_CV": {"power": 1607}},
                      "tot": {"power": 8726}}

    def start(self) -> None:
        pass

    def ok(self) -> bool:
        FakeJtop.answers -= 1
        return FakeJtop.answers >= 0

    def close(self) -> None:
        self.closed = True


def test_reading_from_jtop_maps_units():
    r = reading_from_jtop(FakeJtop(), t=1.0)
    assert r.unified_memory and r.source == "jtop"
    assert r.ram_total_mb == 64348096 / 1024 and r.ram_used_mb == 18644992 / 1024
    assert r.mem_available_mb == (64348096 - 18644992) / 1024
    assert (r.gpu_util_pct, r.emc_util_pct, r.total_power_mw) == (41.5, 3.0, 8726.0)
    assert r.temps_c == {"cpu": 52.5}  # offline and placeholder sensors dropped


def test_jtop_source_yields_until_the_service_stops(monkeypatch):
    module = types.ModuleType("jtop")
    module.jtop = FakeJtop
    monkeypatch.setitem(sys.modules, "jtop", module)
    FakeJtop.answers = 2

    async def run():
        got = []
        with pytest.raises(TelemetryUnavailable, match="stopped"):
            async for reading in JtopSource(interval_s=0.01):
                got.append(reading)
        return got

    assert len(asyncio.run(run())) == 2


def test_jtop_missing_is_reported(monkeypatch):
    monkeypatch.setitem(sys.modules, "jtop", None)  # import fails
    with pytest.raises(TelemetryUnavailable, match="not installed"):
        asyncio.run(take(JtopSource(), 1))


def test_select_source_by_config(monkeypatch):
    assert isinstance(select_source(TelemetryConfig(source="psutil")), PsutilSource)
    assert isinstance(select_source(TelemetryConfig(source="tegrastats")), TegrastatsSource)
    replay = select_source(TelemetryConfig(replay_file=str(SQUEEZE_TRACE), replay_speed=8))
    assert isinstance(replay, ReplaySource) and replay.speed == 8
    with pytest.raises(ValueError):
        select_source(TelemetryConfig(source="nvidia-smi"))
    with pytest.raises(ValueError):
        select_source(TelemetryConfig(source="replay"))


def test_auto_selection_by_platform(monkeypatch):
    monkeypatch.setattr("edge_runtime.telemetry.sources.is_jetson", lambda: True)
    monkeypatch.setattr("edge_runtime.telemetry.sources.jtop_available", lambda: False)
    assert TelemetryConfig().resolved_source() == "tegrastats"
    monkeypatch.setattr("edge_runtime.telemetry.sources.jtop_available", lambda: True)
    assert TelemetryConfig().resolved_source() == "jtop"
    monkeypatch.setattr("edge_runtime.telemetry.sources.is_jetson", lambda: False)
    monkeypatch.setattr("edge_runtime.telemetry.sources.shutil.which", lambda name: None)
    assert TelemetryConfig().resolved_source() == "psutil"
    assert TelemetryConfig(source="psutil", replay_file="x").resolved_source() == "psutil"


def test_replay_budgeter_ignores_this_machines_meminfo():
    assert select_budgeter(TelemetryConfig(replay_file=str(SQUEEZE_TRACE))).meminfo_path is None
    live = select_budgeter(TelemetryConfig(source="psutil", memory_reserve_mb=512))
    assert live.meminfo_path == "/proc/meminfo" and live.reserve_mb == 512
    assert telemetry_config.SOURCES[0] == "auto"
