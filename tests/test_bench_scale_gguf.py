"""tools/bench_scale.py's serving mode at the tiny shape: `maced --model file.gguf` started twice,
serving at 1 and 8 streams and training one DPO pair, measured from /proc; llama-cpp-python's
server on the same file where it is installed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tool_modules import load_tool

bench = load_tool("bench_scale")
make = load_tool("make_gguf")
LLAMA_PYTHON = "/work/llama-venv/bin/python"


def test_tree_status_adds_up_a_process_and_its_children() -> None:
    import os

    alone = bench.tree_status(os.getpid())["VmRSS"]
    child = subprocess.Popen([sys.executable, "-c", "import time; b = bytearray(64 << 20); time.sleep(30)"])
    try:
        for _ in range(100):  # until the child holds its 64 MiB
            if bench.tree_status(child.pid).get("VmRSS", 0) > 64 << 20:
                break
            subprocess.run(["sleep", "0.05"], check=True)
        both = bench.tree_status(os.getpid())
        assert both["VmRSS"] > alone + (60 << 20) and both["VmHWM"] >= both["VmRSS"] * 0.9
    finally:
        child.kill()
        child.wait()


def test_table_shows_both_servers_and_why_one_was_skipped(tmp_path: Path) -> None:
    result = {
        "machine": {"cores": 2, "cpu": "cpu"}, "gguf": "x.gguf", "tensor_mib": 1.0, "gguf_mib": 1.1, "file_type": 15,
        "threads": 2, "loadavg_start": "1 1 1", "loadavg_end": "2 2 2", "tokens": 8, "repeats": 1, "dpo_tokens": 8,
        "date": "now", "command": "c",
        "maced": {"starts": [{"ready_s": 50.0, "peak_rss_mib": 400.0, "log_phases": {"ready_s": 45.0}},
                             {"ready_s": 9.0, "peak_rss_mib": 380.0}],
                  "serving": {"peak_rss_mib": 390.0}, "decode": {"1": {"tok_s": 3.5}, "8": {"tok_s": 11.0}},
                  "dpo_pair": {"stage_s": 3.4, "wall_s": 7.8, "outcome": "published", "peak_rss_mib": 450.0}},
        "llama": {"skipped": "not installed"},
    }
    bench.write_gguf_table(result, tmp_path / "t.md")
    text = (tmp_path / "t.md").read_text()
    assert "| maced | 50.0 | 9.0 | 400.0 | 390.0 | 450.0 | 3.5 | 11.0 | 3.4 / 7.8 (published) |" in text
    assert "| llama | skipped: not installed |" in text and "start 1: ready_s 45.0" in text
    assert "The bar's ratios" not in text  # nothing to compare against


def test_the_bar_ratios_divide_maced_by_llama_and_blocks_by_the_float_copy() -> None:
    result = {"maced": {"dpo_pair": {"peak_rss_mib": 3000.0}, "decode": {"1": {"tok_s": 2.0}, "8": {"tok_s": 9.0}}},
              "llama": {"serving": {"peak_rss_mib": 1500.0}, "decode": {"1": {"tok_s": 4.0}, "8": {"tok_s": 3.0}}},
              "dpo_copies": {"blocks_over_float": 1.6}}
    assert bench.bar_ratios(result) == {"train_peak_over_llama_serving": 2.0, "tok_s_1_over_llama": 0.5,
                                        "tok_s_8_over_llama": 3.0, "dpo_blocks_over_two_copy": 1.6}


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    shape, mix = make.SHAPES["tiny"], make.MIXES["q8_0"]
    return make.write_gguf(shape, mix, tmp_path_factory.mktemp("gguf") / make.file_name(shape, mix))


def _run(tiny_gguf: Path, tmp_path: Path, *extra: str) -> dict:
    out = tmp_path / "bench_scale_gguf.json"
    bench.main(["--gguf", str(tiny_gguf), "--tokens", "4", "--repeats", "1", "--dpo-tokens", "8",
                "--timeout-s", "600", "--out", str(out), *extra])
    assert out.with_suffix(".md").exists()
    return json.loads(out.read_text())


def test_maced_starts_twice_serves_and_trains_one_pair_on_the_tiny_file(tiny_gguf: Path, tmp_path: Path) -> None:
    # No cost calibration (the tool would wait for the background one after each start): the
    # suite's time, on a busy machine, is what the tiny file's test must keep small.
    result = _run(tiny_gguf, tmp_path, "--servers", "maced", "--set", "engine.backend=torch",
                  "--set", "engine.cost_profile=off", "--dpo-copies", "1")
    maced = result["maced"]
    assert "error" not in maced, maced.get("error")
    assert len(maced["starts"]) == 2 and all(s["ready_s"] > 0 and s["peak_rss_mib"] > 100 for s in maced["starts"])
    assert [s["background_calibration_wait_s"] for s in maced["starts"]] == [None, None]
    assert maced["decode"]["1"]["tokens"] == 4 and maced["decode"]["8"]["tokens"] == 32
    pair = maced["dpo_pair"]
    assert pair["outcome"] in ("published", "rejected") and pair["stage_s"] > 0 and pair["peak_rss_mib"] > 100
    assert result["llama"] == {"skipped": "not asked for (--servers)"}
    assert "/" in result["loadavg_start"]  # the whole /proc/loadavg line
    assert [(r["streams"], r["repeat"]) for r in maced["decode_runs"]] == [(1, 0), (8, 0)]
    # The two-copy comparison ran on the block cache maced built, both representations once.
    copies = result["dpo_copies"]
    assert "error" not in copies, copies
    assert len(copies["runs"]["blocks"]) == len(copies["runs"]["float"]) == 1
    assert copies["blocks_over_float"] > 0 and result["bar"]["dpo_blocks_over_two_copy"] == copies["blocks_over_float"]
    assert result["bar"]["tok_s_1_over_llama"] is None  # no llama column: no ratio


def _llama_missing() -> str | None:
    if not Path(LLAMA_PYTHON).exists():
        return f"llama-cpp-python[server] is not installed at {LLAMA_PYTHON} (a source build; see the report)"
    ok = subprocess.run([LLAMA_PYTHON, "-c", "import llama_cpp.server"], capture_output=True).returncode == 0
    return None if ok else f"{LLAMA_PYTHON} cannot import llama_cpp.server"


@pytest.mark.skipif(_llama_missing() is not None, reason=str(_llama_missing()))
def test_llama_server_serves_the_tiny_file(tiny_gguf: Path, tmp_path: Path) -> None:
    llama = _run(tiny_gguf, tmp_path, "--servers", "llama", "--llama-python", LLAMA_PYTHON)["llama"]
    assert "error" not in llama, llama.get("log_tail")
    assert llama["starts"][0]["ready_s"] > 0 and llama["decode"]["1"]["tokens"] > 0
    assert llama["serving"]["peak_rss_mib"] > 0


def test_the_wait_for_the_background_calibration_follows_the_daemons_log(tmp_path: Path) -> None:
    class Running:
        def poll(self) -> None:
            return None

    class Fake:
        log, proc = tmp_path / "maced.log", Running()

    Fake.log.write_text("loaded the cached forward cost model\n")
    assert bench.wait_background_calibration(Fake, timeout_s=5) is None  # no calibration to wait for
    Fake.log.write_text("quick forward cost calibration in 1.0 s\n"
                        "calibrated the forward cost model in the background, 2.0 s of forwards\n")
    assert bench.wait_background_calibration(Fake, timeout_s=5) == 0.0
