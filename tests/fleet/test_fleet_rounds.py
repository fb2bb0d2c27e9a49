"""The aggregator's rounds and the device's ClientApp together, in one process: a grid that hands
each message to `daemon.fleet.offdevice.client_app`'s handlers, whose daemon is a scripted stand-in (the real
daemons are tests/fleet/test_simulated_fleet.py's). Checks the aggregation rules, the held-out
gate, the signed publish, and that a train reply is tensors and numbers only."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import Context, Message, RecordDict
from flwr.common.serde import recorddict_to_proto
from safetensors.numpy import load_file

from daemon.fleet.offdevice import client_app as fleet_client
from daemon.fleet.offdevice.server_app import (
    FleetRunSettings,
    initial_adapter,
    not_worse,
    run_rounds,
)
from daemon.fleet.offdevice.signing import PublishRefused, sign_publish, write_keypair


class ScriptedDaemon:
    """What `fleet.round` / `fleet.evaluate` / `fleet.publish` answer on one device."""

    def __init__(self, examples: int, direction: float | dict[str, float], status: str = "trained",
                 score: Any = None) -> None:
        self.examples, self.direction, self.status = examples, direction, status
        self.score = score or (lambda adapter: 0.5)
        self.published: list[dict[str, np.ndarray]] = []
        self.publish_calls: list[tuple[str | None, int | None]] = []
        self.rounds = 0

    def __enter__(self) -> ScriptedDaemon:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def fleet_round(self, round: int, adapter: dict, lora_config: dict, config: dict) -> dict:
        self.rounds += 1
        def step(key: str) -> float:
            return self.direction if isinstance(self.direction, float) else self.direction.get(key, 0.0)
        delta = {k: np.full_like(v, step(k)) for k, v in adapter.items() if ".lora_B." in k}
        delta.update({k: np.zeros_like(v) for k, v in adapter.items() if ".lora_A." in k})
        return {"round": round, "num_examples": self.examples, "status": self.status,
                "delta": delta if self.examples else {},
                "metrics": {"heldout_win_rate_before": 0.5, "heldout_win_rate_after": 0.75, "users": 2,
                            "heldout_pairs": 4, "train_loss": 0.6, "heldout_margin_before": 0.0,
                            "heldout_margin_after": 0.1},
                "privacy": {"clip": 1.0, "noise_multiplier": 0.5, "delta": 1e-5, "epsilon": 2.5 * self.rounds,
                            "rounds": self.rounds},
                # Anything else a daemon might add must not ride along to the aggregator.
                "note": "user ann said: please always answer in French"}

    def fleet_evaluate(self, adapter: dict, lora_config: dict, config: dict | None = None) -> dict:
        win = float(self.score(adapter))
        return {"num_examples": 4, "metrics": {"heldout_win_rate": win, "heldout_margin": win - 0.5}}

    def fleet_publish(self, folder: str, operator_key: str | None = None, *, run_id: str | None = None,
                      round: int | None = None) -> dict:
        self.publish_calls.append((run_id, round))
        path = Path(folder)
        assert json.loads((path / "adapter_config.json").read_text())["peft_type"] == "LORA"
        self.published.append(load_file(str(path / "adapter_model.safetensors")))
        return {"version": len(self.published)}


class LocalGrid:
    """A Flower Grid whose nodes are ClientApp handlers called in this process."""

    def __init__(self, daemons: dict[int, ScriptedDaemon], node_config: dict[str, Any]) -> None:
        self.daemons, self.node_config = daemons, node_config
        self.sent: list[tuple[int, str, RecordDict]] = []  # what each device replied

    def get_node_ids(self) -> list[int]:
        return list(self.daemons)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> list[Message]:
        handlers = {"train": fleet_client.train, "evaluate": fleet_client.evaluate,
                    "query.publish": fleet_client.publish}
        replies = []
        for msg in messages:
            node = msg.metadata.dst_node_id
            context = Context(run_id=1, node_id=node, node_config=self.node_config, state=RecordDict(),
                              run_config={})
            fleet_client_daemon[0] = self.daemons[node]
            reply = handlers[msg.metadata.message_type](msg, context)
            self.sent.append((node, msg.metadata.message_type, reply.content))
            replies.append(reply)
        return replies


fleet_client_daemon: list[ScriptedDaemon] = [None]  # type: ignore[list-item]


@pytest.fixture(autouse=True)
def scripted_daemon(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fleet_client, "daemon_client", lambda node_config: fleet_client_daemon[0])


@pytest.fixture
def keys(tmp_path: Path) -> tuple[Path, Path]:
    private, public = tmp_path / "aggregator.key", tmp_path / "aggregator.pub"
    write_keypair(private, public)
    return private, public


def settings(tiny_model_dir: Path, tmp_path: Path, key: Path, **kw: Any) -> FleetRunSettings:
    return FleetRunSettings(model=str(tiny_model_dir), rounds=1, min_devices=2, signing_key=str(key),
                         round_log=str(tmp_path / "rounds.jsonl"), **kw)


def b_mean(adapter: dict[str, np.ndarray]) -> float:
    return float(np.mean([v.mean() for k, v in adapter.items() if ".lora_B." in k]))


def test_fedavg_weights_by_examples_and_a_device_without_material_contributes_nothing(
        tiny_model_dir: Path, tmp_path: Path, keys: tuple[Path, Path]) -> None:
    better = lambda adapter: 0.5 + b_mean(adapter)  # noqa: E731 - a larger B wins more held-out pairs
    daemons = {1: ScriptedDaemon(30, 0.1, score=better), 2: ScriptedDaemon(10, 0.5, score=better),
               3: ScriptedDaemon(0, 9.0, status="no_material", score=better),
               4: ScriptedDaemon(0, 9.0, status="shed", score=better)}
    grid = LocalGrid(daemons, {"aggregator-key": str(keys[1])})
    [record] = run_rounds(grid, settings(tiny_model_dir, tmp_path, keys[0]))

    assert record.contributing == 2 and record.examples == 40 and record.published
    assert {d["node"]: d["status"] for d in record.devices} == {1: "trained", 2: "trained", 3: "no_material",
                                                                4: "shed"}
    assert [d["epsilon"] for d in record.devices if d["node"] == 1] == [2.5]
    # (30 * 0.1 + 10 * 0.5) / 40 = 0.2 on every B entry; the 9.0s never count.
    published = daemons[1].published[0]
    assert all(np.allclose(v, 0.2) for k, v in published.items() if ".lora_B." in k)
    initial, _ = initial_adapter(settings(tiny_model_dir, tmp_path, keys[0]))
    assert all(np.array_equal(published[k], v) for k, v in initial.items() if ".lora_A." in k)
    assert all(len(d.published) == 1 for d in daemons.values())  # every device serves it
    line = json.loads((tmp_path / "rounds.jsonl").read_text().splitlines()[0])
    assert line["published"] is True and line["metrics_after"]["heldout_win_rate"] > line["metrics_before"][
        "heldout_win_rate"]


def test_trimmed_mean_leaves_out_one_devices_private_direction(
        tiny_model_dir: Path, tmp_path: Path, keys: tuple[Path, Path]) -> None:
    initial, _ = initial_adapter(settings(tiny_model_dir, tmp_path, keys[0]))
    private_key = next(k for k in initial if ".lora_B." in k)
    shared = 0.1
    daemons = {n: ScriptedDaemon(10, shared) for n in (1, 2, 3)}
    daemons[4] = ScriptedDaemon(10, {k: shared + (5.0 if k == private_key else 0.0)
                                     for k in initial if ".lora_B." in k})
    for strategy, expected in (("trimmed-mean", shared), ("fedavg", shared + 5.0 / 4)):
        for d in daemons.values():
            d.published.clear()
        grid = LocalGrid(daemons, {"aggregator-key": str(keys[1])})
        [record] = run_rounds(grid, settings(tiny_model_dir, tmp_path, keys[0], strategy=strategy))
        assert record.published, record
        published = daemons[1].published[0]
        assert np.allclose(published[private_key], expected), strategy
        assert all(np.allclose(v, shared) for k, v in published.items() if ".lora_B." in k and k != private_key)


def test_a_candidate_worse_on_heldout_pairs_is_not_published(
        tiny_model_dir: Path, tmp_path: Path, keys: tuple[Path, Path]) -> None:
    worse = lambda adapter: 0.5 - b_mean(adapter)  # noqa: E731
    daemons = {n: ScriptedDaemon(10, 0.3, score=worse) for n in (1, 2)}
    grid = LocalGrid(daemons, {"aggregator-key": str(keys[1])})
    [record] = run_rounds(grid, settings(tiny_model_dir, tmp_path, keys[0]))
    assert not record.published and "worse" in record.reason
    assert record.metrics_after["heldout_win_rate"] < record.metrics_before["heldout_win_rate"]
    assert all(d.published == [] for d in daemons.values())
    assert not not_worse(None, {"heldout_win_rate": 0.5, "heldout_margin": 0.0})


def test_a_train_reply_holds_delta_tensors_and_numbers_only(
        tiny_model_dir: Path, tmp_path: Path, keys: tuple[Path, Path]) -> None:
    daemons = {n: ScriptedDaemon(10, 0.1) for n in (1, 2)}
    grid = LocalGrid(daemons, {"aggregator-key": str(keys[1])})
    run_rounds(grid, settings(tiny_model_dir, tmp_path, keys[0]))
    trains = [content for _, kind, content in grid.sent if kind == "train"]
    assert len(trains) == 2
    for content in trains:
        assert set(content.array_records) == {"arrays"} and set(content.metric_records) == {"metrics"}
        assert not content.config_records
        assert all(a.dtype == "float32" for a in content["arrays"].values())
        assert all(isinstance(v, (int, float)) for v in content["metrics"].values())
        assert b"French" not in recorddict_to_proto(content).SerializeToString()


PEFT = {"peft_type": "LORA", "r": 2, "lora_alpha": 4.0, "target_modules": ["q_proj"]}


def publish_message(arrays: dict[str, np.ndarray], signature: bytes | None, run_id: str = "run-a",
                    config: dict | None = None) -> Message:
    content = fleet_client.ConfigRecord({"server-round": 3, "run-id": run_id,
                                         "lora.peft-config": json.dumps(config or PEFT)})
    if signature is not None:
        content["signature"] = signature
    record = RecordDict({"arrays": fleet_client.ArrayRecord({k: fleet_client.Array(v) for k, v in arrays.items()}),
                         "config": content})
    return Message(record, dst_node_id=1, message_type="query.publish")


def test_a_device_publishes_only_what_its_aggregator_signed(tmp_path: Path, keys: tuple[Path, Path]) -> None:
    private, public = keys
    stranger, stranger_public = tmp_path / "stranger.key", tmp_path / "stranger.pub"
    write_keypair(stranger, stranger_public)
    arrays = {"base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": np.ones((4, 2), np.float32)}
    tampered = {k: v * 2 for k, v in arrays.items()}
    daemon = ScriptedDaemon(0, 0.0)
    fleet_client_daemon[0] = daemon
    ctx = lambda config: Context(run_id=1, node_id=1, node_config=config, state=RecordDict(), run_config={})  # noqa: E731
    ok = {"aggregator-key": str(public)}
    cases = [({}, sign_publish(private, "run-a", 3, PEFT, arrays), arrays, "no aggregator-key", {}),
             (ok, None, arrays, "no signature", {}),
             (ok, sign_publish(stranger, "run-a", 3, PEFT, arrays), arrays, "does not match", {}),
             (ok, sign_publish(private, "run-a", 2, PEFT, arrays), arrays, "does not match", {}),
             (ok, sign_publish(private, "run-b", 3, PEFT, arrays), arrays, "does not match", {}),
             (ok, sign_publish(private, "run-a", 3, PEFT, arrays), tampered, "does not match", {}),
             # The config is signed too: swapped after signing (lora_alpha = Infinity), refused.
             (ok, sign_publish(private, "run-a", 3, PEFT, arrays), arrays, "not plain JSON",
              {"config": {**PEFT, "lora_alpha": float("inf")}}),
             (ok, sign_publish(private, "run-a", 3, PEFT, arrays), arrays, "does not match",
              {"config": {**PEFT, "lora_alpha": 1e38}}),
             # A signature of the first format (no run id, no config) is refused.
             (ok, sign_publish(private, "", 3, PEFT, arrays), arrays, "no run id", {"run_id": ""})]
    for node_config, signature, sent, reason, change in cases:
        with pytest.raises(PublishRefused, match=reason):
            fleet_client.publish(publish_message(sent, signature, **change), ctx(node_config))
    assert daemon.published == []
    fleet_client.publish(publish_message(arrays, sign_publish(private, "run-a", 3, PEFT, arrays)), ctx(ok))
    assert daemon.publish_calls == [("run-a", 3)]  # the daemon refuses a replay of run-a's round 3


def test_run_config_is_read_and_a_new_run_goes_on_from_the_last_published_adapter(
        tiny_model_dir: Path, tmp_path: Path, keys: tuple[Path, Path]) -> None:
    parsed = FleetRunSettings.from_run_config({"model": str(tiny_model_dir), "rounds": 2, "targets": "q_proj, v_proj",
                                               "strategy": "trimmed-mean", "noise-multiplier": 0, "seed": 7})
    assert parsed.rounds == 2 and parsed.targets == ("q_proj", "v_proj") and parsed.strategy == "trimmed-mean"
    assert isinstance(parsed.noise_multiplier, float) and parsed.seed == 7
    with pytest.raises(ValueError, match="strategy"):
        FleetRunSettings.from_run_config({"model": "m", "strategy": "median"})

    daemons = {n: ScriptedDaemon(10, 0.1, score=lambda adapter: 0.5 + b_mean(adapter)) for n in (1, 2)}
    grid = LocalGrid(daemons, {"aggregator-key": str(keys[1])})
    state = settings(tiny_model_dir, tmp_path, keys[0], state_dir=str(tmp_path / "state"))
    first = run_rounds(grid, state)
    second = run_rounds(grid, state)
    assert [r.round for r in first + second] == [1, 2] and all(r.published for r in first + second)
    # Round 2 started from round 1's published adapter: B is 0.1 + 0.1 on every entry.
    assert all(np.allclose(v, 0.2) for k, v in daemons[1].published[-1].items() if ".lora_B." in k)
