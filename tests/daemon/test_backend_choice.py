"""The daemon's backend: "auto" by default; `macectl status` (text and --json) and `/metrics`
say which backend serves and why."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from daemon.config import load_config
from tests.daemon.conftest import REPO, free_tcp_port

pytest.importorskip("onnxruntime")


def test_the_daemon_defaults_to_the_auto_backend() -> None:
    config = load_config(None, {}, [])
    assert (config.engine.backend, config.engine.onnx_quantization) == ("auto", "auto")
    explicit = load_config(None, {"MACE_ENGINE_BACKEND": "torch"}, [])
    assert explicit.engine.backend == "torch"


def macectl(endpoint: str, *args: str) -> str:
    run = subprocess.run([sys.executable, "-m", "daemon.sdk.cli", "--endpoint", endpoint, "status", *args],
                         cwd=REPO, capture_output=True, text=True, timeout=60, env=os.environ.copy())
    assert run.returncode == 0, run.stderr
    return run.stdout


def test_status_and_metrics_say_which_backend_and_why(start_daemon, tmp_path: Path) -> None:
    port = free_tcp_port()
    flags = ["--dtype", "float32", "--set", "engine.kv_cache_bytes=8388608", "--set", "engine.num_threads=1",
             "--set", "engine.onnx_quantization=none",  # the tiny model's float graph: exact
             "--set", f"engine.onnx_cache_dir={tmp_path / 'onnx'}", "--set", "engine.cost_profile=off"]
    d = start_daemon(engine_flags=flags, extra_args=["--http", f"127.0.0.1:{port}"])
    model = json.loads(macectl(d.endpoint, "--json"))["model"]
    assert (model["backend"], model["backend_requested"], model["quantization"]) == ("onnxruntime", "auto", "none")
    assert "self-check: greedy tokens equal" in model["backend_reason"]
    text = macectl(d.endpoint)
    assert "onnxruntime on cpu, auto" in text and "backend choice" in text
    with d.client() as c:
        assert c.generate(prompt="Hello", max_tokens=4, temperature=0.0).candidates[0].text is not None
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
        body = response.read().decode()
    info = [s for f in text_string_to_metric_families(body) for s in f.samples if s.name == "mace_backend_info"]
    assert len(info) == 1 and info[0].value == 1.0
    assert (info[0].labels["requested"], info[0].labels["backend"]) == ("auto", "onnxruntime")
    assert "self-check" in info[0].labels["reason"]


def test_the_daemon_answers_before_calibrating_and_calibrates_while_idle(start_daemon) -> None:
    from tests.daemon.conftest import wait_for

    # The daemon's default cost_profile ("background"); an empty state dir: nothing cached.
    d = start_daemon(engine_flags=["--dtype", "float32", "--set", "engine.kv_cache_bytes=8388608",
                                   "--set", "engine.num_threads=1", "--set", "engine.backend=torch"])
    with d.client() as c:
        assert c.generate(prompt="Hello", max_tokens=4, temperature=0.0).candidates
        wait_for(lambda: c.status()["engine"]["cost_model"]["source"] == "calibrated", 120)
    assert list((d.state_dir / "costs").glob("forward-*.json"))
    assert "calibrated the forward cost model in the background" in d.log()


def test_a_daemon_on_the_auto_backend_trains_publishes_and_serves_an_adapter(
        start_daemon, tiny_model: Path, tmp_path: Path) -> None:
    """Training reads the torch weights, serving runs the ONNX graph with the adapter's weights as
    inputs: what the daemon serves for the user is what the torch reference computes with the
    adapter it published."""
    from edge_runtime import Engine, SamplingParams
    from tests.daemon.conftest import wait_for

    flags = ["--dtype", "float32", "--set", "engine.kv_cache_bytes=8388608", "--set", "engine.num_threads=1",
             "--set", "engine.onnx_quantization=none", "--set", f"engine.onnx_cache_dir={tmp_path / 'onnx'}"]
    d = start_daemon(engine_flags=flags, extra_args=["--set", "finetune.pairs_per_version=2",
                                                     "--set", "feedback.heldout_fraction=0.0"])
    with d.client() as c:
        assert c.status()["model"]["backend"] == "onnxruntime"
        c.consent("gina")
        for prompt in ("Say hi", "Say bye"):
            r = c.generate(prompt, max_tokens=6, n=2, temperature=1.0, seed=3, user="gina")
            c.choose("gina", r.interaction_id, 1)
        wait_for(lambda: c.status()["finetune"]["versions_published"] == 1, 120)
        served = c.generate("Say hi", max_tokens=8, temperature=0.0, user="gina")
        assert served.adapter == "gina@1"
    reference = Engine.load(str(tiny_model), dtype="float32", kv_cache_bytes=8 << 20, cost_profile="off",
                            adapters_root=str(d.state_dir / "adapters"))
    reference.add_request("Say hi", SamplingParams(max_tokens=8), adapter="gina")
    finished = []
    while reference.has_unfinished():
        finished += reference.step()
    assert finished[0].adapter == "gina@1"
    assert served.candidates[0].text == finished[0].text
