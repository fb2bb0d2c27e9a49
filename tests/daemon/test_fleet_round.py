"""The device side of a federated fleet round against a real daemon (tiny model): `fleet.round`
trains the adapter it is given on the pairs of users holding fleet consent and answers with a
clipped (and noised) delta under the same tensor names, aggregate metrics and the privacy spent;
no feedback text is in the reply's bytes; withdrawn consent and erasure take a user out of the
next round; `fleet.evaluate` scores a candidate on the held-out pairs; a device under memory
pressure sheds the round and keeps serving; off by default."""

from __future__ import annotations

import math
import re
import uuid
from collections.abc import Callable
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch
import zmq

from daemon.sdk import Client, RemoteError, tensors_to_wire
from edge_runtime.lora import LoraSettings, LoraWeights
from edge_runtime.lora.adapter import to_state_dict
from edge_runtime.model.config import ModelConfig
from edge_runtime.train.dp import gaussian_rounds_epsilon
from tests.daemon.conftest import wait_for
from tests.daemon.test_cli import macectl

FLEET_ON = ["--set", "fleet.enabled=true", "--set", "finetune.enabled=false",
            "--set", "feedback.heldout_fraction=0.0",
            # These tests measure the mechanics (noise 0, large clips, one user): the device's
            # terms are lowered to nothing here; tests/security/test_fleet_terms.py holds them.
            "--set", "fleet.min_noise_multiplier=0", "--set", "fleet.max_clip=1e6",
            "--set", "fleet.min_examples=1", "--set", "fleet.min_users=1", "--set", "fleet.epsilon_budget=inf",
            "--set", "fleet.min_heldout_pairs=1", "--set", "fleet.evaluate_per_hour=1000"]
LORA = {"r": 4, "lora_alpha": 8.0, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}
CONFIG = {"steps": 3, "lr": 0.02, "beta": 0.1, "clip": 1e3, "noise_multiplier": 0.0, "seed": 1,
          "max_pairs": 64, "heldout_fraction": 0.0}


def global_adapter(cfg: ModelConfig, seed: int = 5) -> dict[str, np.ndarray]:
    """The fleet adapter a server would send: PEFT names, B not zero (so A's gradient is not)."""
    weights = LoraWeights.init(cfg, LoraSettings(rank=LORA["r"], alpha=LORA["lora_alpha"]), seed=seed)
    gen = torch.Generator().manual_seed(seed)
    for key, b in weights.b.items():
        weights.b[key] = torch.randn(b.shape, generator=gen) * 0.05
    return {name: t.numpy() for name, t in to_state_dict(weights).items()}


def add_edits(c: Client, user: str, n: int, *, fleet: bool = True) -> list[str]:
    """`n` preference pairs of `user` (an edited answer chosen over the generated one); returns
    every text the store now holds for them (prompts, answers, edits)."""
    c.consent(user, fleet=True if fleet else None)
    texts = []
    for i in range(n):
        prompt = f"Question {i} from {user}: how should the fleet adapter answer {uuid.uuid4().hex[:8]}?"
        r = c.generate(prompt, max_tokens=12, ignore_eos=True, user=user)
        edit = f"A careful answer number {i} for {user}, rewritten by hand ({uuid.uuid4().hex[:8]})."
        c.edit(user, r.interaction_id, edit)
        texts += [prompt, r.text, edit]
    return texts


