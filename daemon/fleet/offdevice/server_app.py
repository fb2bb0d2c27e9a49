"""The aggregator of federated fleet rounds (issue #20, docs/fleet.md): a Flower ServerApp. Per
round it sends the fleet adapter to the devices, aggregates the deltas they return (FedAvg weighted
by examples, or a coordinate-wise trimmed mean: Flower's own strategies), evaluates the candidate
against the current adapter on the devices' held-out pairs, and has the devices publish it only if
neither held-out metric got worse. One JSON line per round records what happened.

Sees adapter tensors and aggregate numbers, never a device's feedback.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg, FedTrimmedAvg, Strategy

from daemon.fleet.offdevice.client_app import STATUS_CODES, WEIGHT
from daemon.fleet.offdevice.signing import canonical_config, sign_publish

log = logging.getLogger("mace.fleet.server")

STATUS_NAMES = {code: name for name, code in STATUS_CODES.items()}
GATE_METRICS = ("heldout_win_rate", "heldout_margin")


@dataclass(frozen=True)
class FleetRunSettings:
    """One federated run; from the Flower app's run config (`[tool.flwr.app.config]`, kebab-case)."""

    model: str  # the model folder (its config.json gives the adapter's shapes)
    rounds: int = 3
    strategy: str = "fedavg"  # or "trimmed-mean"
    trim_fraction: float = 0.25  # cut from each tail per coordinate (trimmed mean)
    min_devices: int = 2
    fraction: float = 1.0  # of the connected devices sampled for training each round
    rank: int = 4
    alpha: float = 8.0
    targets: tuple[str, ...] = ("q_proj", "v_proj")
    seed: int = 0
    # The device's round (`fleet.round` config): DPO steps over its doubly-consented pairs, then
    # the delta clipped to `clip` (L2) and Gaussian noise of std `noise_multiplier * clip`.
    steps: int = 8
    lr: float = 5e-3
    beta: float = 0.1
    clip: float = 1.0
    noise_multiplier: float = 0.5
    max_pairs: int = 64
    heldout_fraction: float = 0.25
    signing_key: str = ""  # the aggregator's Ed25519 private key (PEM): publishes are signed with it
    # Signed into every publish with the round: a device publishes each round of a run once.
    # "" = Flower's run id of this run.
    run_id: str = ""
    round_log: str = ""  # a JSON line per round is appended here
    # The aggregator's own state: the last published adapter and round number, so a new run (or
    # a restarted aggregator) goes on from there instead of from a fresh adapter.
    state_dir: str = ""
    # Every reply a device sent, as received (records, names, shapes, numbers; the serialized
    # bytes beside): what left the devices, for an audit. Off unless a folder is named.
    audit_dir: str = ""
    timeout_s: float = 1800.0

    @classmethod
    def from_run_config(cls, config: Mapping[str, Any]) -> FleetRunSettings:
        values: dict[str, Any] = {}
        for name, default in asdict(cls(model="")).items():
            key = name.replace("_", "-")
            if key not in config:
                continue
            raw = config[key]
            if isinstance(default, tuple):
                values[name] = tuple(t.strip() for t in str(raw).split(",") if t.strip())
            else:
                values[name] = type(default)(raw)
        if not values.get("model"):
            raise ValueError("the run config needs `model`: the model folder the devices serve")
        if values.get("strategy", "fedavg") not in ("fedavg", "trimmed-mean"):
            raise ValueError(f"strategy must be fedavg or trimmed-mean, got {values['strategy']!r}")
        return cls(**values)


@dataclass
class RoundRecord:
    """What one round did; written as one JSON line."""

    round: int
    strategy: str
    devices: list[dict[str, Any]] = field(default_factory=list)
    examples: int = 0
    contributing: int = 0
    metrics_before: dict[str, float] | None = None  # current fleet adapter, devices' held-out pairs
    metrics_after: dict[str, float] | None = None  # the candidate, same pairs
    published: bool = False
    published_on: int = 0  # devices that acknowledged the publish
    reason: str = ""
    seconds: float = 0.0


def make_strategy(settings: FleetRunSettings) -> Strategy:
    common = {"fraction_train": settings.fraction, "fraction_evaluate": 1.0,
              "min_train_nodes": settings.min_devices, "min_evaluate_nodes": settings.min_devices,
              "min_available_nodes": settings.min_devices, "weighted_by_key": WEIGHT}
    if settings.strategy == "trimmed-mean":
        return FedTrimmedAvg(beta=settings.trim_fraction, **common)
    return FedAvg(**common)


