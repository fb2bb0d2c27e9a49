"""tools/gpu_check.py (the prepared GPU check, issue #33): its pieces on made-up figures, and the
whole check in smoke mode on the CPU (every step at the tiny shape), so the one device run
cannot fail for a reason a CPU would have shown."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.tool_modules import TOOLS, load_tool

gpu_check = load_tool("gpu_check")
report = load_tool("gpu_check_report")
decode = load_tool("bench_gpu_decode")


def test_gpu_slug_names_the_chip() -> None:
    assert gpu_check.gpu_slug("NVIDIA H100 80GB HBM3") == "h100"
    assert gpu_check.gpu_slug("NVIDIA H200") == "h200"
    assert gpu_check.gpu_slug("Orin (nvgpu)") == "orin_nvgpu"
    assert gpu_check.gpu_slug(None) == "cpu"


def test_junit_counts_reads_pytest_s_file(tmp_path: Path) -> None:
    path = tmp_path / "j.xml"
    path.write_text('<testsuites><testsuite tests="5" failures="1" errors="0" skipped="2"/></testsuites>')
    assert gpu_check.junit_counts(path) == {"tests": 5, "failures": 1, "errors": 0, "skipped": 2, "passed": 2}
    assert gpu_check.junit_counts(tmp_path / "missing.xml") == {}


def _out(tokens: list[int], logprobs: list[float], top2: list[tuple[float, float]]) -> SimpleNamespace:
    lps = [SimpleNamespace(logprob=lp, top=[(t, a, b""), (t + 1, b, b"")]) for t, lp, (a, b) in zip(tokens, logprobs, top2, strict=True)]
    return SimpleNamespace(token_ids=tokens, candidates=[SimpleNamespace(logprobs=lps)])


def test_compare_reports_where_streams_part_and_the_margin_there() -> None:
    top = [(-1.0, -1.5)] * 3
    same = decode.compare([_out([1, 2, 3], [-1.0, -1.0, -1.0], top)], [_out([1, 2, 3], [-1.0, -1.25, -1.0], top)])
    assert same["identical"] and same["max_abs_logprob_diff"] == 0.25 and same["first_divergence"] == [None]
    parted = decode.compare([_out([1, 9, 3], [-1.0, -1.0, -1.0], top)], [_out([1, 2, 3], [-1.0, -2.0, -1.0], top)])
    # the log-probs after the split are of different tokens: only those before it count
    assert not parted["identical"] and parted["first_divergence"] == [1] and parted["max_abs_logprob_diff"] == 0.0
    assert parted["eager_top2_margin_at_divergence"] == [0.5]


def test_weight_bytes_per_token_counts_every_matrix_once_and_the_tied_head(tiny_model_dir: Path) -> None:
    from edge_runtime.model.weights import load_llama

    model = load_llama(tiny_model_dir)
    total = sum(t.numel() * t.element_size() for n, t in [*model.named_parameters(), *model.named_buffers()]
                if not n.startswith("ropes."))
    assert model.lm_head is None  # the tiny model ties its head: the embedding is read whole
    assert decode.weight_bytes_per_token(model) == total
    model.lm_head = model.embed  # a shared tensor is read once
    assert decode.weight_bytes_per_token(model) == total


def test_bar_lines_judge_the_issue_s_bar_from_the_figures() -> None:
    result = {
        "parity": {"cuda_graphs_setting": True, "rows": [{"model": "m", "8 streams": {"identical": True},
                                                          "1 stream": {"identical": True},
                                                          "graphs_on_stats_plain": {"replayed": 40}}]},
        "tests": {"counts": {"tests": 3, "failures": 0, "errors": 0, "skipped": 0, "passed": 3}},
        "bench": {"streams": 16, "rows": [
            {"model": "smollm2-135m bf16", "runtime": "ours", "1": {"decode_tok_s": 400.0}},
            {"model": "llama-3.2-1b q4_k_m", "runtime": "ours", "1": {"decode_tok_s": 900.0},
             "roofline_tok_s": 3000.0, "roofline_pct_1": 30.0},
            {"model": "llama-3.2-1b bf16", "runtime": "transformers generate, static cache, torch.compile",
             "1": {"decode_tok_s": 800.0}}]},
        "train": {"rows": [{"model": "llama-3.2-1b bf16", "seconds": 1.0, "measured_over_predicted": 1.05,
                            "measured_pair_peak_mib": 105, "predicted_pair_peak_mib": 100}]},
    }
    lines = report.bar_lines(result)
    assert lines[0].startswith("PASS greedy") and lines[1].startswith("PASS CUDA tests")
    assert lines[2].startswith("PASS default shape") and lines[3].startswith("PASS 1B, 1 stream: ours 900.0")
    assert lines[4].startswith("FAIL 1B 4-bit") and lines[5].startswith("PASS DPO pair")
    result["parity"]["rows"][0]["graphs_on_stats_plain"] = {"replayed": 0, "eager": {"cpu": 40}}
    assert report.bar_lines(result)[0].startswith("n/a ") and "replayed on 0 of them" in report.bar_lines(result)[0]
    result["parity"]["cuda_graphs_setting"] = False
    assert report.bar_lines(result)[0].startswith("n/a")


def test_the_gpu_tests_are_found_by_their_marker() -> None:
    files = gpu_check.gpu_test_files()
    assert all(f.startswith("tests/") for f in files)
    assert "tests/backends/test_tensorrt.py" in files  # marks its tests gpu


@pytest.mark.slow
def test_smoke_run_goes_through_every_step_on_the_cpu(tmp_path: Path) -> None:
    """The device run's code paths at the tiny shape: every step ok, every result written."""
    env = {**os.environ, "PYTHONPATH": str(TOOLS.parent), "MACE_CACHE_DIR": str(tmp_path / "cache"),
           "MACE_STATE_DIR": str(tmp_path / "state")}
    proc = subprocess.run([sys.executable, str(TOOLS / "gpu_check.py"), "--device", "cpu", "--smoke", "--work",
                           str(tmp_path / "work"), "--out", str(tmp_path / "out"), "--budget", "280"],
                          capture_output=True, text=True, timeout=300, env=env)
    log = (tmp_path / "work" / "gpu_check_log.txt").read_text() if (tmp_path / "work" / "gpu_check_log.txt").exists() else ""
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + log[-3000:]
    result = json.loads((tmp_path / "out" / "bench_gpu_smoke_cpu.json").read_text())
    assert {k: v["status"] for k, v in result["status"]["steps"].items()} == dict.fromkeys(gpu_check.STEPS, "ok"), log[-3000:]
    assert all(m.get("path") for m in result["models"]["models"])
    assert all(r["8 streams"]["identical"] for r in result["parity"]["rows"]), result["parity"]
    ours = [r for r in result["bench"]["rows"] if r["runtime"] == "ours"]
    assert len(ours) == 2 and all(r["1"]["decode_tok_s"] > 0 and r["4"]["decode_tok_s"] > 0 for r in ours), ours
    assert any("transformers" in r["runtime"] and r["1"]["decode_tok_s"] > 0 for r in result["bench"]["rows"])
    assert [r["error"] for r in result["train"]["rows"]] == [None, None]
    assert (tmp_path / "out" / "bench_gpu_smoke_cpu.md").exists() and (tmp_path / "out" / "gpu_check_log.txt").exists()
    assert "== GPU check summary ==" in proc.stdout and "-- bar --" in proc.stdout