def test_a_round_returns_the_clipped_delta_under_the_adapters_names_and_the_margin_goes_up(
        start_daemon: Callable, tiny_model: Path) -> None:
    d = start_daemon(extra_args=FLEET_ON)
    cfg = ModelConfig.from_dir(tiny_model)
    given = global_adapter(cfg)
    with d.client(timeout_s=120) as c:
        add_edits(c, "fleet-ada", 4)
        add_edits(c, "fleet-bo", 4)
        reply = c.fleet_round(1, given, LORA, CONFIG)
        assert reply["status"] == "trained" and reply["round"] == 1
        assert reply["num_examples"] == 8 and reply["metrics"]["users"] == 2
        delta = reply["delta"]
        assert set(delta) == set(given) and all(delta[k].shape == given[k].shape for k in given)
        norm = math.sqrt(sum(float((v.astype(np.float64) ** 2).sum()) for v in delta.values()))
        assert 0 < norm <= CONFIG["clip"] and "update_norm" not in reply["metrics"]
        privacy = reply["privacy"]
        assert privacy["rounds"] == 1 and math.isinf(privacy["epsilon"]) and privacy["delta"] == 1e-5
        assert math.isfinite(reply["metrics"]["train_loss"])

        # The pairs it trained on prefer their chosen answers more under given + delta.
        trained = {k: given[k] + delta[k] for k in given}
        everything = {"heldout_fraction": 0.0}
        assert c.fleet_evaluate(given, LORA, everything)["status"] == "no_material"  # nothing held out
        split = {"heldout_fraction": 0.9}  # evaluate on the pairs, wherever they were trained
        before = c.fleet_evaluate(given, LORA, split)
        after = c.fleet_evaluate(trained, LORA, split)
        assert before["num_examples"] == after["num_examples"] > 0
        assert after["metrics"]["heldout_margin"] > before["metrics"]["heldout_margin"]
        assert set(after["metrics"]) == {"heldout_win_rate", "heldout_margin"}

        # Clipped to a small bound, the same training comes back scaled to it.
        small = c.fleet_round(2, given, LORA, {**CONFIG, "clip": norm / 4})
        small_norm = math.sqrt(sum(float((v.astype(np.float64) ** 2).sum()) for v in small["delta"].values()))
        assert small_norm == pytest.approx(norm / 4, rel=1e-4)
        for k in given:
            np.testing.assert_allclose(small["delta"][k], delta[k] / 4, rtol=1e-3, atol=1e-7)
        # The round never published what it was given: serving stays on no fleet version.
        assert c.fleet_status()["serving"] is None
        # Its trainer's optimizer state left the memory ledger with it.
        c.generate("one more turn of the engine", max_tokens=2)
        wait_for(lambda: c.status()["engine"]["memory"]["optimizer_bytes"] == 0, timeout_s=10)


def test_held_out_pairs_are_never_trained_on_and_report_metrics_only(start_daemon: Callable,
                                                                     tiny_model: Path) -> None:
    d = start_daemon(extra_args=FLEET_ON)
    given = global_adapter(ModelConfig.from_dir(tiny_model))
    with d.client(timeout_s=120) as c:
        add_edits(c, "fleet-cy", 8)
        reply = c.fleet_round(1, given, LORA, {**CONFIG, "heldout_fraction": 0.5})
        metrics = reply["metrics"]
        assert reply["num_examples"] + metrics["heldout_pairs"] == 8 and metrics["heldout_pairs"] > 0
        assert {"heldout_win_rate_before", "heldout_win_rate_after", "heldout_margin_before",
                "heldout_margin_after"} <= set(metrics)
        assert all(isinstance(v, (int, float)) for v in metrics.values())
        evaluated = c.fleet_evaluate(given, LORA, {"heldout_fraction": 0.5})
        assert evaluated["num_examples"] == metrics["heldout_pairs"]
        assert evaluated["metrics"]["heldout_margin"] == pytest.approx(metrics["heldout_margin_before"], abs=1e-6)