def initial_adapter(settings: FleetRunSettings) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """A seeded, PEFT-initialised fleet adapter (A Kaiming-uniform, B zero: the base model's
    answers until a round moves B) and its PEFT config, shaped by the model's config.json."""
    from edge_runtime.lora import LoraSettings
    from edge_runtime.lora.adapter import to_state_dict
    from edge_runtime.lora.weights import LoraWeights
    from edge_runtime.model.config import ModelConfig

    cfg = ModelConfig.from_dir(settings.model)
    lora = LoraSettings(rank=settings.rank, alpha=settings.alpha, target_modules=settings.targets)
    weights = LoraWeights.init(cfg, lora, seed=settings.seed)
    tensors = {k: v.numpy().astype(np.float32) for k, v in to_state_dict(weights).items()}
    return tensors, weights.settings.to_peft_config()


def load_state(settings: FleetRunSettings) -> tuple[dict[str, np.ndarray], int] | None:
    """The adapter and round a previous run of this aggregator left in `state_dir`, if any."""
    folder = Path(settings.state_dir) if settings.state_dir else None
    if folder is None or not (folder / "state.json").is_file():
        return None
    from safetensors.numpy import load_file

    state = json.loads((folder / "state.json").read_text())
    return load_file(str(folder / state["adapter"])), int(state["round"])


def save_state(settings: FleetRunSettings, tensors: Mapping[str, np.ndarray], server_round: int) -> None:
    """Keep the published adapter and the round reached, written so a crash leaves the old state."""
    if not settings.state_dir:
        return
    from safetensors.numpy import save_file

    folder = Path(settings.state_dir)
    folder.mkdir(parents=True, exist_ok=True)
    name = f"fleet-round-{server_round}.safetensors"
    save_file(dict(tensors), str(folder / name))
    tmp = folder / "state.json.tmp"
    tmp.write_text(json.dumps({"round": server_round, "adapter": name}))
    tmp.replace(folder / "state.json")


def round_config(settings: FleetRunSettings, peft_config: Mapping[str, Any], server_round: int) -> ConfigRecord:
    """What a device needs for `fleet.round`: the LoRA layout and the training/privacy knobs."""
    return ConfigRecord({
        "lora.r": int(peft_config["r"]), "lora.alpha": float(peft_config["lora_alpha"]),
        "lora.targets": list(peft_config["target_modules"]), "lora.peft-config": json.dumps(peft_config),
        "round.steps": settings.steps, "round.lr": settings.lr, "round.beta": settings.beta,
        "round.clip": settings.clip, "round.noise_multiplier": settings.noise_multiplier,
        "round.seed": settings.seed * 100_003 + server_round, "round.max_pairs": settings.max_pairs,
        "round.heldout_fraction": settings.heldout_fraction,
    })


def arrays_of(tensors: Mapping[str, np.ndarray]) -> ArrayRecord:
    return ArrayRecord({k: Array(np.ascontiguousarray(v, dtype=np.float32)) for k, v in tensors.items()})


def device_entry(reply: Message) -> dict[str, Any]:
    if reply.has_error():
        return {"node": reply.metadata.src_node_id, "error": reply.error.reason}
    m = reply.content["metrics"]
    return {"node": reply.metadata.src_node_id, "status": STATUS_NAMES.get(int(m["status"]), "unknown"),
            "examples": int(m[WEIGHT]), "epsilon": m.get("privacy.epsilon"),
            "privacy_rounds": m.get("privacy.rounds"),
            "metrics": {k.removeprefix("metric."): v for k, v in m.items() if k.startswith("metric.")}}


def audit_replies(folder: str, server_round: int, kind: str, replies: Iterable[Message]) -> None:
    """Write what each device sent: `<round>-<kind>-<node>.json` (every record, every key, array
    dtypes and shapes, metric values) and `.bin` (the content as Flower serializes it)."""
    from flwr.common.serde import recorddict_to_proto

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    for reply in replies:
        if reply.has_error():
            continue
        content, stem = reply.content, f"{server_round:03d}-{kind}-{reply.metadata.src_node_id}"
        summary = {
            "arrays": {name: {key: {"dtype": a.dtype, "shape": list(a.shape)} for key, a in record.items()}
                       for name, record in content.array_records.items()},
            "metrics": {name: dict(record) for name, record in content.metric_records.items()},
            "configs": {name: {k: repr(v) for k, v in record.items()} for name, record in content.config_records.items()},
        }
        (out / f"{stem}.json").write_text(json.dumps(summary, indent=1))
        (out / f"{stem}.bin").write_bytes(recorddict_to_proto(content).SerializeToString())


def contributing_replies(replies: Iterable[Message]) -> list[Message]:
    """Replies that carry a delta: no error and at least one example. A device that shed the round,
    had no consented material or is disabled weighs nothing and is left out of the aggregate."""
    return [r for r in replies if not r.has_error() and int(r.content["metrics"][WEIGHT]) > 0]


