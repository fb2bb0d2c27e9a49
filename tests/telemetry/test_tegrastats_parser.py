"""The tegrastats parser on real captured lines from every Jetson generation, and on mutations."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from telemetry_fixtures import load_jsonl

from edge_runtime.telemetry.tegrastats import parse_line

REAL = load_jsonl("tegrastats_lines.jsonl")
SYNTHETIC = load_jsonl("synthetic_edge_cases.jsonl")
REQUIRED_KEYS = {"ram_used_mb", "ram_total_mb", "swap_used_mb", "swap_total_mb", "cpu_util_pct",
                 "gpu_util_pct", "temps_c", "power_mw"}


def line_with(prefix: str) -> str:
    """The one real fixture line starting with (or containing) `prefix`."""
    hits = [e["line"] for e in REAL if prefix in e["line"]]
    assert len(hits) == 1, f"{len(hits)} fixture lines match {prefix!r}"
    return hits[0]


def test_fixtures_are_real_lines_from_enough_devices():
    kinds = Counter(e["device_kind"] for e in REAL)
    assert len(REAL) >= 20
    assert len(kinds) >= 5
    assert all(e["source"] and e["device"] for e in REAL)
    assert len({e["line"] for e in REAL}) == len(REAL)


@pytest.mark.parametrize("entry", REAL, ids=[f"{i}-{e['device_kind']}" for i, e in enumerate(REAL)])
def test_every_real_line_parses_to_sane_numbers(entry):
    sample = parse_line(entry["line"])
    assert sample.extras == {}, "a real token was not understood"
    assert 0 < sample.ram_used_mb <= sample.ram_total_mb
    assert sample.cpu_util_pct and len(sample.cpu_util_pct) == len(sample.cpu_freq_mhz)
    assert all(u is None or 0 <= u <= 100 for u in sample.cpu_util_pct)
    assert sample.gpu_util_pct is None or 0 <= sample.gpu_util_pct <= 100
    assert all(0 < t < 130 for t in sample.temps_c.values())
    assert all(mw >= 0 for mw in sample.power_mw.values())
    out = json.loads(json.dumps(sample.to_dict()))
    assert REQUIRED_KEYS <= out.keys()
    assert out["ram_used_mb"] == sample.ram_used_mb


def test_tx1_l4t28_old_field_names():
    s = parse_line(line_with("RAM 3691/3983MB"))
    assert (s.ram_used_mb, s.ram_total_mb, s.lfb_blocks, s.lfb_block_mb) == (3691, 3983, 3, 2.0)
    assert (s.swap_used_mb, s.swap_total_mb, s.swap_cached_mb) == (2780, 8192, 284)
    assert s.cpu_util_pct == [1.0, 0.0, 4.0, 0.0]
    assert s.cpu_freq_mhz == [1734] * 4  # one frequency after the bracket
    assert (s.emc_util_pct, s.emc_freq_mhz) == (0.0, 1600)
    assert (s.gpu_util_pct, s.gpu_freq_mhz) == (0.0, [998])
    assert s.temps_c == {} and s.power_mw == {}
    assert s.to_dict()["temps_c"] is None  # absent, not empty


def test_nano_pom_rails_without_units_and_iram():
    s = parse_line(line_with("RAM 1923/3964MB"))
    assert s.power_mw == {"POM_5V_IN": 1750, "POM_5V_GPU": 0, "POM_5V_CPU": 366}
    assert s.power_avg_mw["POM_5V_IN"] == 1628
    assert s.total_power_mw() == 1750
    assert (s.iram_used_kb, s.iram_total_kb, s.iram_lfb_kb) == (0, 252, 252)
    assert s.engines["APE"].freq_mhz == [25]


def test_off_cores_are_none_not_zero():
    s = parse_line(line_with("CPU [2%@345,off,off,off,off,off]"))
    assert s.cpu_util_pct == [2.0, None, None, None, None, None]
    assert s.cpu_freq_mhz == [345, None, None, None, None, None]


def test_agx_xavier_jetpack4_rails_named_like_fields():
    s = parse_line(line_with("RAM 14700/15692MB"))
    assert s.power_mw == {"GPU": 463, "CPU": 618, "SOC": 2936, "CV": 0, "VDDRQ": 309,
                          "SYS5V": 3306}
    assert len(s.cpu_util_pct) == 8
    assert s.temps_c["PMIC"] == 100.0
    assert s.max_temp_c() == 32.0  # PMIC@100C is a placeholder, not the hottest sensor


def test_agx_orin_absent_sensors_and_second_gpc():
    s = parse_line(line_with("RAM 1282/62795MB"))
    assert s.absent_temp_sensors == ["CV0", "CV1", "GPU", "CV2"]
    assert "GPU" not in s.temps_c
    assert s.engines["GR3D2"].util_pct == 0.0
    assert s.gpu_freq_mhz == [0, 0]
    assert s.power_mw["NC"] == 0 and s.power_mw["NC#2"] == 0
    assert s.total_power_mw() == 2399 + 400 + 4032 + 301  # rails, NC excluded
    assert s.timestamp == "04-24-2023 00:01:24"


def test_orin_jetpack6_engines_and_per_gpc_clock():
    s = parse_line(line_with("05-09-2026 18:42:06"))
    assert (s.gpu_util_pct, s.gpu_freq_mhz) == (0.0, [0, 0])
    assert s.engines["NVENC"].util_pct == 79.0 and s.engines["NVENC"].freq_mhz == [166]
    assert s.engines["NVDEC"].on is False
    assert s.engines["PVA0"].on is False
    assert s.power_mw == {"VDD_GPU_SOC": 2412, "VDD_CPU_CV": 1607, "VIN_SYS_5V0": 4707}
    assert s.max_temp_c() == 52.562


def test_xavier_nx_jetpack5_mw_rails():
    s = parse_line(line_with("07-09-2024 13:31:31"))
    assert s.power_mw["VDD_IN"] == 2763 and s.power_avg_mw["VDD_IN"] == 2846
    assert s.total_power_mw() == 2763
    assert s.gpu_freq_mhz == [114]
    assert s.engines["VIC"].freq_mhz == [115]


def test_orin_nano_busy_gpu_bracket_form():
    s = parse_line(line_with("RAM 6185/7620MB"))
    assert (s.gpu_util_pct, s.gpu_freq_mhz) == (63.0, [621])
    assert s.emc_util_pct == 43.0


def test_thor_prints_no_gpu_utilisation():
    s = parse_line(line_with("05-17-2026 10:00:32"))
    assert s.gpu_util_pct is None  # not 0: Thor does not report it
    assert s.gpu_freq_mhz == [0, 0, 0]
    assert s.engines["NVENC0"].freq_mhz == [0] and s.engines["NVENC0"].util_pct is None
    assert s.to_dict()["gpu_util_pct"] is None


def test_r39_temperature_pairs_and_power_triples():
    s = parse_line(line_with("07-23-2026 15:29:27"))
    assert s.temps_c["cpu"] == 34.312 and s.temps_max_c["cpu"] == 34.843
    assert s.power_mw["VDD_CPU_SOC_MSS"] == 7953
    assert s.power_avg_mw["VDD_CPU_SOC_MSS"] == 8332
    assert s.power_max_mw["VDD_CPU_SOC_MSS"] == 8710
    assert s.gpu_freq_mhz == [314, 314, 314] and s.gpu_util_pct is None


def test_r39_orin_nano_reports_gpu_load():
    s = parse_line(line_with("09-04-2026 19:40:47"))
    assert s.gpu_util_pct == 12.0
    assert s.power_mw["VDD_IN"] == 4093 and s.power_max_mw["VDD_IN"] == 4832
    assert s.swap_used_mb is None  # this board had no swap line at all


def test_tx2_mts_fields():
    s = parse_line(line_with("RAM 3276/7859MB"))
    assert (s.mts_fg_pct, s.mts_bg_pct) == (1.0, 1.0)


def test_timestamp_to_seconds():
    a = parse_line(line_with("05-09-2026 18:42:06")).timestamp_s()
    b = parse_line(line_with("05-09-2026 18:42:08")).timestamp_s()
    assert b - a == 2.0


@pytest.mark.parametrize("case", SYNTHETIC, ids=[c["why"][:40] for c in SYNTHETIC])
def test_synthetic_edge_cases(case):
    out = parse_line(case["line"]).to_dict()
    for key, expected in case["expect"].items():
        assert out[key] == expected, key


def test_round_trip_through_json():
    for entry in REAL:
        sample = parse_line(entry["line"])
        again = type(sample).from_dict(json.loads(json.dumps(sample.to_dict())))
        assert again == sample


def _mutate(line: str, ops: list[tuple[int, int, str, int]]) -> str:
    for kind, pos, text, length in ops:
        pos = pos % (len(line) + 1)
        if kind == 0:  # insert
            line = line[:pos] + text + line[pos:]
        elif kind == 1:  # delete a span
            line = line[:pos] + line[pos + length:]
        elif kind == 2:  # overwrite
            line = line[:pos] + text + line[pos + len(text):]
        elif kind == 3:  # truncate
            line = line[:pos]
        else:  # duplicate a span
            line = line[:pos] + line[pos:pos + length] + line[pos:]
    return line


FIELD_NOISE = st.sampled_from(["%", "@", "[", "]", "/", "C", "mW", "off", " ", ",", "(", ")",
                               "-256", "MB", "kB", "x", "9" * 30, "@[", "%@", "\t", "\x00", "é"])


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    entry=st.sampled_from(REAL),
    ops=st.lists(
        st.tuples(st.integers(0, 4), st.integers(0, 2000),
                  st.one_of(FIELD_NOISE, st.text(max_size=12)), st.integers(0, 40)),
        min_size=1, max_size=6,
    ),
)
def test_mutated_real_lines_never_raise(entry, ops):
    sample = parse_line(_mutate(entry["line"], ops))
    json.dumps(sample.to_dict())  # and the result is always serialisable
    sample.max_temp_c()
    sample.total_power_mw()
    sample.timestamp_s()


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=300))
def test_arbitrary_text_never_raises(text):
    json.dumps(parse_line(text).to_dict())