def test_the_default_model_s_shape_matches_its_config_carried_in_tools_data() -> None:
    make_gguf = load_tool("make_gguf")
    config = json.loads((TOOLS / "data" / "smollm2-135m" / "config.json").read_text())
    shape = make_gguf.SHAPES["smollm2-135m"]
    assert (shape.hidden_size, shape.num_layers, shape.num_heads, shape.num_kv_heads, shape.head_dim,
            shape.intermediate_size, shape.vocab_size, shape.tie_word_embeddings) == (
        config["hidden_size"], config["num_hidden_layers"], config["num_attention_heads"],
        config["num_key_value_heads"], config["head_dim"], config["intermediate_size"], config["vocab_size"],
        config["tie_word_embeddings"])
    assert shape.rope_parameters["rope_theta"] == config["rope_parameters"]["rope_theta"]
    types = {t.name: t.qtype for t in make_gguf.tensor_plan(shape, make_gguf.MIXES["q4_k_m"])}
    # 576-wide rows cannot hold 256-wide super-blocks: llama.cpp's 32-wide fallbacks
    assert types["token_embd.weight"] == "Q8_0" and types["blk.2.attn_q.weight"] == "Q5_0"
    assert types["blk.4.ffn_down.weight"] == "Q4_K"  # 1536-wide rows keep Q4_K
    assert [m["name"] for m in gpu_check.model_plan(smoke=False)] == [
        "smollm2-135m bf16", "smollm2-135m q4_k_m", "llama-3.2-1b bf16", "llama-3.2-1b q4_k_m"]