def evaluate_on_devices(grid: Grid, strategy: Strategy, settings: FleetRunSettings, server_round: int,
                        tensors: Mapping[str, np.ndarray], config: ConfigRecord, kind: str) -> dict[str, float] | None:
    """Held-out win rate and margin of `tensors` as the fleet adapter, weighted by each device's
    held-out pairs (devices without any weigh nothing); None when no device has held-out pairs."""
    messages = strategy.configure_evaluate(server_round, arrays_of(tensors), ConfigRecord(dict(config)), grid)
    replies = list(grid.send_and_receive(messages, timeout=settings.timeout_s))
    if settings.audit_dir:
        audit_replies(settings.audit_dir, server_round, kind, replies)
    replies = contributing_replies(replies)
    if not replies:
        return None
    metrics = strategy.aggregate_evaluate(server_round, replies)
    return None if metrics is None else {k: float(metrics[k]) for k in GATE_METRICS}


def not_worse(candidate: Mapping[str, float] | None, current: Mapping[str, float] | None) -> bool:
    """The held-out gate: publish only when no held-out metric got worse."""
    if candidate is None or current is None:
        return False
    return all(candidate[k] >= current[k] for k in GATE_METRICS)


def publish_on_devices(grid: Grid, settings: FleetRunSettings, server_round: int,
                       tensors: Mapping[str, np.ndarray], peft_config: Mapping[str, Any]) -> int:
    """Ask every connected device to serve `tensors`; returns how many did."""
    config = ConfigRecord({"server-round": server_round, "run-id": settings.run_id,
                           "lora.peft-config": canonical_config(peft_config)})
    if settings.signing_key:
        config["signature"] = sign_publish(Path(settings.signing_key), settings.run_id, server_round, peft_config,
                                           tensors)
    content = RecordDict({"arrays": arrays_of(tensors), "config": config})
    messages = [Message(content=content, message_type="query.publish", dst_node_id=node)
                for node in grid.get_node_ids()]
    replies = list(grid.send_and_receive(messages, timeout=settings.timeout_s))
    for reply in replies:
        if reply.has_error():
            log.warning("device %s did not publish round %d: %s", reply.metadata.src_node_id,
                        server_round, reply.error.reason)
    return sum(1 for r in replies if not r.has_error())


def run_rounds(grid: Grid, settings: FleetRunSettings) -> list[RoundRecord]:
    """The federated loop: train, aggregate, evaluate candidate against current, gate, publish."""
    if not settings.run_id:  # called without Flower's run (tests): any id unique to this run
        settings = replace(settings, run_id=uuid.uuid4().hex)
    strategy = make_strategy(settings)
    current, peft_config = initial_adapter(settings)
    first = 1
    if (resumed := load_state(settings)) is not None:
        previous, last_round = resumed
        if set(previous) != set(current) or any(previous[k].shape != current[k].shape for k in current):
            raise ValueError(f"the adapter in {settings.state_dir} does not have this run's rank/targets/model")
        current, first = previous, last_round + 1
    records = []
    for server_round in range(first, first + settings.rounds):
        started = time.monotonic()
        record = RoundRecord(round=server_round, strategy=settings.strategy)
        config = round_config(settings, peft_config, server_round)
        replies = list(grid.send_and_receive(
            strategy.configure_train(server_round, arrays_of(current), ConfigRecord(dict(config)), grid),
            timeout=settings.timeout_s))
        record.devices = [device_entry(r) for r in replies]
        if settings.audit_dir:
            audit_replies(settings.audit_dir, server_round, "train", replies)
        contributing = contributing_replies(replies)
        record.contributing = len(contributing)
        record.examples = sum(int(r.content["metrics"][WEIGHT]) for r in contributing)
        if not contributing:
            record.reason = "no device trained (no consented material, shed or disabled)"
        else:
            delta, _ = strategy.aggregate_train(server_round, contributing)
            candidate = {k: current[k] + delta[k].numpy() for k in current}
            record.metrics_before = evaluate_on_devices(grid, strategy, settings, server_round, current,
                                                        config, "evaluate-current")
            record.metrics_after = evaluate_on_devices(grid, strategy, settings, server_round, candidate,
                                                       config, "evaluate-candidate")
            if not_worse(record.metrics_after, record.metrics_before):
                record.published_on = publish_on_devices(grid, settings, server_round, candidate, peft_config)
                record.published = record.published_on > 0
                if record.published:
                    current = candidate
            else:
                record.reason = "held-out metrics got worse (or no held-out pairs): not published"
        save_state(settings, current, server_round)
        record.seconds = round(time.monotonic() - started, 3)
        log.info("fleet round %d: %s", server_round, json.dumps(asdict(record)))
        if settings.round_log:
            with open(settings.round_log, "a", encoding="utf-8") as out:
                out.write(json.dumps(asdict(record)) + "\n")
        records.append(record)
    return records


app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    settings = FleetRunSettings.from_run_config(context.run_config)
    run_rounds(grid, settings if settings.run_id else replace(settings, run_id=str(context.run_id)))

