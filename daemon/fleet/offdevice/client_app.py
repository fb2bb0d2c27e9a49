"""The device's side of a federated fleet round (issue #20, docs/fleet.md): a Flower ClientApp that
the device's SuperNode runs. It asks the local `maced` for a round (`fleet.round`) and answers the
aggregator with the adapter delta and aggregate numbers only; it evaluates a candidate adapter on
the device's held-out pairs (`fleet.evaluate`), and publishes an aggregate the aggregator signed
(`fleet.publish`). It never reads feedback: training, clipping, noise and consent are the daemon's.

Needs neither torch nor transformers (the SDK and numpy only): the SuperNode starts it per run.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from daemon.fleet.offdevice.signing import PublishRefused, verify_publish
from daemon.sdk import Client

# Node config keys (flower-supernode --node-config); docs/fleet.md "Joining a device".
ENDPOINT = "maced-endpoint"  # the daemon's ZeroMQ endpoint; default: its usual ipc socket
AGGREGATOR_KEY = "aggregator-key"  # the aggregator's Ed25519 public key: publishes must carry its signature
STAGING_DIR = "staging-dir"  # where a published adapter is written before `fleet.publish` reads it
# The daemon's operator key (publishing is the operator's); default: <staging-dir>/../fleet/operator.key,
# i.e. the daemon's own when the staging dir is its <state>/fleet-staging (the unit's layout).
OPERATOR_KEY = "operator-key"
DEV_UNSIGNED = "dev-accept-unsigned"  # development only: publish without a signature check
ROUND_TIMEOUT = "round-timeout-s"  # how long to wait for the daemon's round (default 1800 s)

# What a train reply's MetricRecord says about the round, as numbers (a MetricRecord holds no text).
STATUS_CODES = {"trained": 0, "no_material": 1, "shed": 2, "disabled": 3}
WEIGHT = "num-examples"  # Flower's strategies weight by this key
# The numbers a train reply carries (`fleet.round`'s metrics and privacy), always all of them:
# Flower's strategies refuse replies whose MetricRecords differ in keys. Absent ones are 0.
ROUND_METRICS = ("heldout_win_rate_before", "heldout_win_rate_after", "heldout_margin_before",
                 "heldout_margin_after", "train_loss", "users", "train_examples", "heldout_pairs")
PRIVACY = ("clip", "noise_multiplier", "delta", "epsilon", "rounds")

app = ClientApp()


def daemon_client(node_config: Mapping[str, Any]) -> Client:
    endpoint = node_config.get(ENDPOINT) or None
    # A round trains for seconds to minutes on the device: the SDK's default timeout would cut it.
    return Client(endpoint, timeout_s=float(node_config.get(ROUND_TIMEOUT, 1800.0)))


def lora_config(config: ConfigRecord) -> dict[str, Any]:
    return {"r": int(config["lora.r"]), "lora_alpha": float(config["lora.alpha"]),
            "target_modules": list(config["lora.targets"])}


def tensors(record: ArrayRecord) -> dict[str, np.ndarray]:
    return {key: array.numpy() for key, array in record.items()}


def round_config(config: ConfigRecord) -> dict[str, Any]:
    """The `fleet.round` training config from the server's ConfigRecord ("round.<name>" keys)."""
    return {key.removeprefix("round."): value for key, value in config.items() if key.startswith("round.")}


def train_reply_content(result: Mapping[str, Any]) -> RecordDict:
    """What leaves the device after a round: the (clipped, noised) delta as tensors, and numbers.
    Built from named fields only, so nothing else the daemon might add can ride along."""
    examples = int(result["num_examples"])
    delta = (result.get("delta") or {}) if examples > 0 else {}
    metrics: dict[str, float] = {WEIGHT: examples, "status": STATUS_CODES[result["status"]]}
    round_metrics, privacy = result.get("metrics") or {}, result.get("privacy") or {}
    metrics.update({f"metric.{k}": float(round_metrics.get(k) or 0.0) for k in ROUND_METRICS})
    metrics.update({f"privacy.{k}": float(privacy.get(k) or 0.0) for k in PRIVACY})
    arrays = ArrayRecord({key: Array(np.ascontiguousarray(value, dtype=np.float32))
                          for key, value in delta.items()})
    return RecordDict({"arrays": arrays, "metrics": MetricRecord(metrics)})


