"""tools/bench_e2e.py's pure helpers (no server, no llama-cpp-python)."""

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "bench_e2e", Path(__file__).resolve().parents[1] / "tools" / "bench_e2e.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_percentile_nearest_rank():
    assert bench.percentile([], 0.5) is None
    assert bench.percentile([3.0], 0.99) == 3.0
    values = [float(x) for x in range(1, 102)]  # 1..101, unsorted order must not matter
    assert bench.percentile(list(reversed(values)), 0.5) == 51.0
    assert bench.percentile(values, 0.99) == 100.0
    assert bench.percentile(values, 1.0) == 101.0


def test_ratio_and_summary():
    assert bench.ratio(3.0, 2.0) == 1.5
    assert bench.ratio(None, 2.0) is None and bench.ratio(1.0, 0) is None
    s = bench.summarise([{"ttft_s": 0.1, "latency_s": 1.0, "tokens": 128},
                         {"ttft_s": 0.3, "latency_s": 1.0, "tokens": 64}], wall_s=2.0)
    assert s["tokens_per_s"] == 96.0 and s["tokens_per_request"] == 96.0
    assert s["ttft_p50_ms"] == pytest.approx(100.0)  # nearest rank: round(0.5) == 0


def _level(maced_toks, llama_toks, maced_ttft=100.0, llama_ttft=200.0):
    return {"maced": {"tokens_per_s": maced_toks, "ttft_p50_ms": maced_ttft},
            "llama": {"tokens_per_s": llama_toks, "ttft_p50_ms": llama_ttft}}


def test_bar_met_and_not_met():
    levels = {1: _level(110, 100), 8: _level(300, 100), 32: _level(150, 100)}
    bar = bench.evaluate_bar(levels, {"maced": 9.5, "llama": 1.0})
    met = {b["item"]: b["met"] for b in bar}
    assert met["tok/s at 1 client >= 1x llama-server"] is True
    assert met["tok/s at 8 clients >= 2x llama-server"] is True
    assert met["tok/s at 32 clients >= 2x llama-server"] is False
    assert met["TTFT p50 at 1 client <= llama-server's"] is True
    assert met["maced time to ready <= 15 s"] is True
    bar = bench.evaluate_bar({1: _level(90, 100, 300.0, 200.0)}, {"maced": 20.0})
    met = {b["item"]: b["met"] for b in bar}
    assert met["tok/s at 1 client >= 1x llama-server"] is False
    assert met["tok/s at 8 clients >= 2x llama-server"] is None  # level not run
    assert met["TTFT p50 at 1 client <= llama-server's"] is False
    assert met["maced time to ready <= 15 s"] is False


def test_trees_table_names_each_run_and_the_ratio_to_the_first_tree():
    lv = lambda t: {"tokens_per_s": t}  # noqa: E731
    result = {"meta": {"command": "c", "machine": "m", "date": "d", "max_tokens": 8, "per_client": {1: 1},
                       "trees": {"before": "/a", "after": "/b"}},
              "runs": [{"tree": "before", "round": 1, "loadavg_start": "1", "ready_s": 5.0, "levels": {"1": lv(10.0)}},
                       {"tree": "after", "round": 1, "loadavg_start": "1", "ready_s": 5.0, "levels": {"1": lv(9.0)}}],
              "tokens_per_s": {"1": {"before": {"mean": 10.0, "runs": [10.0], "vs_before": 1.0},
                                     "after": {"mean": 9.0, "runs": [9.0], "vs_before": 0.9}}}}
    text = bench.render_trees(result)
    assert "| 1 | after | 1 | 5.0 | 9.0 |" in text and "| 1 | after | 9.0 (9.0) | 0.9x |" in text
