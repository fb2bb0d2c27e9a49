"""`python -m edge_runtime.telemetry parse|watch`: a tegrastats log in, JSON lines out."""

from __future__ import annotations

import json
import subprocess
import sys

from telemetry_fixtures import SQUEEZE_TRACE, load_jsonl

from edge_runtime.telemetry.__main__ import main

REAL = load_jsonl("tegrastats_lines.jsonl")
REQUIRED = {"ram_used_mb", "ram_total_mb", "swap_used_mb", "swap_total_mb", "cpu_util_pct",
            "gpu_util_pct", "temps_c", "power_mw"}


def test_parse_reads_stdin_and_writes_one_json_object_per_line():
    log = "\n".join(e["line"] for e in REAL) + "\n\n"
    done = subprocess.run([sys.executable, "-m", "edge_runtime.telemetry", "parse"], input=log,
                          capture_output=True, text=True, timeout=60, check=True)
    records = [json.loads(x) for x in done.stdout.splitlines()]
    assert len(records) == len(REAL)  # the blank line is skipped
    assert all(REQUIRED <= r.keys() for r in records)
    thor = next(r for r, e in zip(records, REAL, strict=True) if "@[0,0,0]" in e["line"])
    assert thor["gpu_util_pct"] is None and thor["ram_total_mb"] == 125773
    tx1 = records[0]
    assert tx1["temps_c"] is None and tx1["power_mw"] is None  # absent fields are null
    off = next(r for r in records if r["cpu_util_pct"] and None in r["cpu_util_pct"])
    assert off["cpu_util_pct"][0] is not None


def test_parse_reads_files(tmp_path, capsys):
    log = tmp_path / "tegrastats.log"
    log.write_text(next(e["line"] for e in REAL if "POM_5V_IN 1750/1628" in e["line"]) + "\n")
    assert main(["parse", str(log)]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["power_mw"] == {"POM_5V_IN": 1750, "POM_5V_GPU": 0, "POM_5V_CPU": 366}


def test_watch_plays_a_replay_with_the_budget(capsys):
    assert main(["watch", "--replay", str(SQUEEZE_TRACE), "--speed", "0", "--count", "4"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [x["source"] for x in lines] == ["replay"] * 4
    assert "headroom 42586 MiB" in lines[0]["budget"]
    assert "headroom 3793 MiB" in lines[3]["budget"]


def test_telemetry_and_admission_never_import_torch():
    code = ("import sys, edge_runtime.telemetry, edge_runtime.telemetry.__main__, daemon.admission;"
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0
