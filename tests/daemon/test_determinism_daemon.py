"""Greedy is greedy through the daemon (issue #31): a real `maced` on the default model and the
default backend ("auto": ONNX Runtime, q4_1), asked through the SDK at temperature 0, gives each
everyday prompt the same tokens and log-probabilities alone, repeated, in batches of 3 and 16 beside
other users' adapter rows, while a fine-tune job trains and publishes, under CPU load from another
process, with calibration off and with the calibrated costs another machine would have (x4: each of
`off` and `x4` failed on its own before #31's grid; a x0.25 case, which added ~30 s to the suite and
nothing those two do not catch, was run in session 13 and dropped from the suite)."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from daemon.sdk import Client
from tests.daemon.conftest import DaemonProcess, wait_for

pytest.importorskip("onnxruntime")

# Everyday prompts; templated, they are 35-50 tokens long, some one or two rows past a 16-token KV
# block (49, 50): the lengths that left one prompt row to a forward of its own before #31's grid.
PROMPTS = ["What is the capital of Italy?", "How many days are there in a leap year?",
           "Suggest a fun thing to do with my friends on a rainy Saturday afternoon in the city.",
           "How can I keep my houseplants alive while I am away on holiday for two whole weeks?",
           "Explain what a rainbow is in one sentence.",
           "How can I keep my houseplants alive and healthy while I am away on holiday for two weeks?",
           "What is the boiling point of water?", "Name three fruits that are red.",
           "How do I say thank you in Spanish?",
           "Name three rivers in Europe and say where each one meets the sea, in one line each."]
# Other users' rows in the same steps: two users with published adapters, then a third whose
# adapter the daemon trains and publishes during the test.
ADAPTER_USERS = ("alice", "bob")
TRAINEE = "carol"
OTHERS = ["Write a haiku about rivers.", "Tell me a fact about cats.", "Describe a sunny morning.",
          "List two uses of a spoon.", "Suggest a name for a dog.", "What is a good board game?"]
TOKENS = 24  # the flips showed within 8 steps
# The default model and backend; one engine thread as on the report; calibration and the
# scale of its estimates per case below.
FLAGS = ["--set", "engine.num_threads=1", "--set", "finetune.pairs_per_version=2",
         "--set", "feedback.heldout_fraction=0.0"]
COSTS = {"off": ["--set", "engine.cost_profile=off"],  # nominal figures corrected online
         # the daemon's own calibration (quick, then full while idle), scaled as another machine's
         "x4": ["--set", "engine.cost_scale=4"]}
# The first case's answers alone: every other run, in any case, must match them.
_REFERENCE: dict[str, tuple] = {}


def _answer(c: Client, prompt: str, user: str | None = None) -> tuple:
    """(text, each token's id and log-probability, the adapter that served it)."""
    r = c.generate(messages=[{"role": "user", "content": prompt}], max_tokens=TOKENS, temperature=0.0,
                   ignore_eos=True, logprobs=1, user=user, timeout_s=600)
    cand = r.candidates[0]
    return cand.text, tuple((p["token_id"], p["logprob"]) for p in cand.logprobs or ()), r.adapter


def _at_once(d: DaemonProcess, jobs: list[tuple[str, str | None]]) -> list[tuple]:
    """Every (prompt, user) submitted together, one client each, so they share the engine's steps."""
    out: list[tuple | BaseException] = [RuntimeError("no answer")] * len(jobs)
    barrier = threading.Barrier(len(jobs))

    def one(i: int) -> None:
        try:
            with d.client(timeout_s=600) as c:
                barrier.wait(120)
                out[i] = _answer(c, *jobs[i])
        except BaseException as exc:  # reported below, with the others
            out[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(900)
    errors = [o for o in out if isinstance(o, BaseException)]
    assert not errors, errors[:3]
    return out  # type: ignore[return-value]


@pytest.fixture
def cpu_hog() -> Iterator[subprocess.Popen]:
    """A second process keeping a core busy; the test starts and ends it."""
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    yield proc
    proc.kill()
    proc.wait()


def _publish_adapters(state_dir: Path, model_dir: Path) -> None:
    """Adapters of other users, published before the daemon starts (it serves what its adapters
    folder holds)."""
    from edge_runtime.lora import LoraSettings
    from edge_runtime.lora.registry import AdapterRegistry
    from edge_runtime.model.config import ModelConfig
    from tests.backends.helpers import ALL_LINEAR, random_adapter

    cfg = ModelConfig.from_dir(model_dir)
    registry = AdapterRegistry(state_dir / "adapters", cfg)
    for seed, user in enumerate(ADAPTER_USERS, start=1):
        registry.publish(user, random_adapter(cfg, LoraSettings(rank=4, alpha=8, target_modules=ALL_LINEAR), seed))


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("costs", list(COSTS))
def test_greedy_answers_do_not_depend_on_load_batch_training_or_cost_estimates(
        costs: str, tmp_path: Path, default_model_dir: Path, request: pytest.FixtureRequest) -> None:
    root = tmp_path / "d"
    _publish_adapters(root / "state", default_model_dir)
    d = DaemonProcess(root, default_model_dir, engine_flags=[*FLAGS, *COSTS[costs]])
    try:
        d.wait_ready(timeout_s=600)
        runs: dict[str, list[tuple]] = {}
        with d.client(timeout_s=600) as c:
            model = c.status()["model"]
            assert (model["backend"], model["quantization"], model["deterministic"]) == ("onnxruntime", "q4_1", True)
            runs["alone"] = [_answer(c, p) for p in PROMPTS]
        request.getfixturevalue("cpu_hog")
        # A fine-tune job: the trainee's edited answers become preference pairs, trained beside
        # serving; its adapter is published every 2 pairs (guard included).
        with d.client(timeout_s=600) as c:
            c.consent(TRAINEE)
            for i, prompt in enumerate(OTHERS[:4]):
                r = c.generate(prompt, max_tokens=8, ignore_eos=True, user=TRAINEE)
                c.edit(TRAINEE, r.interaction_id, f"A plain, careful answer number {i}.")
            wait_for(lambda: (f := c.status()["finetune"])["state"] != "idle" or f["stages_run"] > 0, 300, 0.05)
            if costs == "off":  # repeated alone (the other cases repeat it on other estimates)
                runs["alone again, under load, while training"] = [_answer(c, p) for p in PROMPTS]
        # In batches of 3 (each prompt's neighbours differ from batch to batch), then of 16 with
        # the adapter users' rows and the trainee's.
        threes = [_at_once(d, [(PROMPTS[(k + j) % len(PROMPTS)], None) for j in range(3)])
                  for k in range(0, len(PROMPTS), 3)]
        runs["batch of 3"] = [threes[k // 3][k % 3] for k in range(len(PROMPTS))]
        users = [*ADAPTER_USERS * 2, TRAINEE, TRAINEE]
        mixed = _at_once(d, [(p, None) for p in PROMPTS] + list(zip(OTHERS, users, strict=True)))
        runs["batch of 16 with adapter rows"] = mixed[: len(PROMPTS)]
        assert [a for _, _, a in mixed[len(PROMPTS) : len(PROMPTS) + 4]] == ["alice@1", "bob@1"] * 2
        with d.client(timeout_s=600) as c:
            finetune = c.status()["finetune"]
        assert finetune["stages_run"] > 0 and finetune["errors"] == 0, finetune
    finally:
        code, _ = d.stop(timeout_s=60)
    reference = _REFERENCE.setdefault("alone", runs["alone"])
    bad = [f"{costs} {name}: prompt {i} {PROMPTS[i]!r}: {got[i][0]!r} != {reference[i][0]!r}"
           if got[i][0] != reference[i][0] else f"{costs} {name}: prompt {i}: same text, logprobs differ"
           for name, got in runs.items() for i in range(len(PROMPTS)) if got[i] != reference[i]]
    assert bad == [], "\n".join(bad)
    assert code == 0, d.log()[-3000:]


def test_cost_scale_multiplies_the_estimates_and_outlives_a_recalibration() -> None:
    import dataclasses

    from edge_runtime.sched.cost_model import CostModel, ForwardCoefficients

    f = ForwardCoefficients(0.002, 1e-3, 1e-6, 4e-4)
    costs = CostModel(f, 1024, 16, 64, 128, estimate_scale=4.0)
    assert costs.forward == ForwardCoefficients(0.008, 4e-3, 4e-6, 1.6e-3)
    costs.recalibrate(dataclasses.replace(f, token_s=2e-3))
    assert (costs.forward.token_s, costs.source) == (8e-3, "calibrated")
    assert CostModel(f, 1024, 16, 64, 128).forward is f
    from daemon.config import load_config

    assert load_config(None, {"MACE_ENGINE_COST_SCALE": "0.25"}).engine.cost_scale == 0.25
