"""tools/bench_coserve.py's memory-pressure scenario, as a smoke run on the tiny model: pruning off
and on (kv_prune_when = "pressure") replay one trace against a KV cache below the streams' need."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.tool_modules import load_tool


@pytest.mark.slow  # ~30 s: the tool calibrates its cost models and measures unloaded figures first
def test_memory_pressure_scenario_compares_pruning_off_and_on_over_one_trace(tiny_model_dir: Path,
                                                                              tmp_path: Path) -> None:
    load_tool("bench_coserve").main([
        "--scenario", "memory-pressure", "--model", str(tiny_model_dir), "--quiet-wait", "0",
        "--pressure-runs", "off,mace", "--pressure-streams", "3", "--pressure-tokens", "40",
        "--pressure-span", "0", "--prune-capacity", "8", "--kv-fraction", "0.5",
        "--out", str(tmp_path / "pressure")])
    data = json.loads((tmp_path / "pressure.json").read_text())
    assert data["kv_blocks"] < data["full_kv_blocks"]
    off, mace = data["runs"]
    assert (off["pruning"], mace["pruning"]) == ("off", "mace")
    for run in (off, mace):
        assert run["requests"] == 3 and run["tokens_per_s"] > 0
        assert run["kv_blocks_total"] == data["kv_blocks"] and 0 < run["peak_kv_blocks"] <= data["kv_blocks"]
    assert off["kv_prune_turned_on"] == 0 and off["preemptions"] >= 1  # the budget is short
    assert mace["kv_prune_turned_on"] >= 1
    assert data["bar"][0].startswith("mace vs off") and (tmp_path / "pressure.md").is_file()