def _raw_request(endpoint: str, message: dict) -> bytes:
    """One request on a bare DEALER socket; the reply frame's bytes exactly as they arrived."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        sock.send(msgpack.packb(message, use_bin_type=True))
        assert sock.poll(120_000), "no reply"
        return sock.recv()
    finally:
        sock.close()


def test_the_reply_bytes_hold_no_feedback_text_only_tensors_and_numbers(start_daemon: Callable,
                                                                        tiny_model: Path) -> None:
    d = start_daemon(extra_args=FLEET_ON)
    given = global_adapter(ModelConfig.from_dir(tiny_model))
    with d.client(timeout_s=120) as c:
        texts = add_edits(c, "fleet-dee", 3) + add_edits(c, "fleet-eli", 3)
    frame = _raw_request(d.endpoint, {"v": 1, "id": "r1", "op": "fleet.round", "round": 7,
                                      "adapter": tensors_to_wire(given), "lora_config": LORA,
                                      "config": {**CONFIG, "heldout_fraction": 0.5}})
    reply = msgpack.unpackb(frame, raw=False)
    assert reply["type"] == "result" and reply["result"]["status"] == "trained"
    long_texts = [t for t in texts if len(t) >= 8]
    assert len(long_texts) >= 12
    for text in long_texts:
        for start in range(0, len(text) - 7, 4):  # any 8 characters of it, in UTF-8
            assert text[start:start + 8].encode() not in frame, text
    for name in ("fleet-dee", "fleet-eli"):
        assert name.encode() not in frame

    def kinds(value: object) -> set[str]:
        if isinstance(value, dict):
            return {"map"} | set().union(*(kinds(v) for v in value.values()))
        if isinstance(value, list):
            return {"list"} | set().union(*(kinds(v) for v in value))
        return {type(value).__name__}

    result = reply["result"]
    assert {k: kinds(v) for k, v in result["metrics"].items()} == {k: {"int"} if isinstance(v, int) else {"float"}
                                                                   for k, v in result["metrics"].items()}
    strings = {v for k, v in result.items() if isinstance(v, str)}
    assert strings == {"trained"}  # the status; every other string is a tensor name or a dtype
    assert all(set(t) == {"dtype", "shape", "data"} and t["dtype"] == "float32" for t in result["delta"].values())


def test_withdrawn_fleet_consent_and_erasure_leave_a_user_out_of_the_next_round(start_daemon: Callable,
                                                                               tiny_model: Path) -> None:
    d = start_daemon(extra_args=FLEET_ON)
    given = global_adapter(ModelConfig.from_dir(tiny_model))
    one_step = {**CONFIG, "steps": 1}
    with d.client(timeout_s=120) as c:
        assert c.fleet_round(1, given, LORA, one_step) == {
            "round": 1, "status": "no_material", "num_examples": 0, "delta": {},
            "metrics": {"users": 0, "heldout_pairs": 0},
            "privacy": {"clip": CONFIG["clip"], "noise_multiplier": 0.0, "delta": 1e-5, "epsilon": 0.0, "rounds": 0}}
        add_edits(c, "fleet-fay", 2)
        add_edits(c, "fleet-gil", 3)
        add_edits(c, "feedback-only", 4, fleet=False)  # feedback consent, no fleet consent
        first = c.fleet_round(2, given, LORA, one_step)
        assert (first["num_examples"], first["metrics"]["users"]) == (5, 2)
        c.consent("fleet-gil", granted=None, fleet=False)
        second = c.fleet_round(3, given, LORA, one_step)
        assert (second["num_examples"], second["metrics"]["users"]) == (2, 1)
        c.forget("fleet-fay")
        third = c.fleet_round(4, given, LORA, one_step)
        assert third["status"] == "no_material" and third["num_examples"] == 0 and third["delta"] == {}
        assert third["privacy"]["rounds"] == 2  # rounds that sent nothing cost no privacy


def test_noise_has_the_right_scale_is_fresh_every_round_and_no_noise_spends_unbounded_epsilon(
        start_daemon: Callable, tiny_model: Path) -> None:
    d = start_daemon(extra_args=FLEET_ON)
    given = global_adapter(ModelConfig.from_dir(tiny_model))
    clip, sigma = 0.05, 0.5
    with d.client(timeout_s=120) as c:
        add_edits(c, "fleet-hal", 3)
        plain = c.fleet_round(1, given, LORA, {**CONFIG, "clip": clip})
        noisy = c.fleet_round(2, given, LORA, {**CONFIG, "clip": clip, "noise_multiplier": sigma})
        again = c.fleet_round(3, given, LORA, {**CONFIG, "clip": clip, "noise_multiplier": sigma})
    noise = np.concatenate([(noisy["delta"][k] - plain["delta"][k]).ravel() for k in given]).astype(np.float64)
    # Training is deterministic: the difference is the noise alone, N(0, (sigma C)^2) per coordinate.
    assert noise.size > 3000
    assert noise.std() == pytest.approx(sigma * clip, rel=0.05) and abs(noise.mean()) < 4 * sigma * clip / noise.size**0.5
    assert not np.allclose(noisy["delta"][next(iter(given))], again["delta"][next(iter(given))])  # fresh noise
    # The noiseless round spent unbounded privacy; the record counts rounds with noise too.
    assert math.isinf(noisy["privacy"]["epsilon"]) and again["privacy"]["rounds"] == 3
    code, _ = d.stop()
    assert code == 0
    assert "privacy spent: epsilon" in d.log()


def test_epsilon_of_noised_rounds_is_finite_grows_and_is_kept_across_restarts(start_daemon: Callable,
                                                                             tiny_model: Path) -> None:
    d = start_daemon(extra_args=FLEET_ON)
    given = global_adapter(ModelConfig.from_dir(tiny_model))
    noisy = {**CONFIG, "clip": 0.1, "noise_multiplier": 1.1, "steps": 1}
    with d.client(timeout_s=120) as c:
        add_edits(c, "fleet-ivy", 2)
        eps = [c.fleet_round(r, given, LORA, noisy)["privacy"]["epsilon"] for r in (1, 2)]
    assert math.isfinite(eps[0]) and eps[1] > eps[0]
    assert eps == pytest.approx([gaussian_rounds_epsilon([1.1] * n, 1e-5) for n in (1, 2)], rel=1e-12)
    d.stop()
    assert (d.state_dir / "fleet" / "privacy.json").is_file()
    # The same state dir: the third round's epsilon composes all three.
    again = start_daemon(extra_args=[*FLEET_ON, "--state-dir", str(d.state_dir)])
    with again.client(timeout_s=120) as c:
        assert c.status()["fleet"]["rounds_sent"] == 2
        third = c.fleet_round(3, given, LORA, noisy)["privacy"]
    assert third["rounds"] == 3 and third["epsilon"] == pytest.approx(gaussian_rounds_epsilon([1.1] * 3, 1e-5))
    shown = macectl(again.endpoint, "status")
    assert re.search(r"fleet rounds\W+on: 3 update\(s\) sent; epsilon " + f"{third['epsilon']:.3f}", shown.stdout)


def test_fleet_rounds_are_off_by_default_and_bad_adapters_are_refused(start_daemon: Callable,
                                                                      tiny_model: Path) -> None:
    cfg = ModelConfig.from_dir(tiny_model)
    given = global_adapter(cfg)
    off = start_daemon(extra_args=["--set", "finetune.enabled=false"])
    with off.client() as c:
        reply = c.fleet_round(1, given, LORA, CONFIG)
        assert reply["status"] == "disabled" and reply["delta"] == {} and reply["num_examples"] == 0
        assert c.fleet_evaluate(given, LORA)["status"] == "disabled"
    d = start_daemon(extra_args=FLEET_ON)
    with d.client() as c:
        # Frames past server.max_message_bytes (1 MiB) are read for the tensor ops only.
        with pytest.raises(RemoteError) as info:
            c.request("users.export", user="fleet-kim", pad="x" * (2 << 20))
        assert info.value.code == "too_large"
        with pytest.raises(RemoteError) as info:
            c.request("fleet.round", round=1, adapter=tensors_to_wire(given), lora_config=LORA,
                      config={"pad": "x" * (2 << 20)})
        assert info.value.code == "bad_request" and info.value.param == "config"
        wrong_rank = {**LORA, "r": 2}
        with pytest.raises(RemoteError) as info:
            c.fleet_round(1, given, wrong_rank, CONFIG)
        assert info.value.code == "bad_request" and info.value.param == "adapter" and "shapes" in info.value.message
        with pytest.raises(RemoteError) as info:
            c.fleet_round(1, {"model.embed_tokens.weight": np.zeros((2, 2), np.float32)}, LORA, CONFIG)
        assert info.value.code == "bad_request" and "LoRA" in info.value.message
        with pytest.raises(RemoteError) as info:
            c.fleet_round(1, given, LORA, {**CONFIG, "clip": 0})
        assert info.value.code == "bad_request" and info.value.param == "config.clip"
        with pytest.raises(RemoteError) as info:
            c.request("fleet.round", round=1, lora_config=LORA, adapter={
                "x.lora_A.weight": {"dtype": "float32", "shape": [2, 2], "data": b"\0" * 12}})
        assert info.value.code == "bad_request" and "needs 16" in info.value.message
        big = {k: np.full(v.shape, np.nan, np.float32) for k, v in given.items()}
        with pytest.raises(RemoteError) as info:
            c.fleet_round(1, big, LORA, CONFIG)
        assert "not finite" in info.value.message


# The fixture's "memory squeeze" line (tests/telemetry/fixtures/squeeze_thermal_trace.log): another
# app holds most of the RAM, and admission sheds fine-tuning.
SQUEEZE = next(line for line in (Path(__file__).parents[1] / "telemetry" / "fixtures" / "squeeze_thermal_trace.log")
               .read_text().splitlines() if line.startswith("05-09-2026 18:42:03"))


def test_a_device_under_memory_pressure_sheds_the_round_and_keeps_serving(start_daemon: Callable,
                                                                          tiny_model: Path, tmp_path: Path) -> None:
    trace = tmp_path / "squeeze.log"
    trace.write_text(SQUEEZE + "\n")
    slo_tbt_s = 0.25  # the engine's TBT SLO, set so the test can hold serving to it
    d = start_daemon(extra_args=[*FLEET_ON, "--set", f"telemetry.replay_file={trace}",
                                 "--set", "telemetry.replay_loop=true",
                                 "--set", f"engine.slo_tbt_ms={slo_tbt_s * 1000:g}"])
    given = global_adapter(ModelConfig.from_dir(tiny_model))
    with d.client(timeout_s=120) as c:
        wait_for(lambda: c.status()["admission"]["state"] == "shed_finetune", timeout_s=20)
        add_edits(c, "fleet-jo", 2)
        reply = c.fleet_round(1, given, LORA, CONFIG)
        assert reply["status"] == "shed" and reply["num_examples"] == 0 and reply["delta"] == {}
        assert reply["privacy"]["rounds"] == 0
        served = c.generate("Still serving?", max_tokens=16, ignore_eos=True)
        tokens = served.usage["completion_tokens"]
        assert tokens == 16
        mean_tbt_s = (served.timing["total_s"] - served.timing["ttft_s"]) / (tokens - 1)
        assert mean_tbt_s <= slo_tbt_s, served.timing


def test_a_user_withdrawing_fleet_consent_during_a_round_stops_its_update_from_leaving(
        start_daemon: Callable, tiny_model: Path) -> None:
    import asyncio

    from daemon.sdk import AsyncClient

    d = start_daemon(extra_args=FLEET_ON)
    given = global_adapter(ModelConfig.from_dir(tiny_model))
    with d.client(timeout_s=120) as c:
        add_edits(c, "fleet-lou", 3)
        add_edits(c, "fleet-max", 3)

        async def round_while_withdrawing() -> dict:
            async with AsyncClient(d.endpoint, timeout_s=120) as ac:
                running = asyncio.create_task(ac.fleet_round(1, given, LORA, {**CONFIG, "steps": 40}))
                # Training, not merely holding the lock: before the round reads the store, a
                # withdrawal only leaves the user out of it (the round then trains the other).
                await asyncio.to_thread(wait_for, lambda: c.status()["fleet"]["round_phase"] == "training", 30, 0.05)
                c.consent("fleet-max", granted=None, fleet=False)
                return await running

        reply = asyncio.run(round_while_withdrawing())
        assert reply["status"] == "shed" and reply["delta"] == {} and reply["privacy"]["rounds"] == 0
        after = c.fleet_round(2, given, LORA, {**CONFIG, "steps": 1})
        assert after["status"] == "trained" and after["metrics"]["users"] == 1
    assert "withdrew fleet consent or was erased while it ran" in d.log()


def test_lone_thumbs_train_the_fleet_adapter_with_kto_beside_the_pairs(start_daemon: Callable,
                                                                       tiny_model: Path) -> None:
    d = start_daemon(extra_args=FLEET_ON)
    given = global_adapter(ModelConfig.from_dir(tiny_model))
    with d.client(timeout_s=120) as c:
        c.consent("fleet-nia", fleet=True)
        for i, up in enumerate((True, False, True)):
            r = c.generate(f"Thumb {i}: say something kind about the fleet", max_tokens=8, ignore_eos=True,
                           user="fleet-nia")
            c.thumbs("fleet-nia", r.interaction_id, up)
        only_thumbs = c.fleet_round(1, given, LORA, {**CONFIG, "steps": 1})
        assert only_thumbs["status"] == "trained" and only_thumbs["num_examples"] == 3
        assert math.isfinite(only_thumbs["metrics"]["train_loss"])
        assert any(np.abs(v).max() > 0 for v in only_thumbs["delta"].values())
        add_edits(c, "fleet-nia", 2)
        both = c.fleet_round(2, given, LORA, {**CONFIG, "steps": 1})
        assert both["num_examples"] == 5 and both["metrics"]["users"] == 1


def test_a_privacy_record_that_cannot_be_read_stops_rounds_instead_of_starting_over(tmp_path: Path) -> None:
    from daemon.fleet.device.rounds import PrivacyRecord
    from daemon.wire import ProtocolError

    record = PrivacyRecord(tmp_path / "fleet" / "privacy.json")
    record.add(1, 0.1, 1.1)
    record.add(2, 0.1, 1.1)
    again = PrivacyRecord(tmp_path / "fleet" / "privacy.json")
    assert [r["round"] for r in again.rounds] == [1, 2]
    assert again.epsilon(1e-5) == pytest.approx(gaussian_rounds_epsilon([1.1, 1.1], 1e-5))
    (tmp_path / "fleet" / "privacy.json").write_text('{"rounds": [{"round": 1}]')
    broken = PrivacyRecord(tmp_path / "fleet" / "privacy.json")
    assert broken.error is not None and math.isinf(broken.epsilon(1e-5))
    with pytest.raises(ProtocolError, match="cannot be read"):
        broken.add(3, 0.1, 1.1)