@app.train()
def train(msg: Message, context: Context) -> Message:
    config = msg.content["config"]
    server_round = int(config["server-round"])
    with daemon_client(context.node_config) as daemon:
        result = daemon.fleet_round(server_round, tensors(msg.content["arrays"]), lora_config(config),
                                    round_config(config))
    privacy = result.get("privacy") or {}
    # The device's owner sees the privacy spent, per round: the SuperNode's log has the
    # ClientApp's stdout (a logger here would need Flower's logging set up in its process).
    print(f"fleet round {server_round}: {result['status']}, {result['num_examples']} examples, "
          f"epsilon {privacy.get('epsilon')} (delta {privacy.get('delta')}) after "
          f"{privacy.get('rounds')} rounds", flush=True)
    return Message(train_reply_content(result), reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    config = msg.content["config"]
    # The same held-out split and cap as the round's, so candidate and current meet the same pairs.
    split = {k: v for k, v in round_config(config).items() if k in ("heldout_fraction", "max_pairs")}
    with daemon_client(context.node_config) as daemon:
        result = daemon.fleet_evaluate(tensors(msg.content["arrays"]), lora_config(config), split or None)
    metrics = {WEIGHT: int(result["num_examples"])}
    metrics.update({k: float(v) for k, v in (result.get("metrics") or {}).items()})
    return Message(RecordDict({"metrics": MetricRecord(metrics)}), reply_to=msg)


@app.query("publish")
def publish(msg: Message, context: Context) -> Message:
    """Serve the aggregate the server's held-out gate passed, if the aggregator signed it."""
    arrays = tensors(msg.content["arrays"])
    config = msg.content["config"]
    node = context.node_config
    server_round, run_id = int(config["server-round"]), str(config.get("run-id", ""))
    peft_config = json.loads(str(config["lora.peft-config"]))
    if node.get(DEV_UNSIGNED) is not True:
        key = node.get(AGGREGATOR_KEY)
        if not key:
            raise PublishRefused(f"no {AGGREGATOR_KEY} in this SuperNode's node config: a device "
                                 "publishes only an adapter its aggregator signed (docs/fleet.md)")
        if not run_id:
            raise PublishRefused("the publish instruction names no run id: a signature of the first format "
                                 "(round and tensors only) is refused")
        verify_publish(Path(str(key)), run_id, server_round, peft_config, arrays, config.get("signature", b""))
    staging = node.get(STAGING_DIR) or None
    with tempfile.TemporaryDirectory(prefix="fleet-publish-", dir=staging) as folder:
        write_peft_folder(Path(folder), arrays, peft_config)
        with daemon_client(node) as daemon:
            # The daemon refuses a round of this run at or below its last published one (a replay).
            published = daemon.fleet_publish(folder, operator_key(node), run_id=run_id or None,
                                             round=server_round if run_id else None)
    print(f"fleet round {config['server-round']}: published as fleet version {published['version']}",
          flush=True)
    return Message(RecordDict({"metrics": MetricRecord({"version": int(published["version"])})}),
                   reply_to=msg)


def operator_key(node_config: Mapping[str, Any]) -> str | None:
    """The daemon's operator key, read from the node config's file (or the default beside the
    staging dir); None when there is none to read (the daemon then refuses the publish)."""
    named = node_config.get(OPERATOR_KEY)
    staging = node_config.get(STAGING_DIR)
    path = Path(str(named)) if named else Path(str(staging)).parent / "fleet" / "operator.key" if staging else None
    try:
        return None if path is None else path.read_text().strip()
    except OSError:
        return None


def write_peft_folder(folder: Path, arrays: Mapping[str, np.ndarray], peft_config: Mapping[str, Any]) -> None:
    """`adapter_config.json` + `adapter_model.safetensors`, as `fleet.publish` reads them."""
    from safetensors.numpy import save_file

    (folder / "adapter_config.json").write_text(json.dumps(peft_config, indent=2, sort_keys=True))
    save_file({k: np.ascontiguousarray(v, dtype=np.float32) for k, v in arrays.items()},
              str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
