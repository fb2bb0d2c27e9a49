"""engine.keep_alive against a real `maced`: an idle daemon gives its model back (status says so,
resident memory falls by most of the weights), keeps answering health, status, adapter listings
and feedback writes without reloading, loads the model again for the next generate (same greedy
tokens, reload time shown), answers every request sent while unloaded, keeps the model while a
fine-tune is in progress, and never unloads with keep_alive = -1."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from tests.daemon.conftest import wait_for


def keep_args(seconds: float, *extra: str) -> list[str]:
    # Admission reads queue lengths only: on a shared test machine, its memory headroom must not
    # turn an idle unload into a pressure unload (test_keep_alive_thread.py tests pressure).
    return ["--set", f"engine.keep_alive={seconds:g}", "--set", "admission.telemetry=false", *extra]


def greedy(c, prompt: str = "Tell me about the sea") -> list[int]:
    """The greedy answer's token ids (read from its log-probs)."""
    result = c.generate(prompt, max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1)
    return [entry["token_id"] for entry in result.candidates[0].logprobs]


def residency(c) -> dict:
    return c.status()["keep_alive"]


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random model whose weights (about 120 MiB in float32) dwarf the process's own memory,
    so their going away shows in the resident size."""
    from edge_runtime.model.testing import make_tiny_model_dir

    return make_tiny_model_dir(tmp_path_factory.mktemp("wide") / "wide", hidden_size=512, num_layers=8,
                               num_heads=8, num_kv_heads=4, intermediate_size=2048)


def test_idle_daemon_unloads_keeps_answering_and_reloads_with_the_same_tokens(start_daemon) -> None:
    d = start_daemon(extra_args=keep_args(1, "--set", "finetune.enabled=false"))
    with d.client() as c:
        before = greedy(c)
        assert residency(c)["state"] == "loaded"
        keep = wait_for(lambda: (k := residency(c))["state"] == "unloaded" and k, timeout_s=30)
        assert keep["unloads"] == 1 and keep["reloads"] == 0 and "idle" in keep["last_unload_reason"]
        assert not keep["released_engine_referenced"]
        # What needs no model is answered without loading it.
        health = c.health()
        assert health["ok"] and health["model_state"] == "unloaded"
        c.consent("ivy")
        assert c.adapters("ivy") == [] and c.adapters() == []
        status = c.status()
        assert status["keep_alive"]["reloads"] == 0 and status["keep_alive"]["state"] == "unloaded"
        assert status["memory"]["ledger"]["weights"] == 0 and status["model"]["model"]
        # The next generate loads it again and answers as before.
        assert greedy(c) == before
        keep = residency(c)
        assert keep["reloads"] == 1 and keep["last_reload_s"] > 0


def test_every_request_sent_while_unloaded_is_answered(start_daemon) -> None:
    d = start_daemon(extra_args=keep_args(0.5, "--set", "finetune.enabled=false"))
    with d.client() as c:
        expected = greedy(c)
        wait_for(lambda: residency(c)["state"] == "unloaded", timeout_s=30)
    answers: list[object] = []
    barrier = threading.Barrier(6)

    def one() -> None:
        with d.client() as c:
            barrier.wait()
            try:
                answers.append(greedy(c))
            except Exception as exc:  # recorded: the assertion below names it
                answers.append(exc)

    workers = [threading.Thread(target=one) for _ in range(6)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(120)
    assert answers == [expected] * 6
    with d.client() as c:
        keep = residency(c)
        assert keep["reloads"] >= 1 and keep["reload_failures"] == 0


def test_resident_memory_falls_by_most_of_the_weights(start_daemon, wide_model: Path) -> None:
    d = start_daemon(model=wide_model, extra_args=keep_args(1, "--set", "finetune.enabled=false"))
    with d.client() as c:
        greedy(c)
        status = c.status()
        weights = status["model"]["weights_bytes"]
        loaded_rss = status["memory"]["process_rss_bytes"]
        assert weights > 100 << 20
        wait_for(lambda: residency(c)["state"] == "unloaded", timeout_s=30)
        unloaded_rss = c.status()["memory"]["process_rss_bytes"]
        assert unloaded_rss < loaded_rss - 0.6 * weights, (loaded_rss, unloaded_rss, weights)
        greedy(c)
        assert c.status()["memory"]["process_rss_bytes"] > unloaded_rss + 0.6 * weights


def test_a_fine_tune_in_progress_holds_the_model(start_daemon) -> None:
    d = start_daemon(extra_args=keep_args(0, "--set", "finetune.pairs_per_version=2",
                                          "--set", "feedback.heldout_fraction=0.0"))
    with d.client() as c:
        c.consent("gina")
        for prompt in ("Say hi", "Say bye"):
            r = c.generate(prompt, max_tokens=6, n=2, temperature=1.0, seed=3, user="gina")
            c.choose("gina", r.interaction_id, 1)
        seen = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            s = c.status()
            seen.append((s["finetune"]["state"], s["keep_alive"]["state"]))
            if s["finetune"]["versions_published"] and s["keep_alive"]["state"] == "unloaded":
                break
            time.sleep(0.05)
        else:
            raise AssertionError(f"no version published and unloaded: {seen[-5:]}")
        # Training and publishing never ran with the model gone; once published, it went.
        assert not [pair for pair in seen if pair[0] in ("training", "publishing") and pair[1] != "loaded"]
        # The tiny model trains a pair in a few iterations, so on a loaded machine its training and
        # publishing states can fall between two polls; the hold itself is the thread test's
        # (test_keep_alive_thread.py). What must hold here: the pairs trained, and a version came out.
        assert s["finetune"]["pairs_trained"] >= 2
        served = c.generate("Say hi", max_tokens=3, user="gina")  # reloads, with the new adapter
        assert served.adapter == "gina@1"


def test_negative_keep_alive_never_unloads(start_daemon) -> None:
    d = start_daemon(extra_args=keep_args(-1, "--set", "finetune.enabled=false"))
    with d.client() as c:
        greedy(c)
        time.sleep(2.0)
        keep = residency(c)
        assert keep["state"] == "loaded" and keep["unloads"] == 0 and keep["keep_alive_s"] == -1
