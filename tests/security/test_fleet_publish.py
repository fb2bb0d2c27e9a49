"""Who may change the fleet adapter every user is served beneath (issue #29 item 6), against a real
`maced`: publish and rollback are the operator's (a client without the operator key is refused),
publish reads only inside the publish folder, an aggregator's signature covers the run, the round
and the canonical PEFT config (lora_alpha = Infinity cannot ride on signed tensors), and a signed
round is published once (a replay, or an older round of the run, is refused)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict

from daemon.fleet.offdevice import client_app
from daemon.fleet.offdevice.signing import (
    PublishRefused,
    canonical_config,
    sign_publish,
    write_keypair,
)
from daemon.sdk import Client, RemoteError
from edge_runtime.lora import LoraSettings
from edge_runtime.model.config import ModelConfig
from tests.daemon.conftest import start_daemon, tiny_model  # noqa: F401 - fixtures
from tests.daemon.test_fleet_round import LORA, global_adapter
from tests.security.test_fleet_adapters import peft_folder

PEFT = LoraSettings(rank=LORA["r"], alpha=LORA["lora_alpha"]).to_peft_config()


def publish_folder(d) -> Path:  # type: ignore[no-untyped-def]
    """The folder fleet.publish reads from: <state>/fleet-staging by default."""
    return d.state_dir / "fleet-staging"


def operator_key(d) -> str:  # type: ignore[no-untyped-def]
    return (d.state_dir / "fleet" / "operator.key").read_text().strip()


class OperatorClient(Client):
    """A client that holds the operator key (as `macectl` run as the service's user does)."""

    def __init__(self, endpoint: str, key: str, **kw: object) -> None:
        super().__init__(endpoint, **kw)  # type: ignore[arg-type]
        self.key = key

    def fleet_publish(self, path: str, operator_key: str | None = None, **kw: object) -> dict:  # type: ignore[override]
        return super().fleet_publish(path, operator_key or self.key, **kw)  # type: ignore[arg-type]

    def fleet_rollback(self, version: int | None = None, operator_key: str | None = None) -> dict:
        return super().fleet_rollback(version, operator_key or self.key)


def operator_client(d) -> OperatorClient:  # type: ignore[no-untyped-def]
    return OperatorClient(d.endpoint, operator_key(d), timeout_s=60)


def test_publish_and_rollback_from_a_non_operator_are_refused(start_daemon: Callable,  # noqa: F811
                                                               tiny_model: Path) -> None:  # noqa: F811
    d = start_daemon(extra_args=["--set", "finetune.enabled=false"])
    folder = peft_folder(publish_folder(d) / "v1", ModelConfig.from_dir(tiny_model))
    key_file = d.state_dir / "fleet" / "operator.key"
    assert key_file.stat().st_mode & 0o777 == 0o600
    with d.client() as app:
        for key in (None, "0" * 64):
            with pytest.raises(RemoteError) as info:
                app.fleet_publish(str(folder), key)
            assert info.value.code == "forbidden" and info.value.param == "operator_key"
        assert app.fleet_status()["serving"] is None
    with operator_client(d) as operator:
        assert operator.fleet_publish(str(folder))["version"] == 1
    with d.client() as app:
        with pytest.raises(RemoteError) as info:
            app.fleet_rollback()
        assert info.value.code == "forbidden"
        assert app.fleet_status()["serving"] == 1


def test_publish_reads_only_inside_the_publish_folder(start_daemon: Callable, tiny_model: Path,  # noqa: F811
                                                      tmp_path: Path) -> None:
    d = start_daemon(extra_args=["--set", "finetune.enabled=false"])
    cfg = ModelConfig.from_dir(tiny_model)
    outside = peft_folder(tmp_path / "elsewhere", cfg)
    link = publish_folder(d) / "link"
    link.symlink_to(outside)
    with operator_client(d) as c:
        for path in (outside, link, publish_folder(d) / ".." / "adapters", publish_folder(d)):
            with pytest.raises(RemoteError) as info:
                c.fleet_publish(str(path))
            assert info.value.code == "forbidden" and info.value.param == "path", path
        assert c.fleet_status()["serving"] is None


def publish_message(arrays: dict[str, np.ndarray], run_id: str, server_round: int, peft: dict,
                    signature: bytes) -> Message:
    config = ConfigRecord({"server-round": server_round, "run-id": run_id,
                           "lora.peft-config": canonical_config(peft), "signature": signature})
    content = RecordDict({"arrays": ArrayRecord({k: Array(v) for k, v in arrays.items()}), "config": config})
    return Message(content, dst_node_id=1, message_type="query.publish")


def device(d, public: Path) -> Context:  # type: ignore[no-untyped-def]
    """The device's SuperNode as `mace-fleet join` configures it beside this daemon."""
    node = {"maced-endpoint": d.endpoint, "aggregator-key": str(public), "staging-dir": str(publish_folder(d))}
    return Context(run_id=1, node_id=1, node_config=node, state=RecordDict(), run_config={})


def test_a_replayed_signed_round_is_refused(start_daemon: Callable, tiny_model: Path,  # noqa: F811
                                            tmp_path: Path) -> None:
    d = start_daemon(extra_args=["--set", "finetune.enabled=false"])
    private, public = tmp_path / "aggregator.key", tmp_path / "aggregator.pub"
    write_keypair(private, public)
    arrays = global_adapter(ModelConfig.from_dir(tiny_model))
    signed = {r: publish_message(arrays, "run-7", r, PEFT, sign_publish(private, "run-7", r, PEFT, arrays))
              for r in (2, 3, 4)}
    ctx = device(d, public)
    client_app.publish(signed[3], ctx)
    for replay in (signed[3], signed[2]):  # the same round again, an older round of the run
        with pytest.raises(RemoteError) as info:
            client_app.publish(replay, ctx)
        assert info.value.code == "bad_request" and "replay" in info.value.message
    with d.client() as c:
        assert [v["version"] for v in c.fleet_status()["versions"]] == [1]
    client_app.publish(signed[4], ctx)  # the next round goes on
    d.stop()
    again = start_daemon(extra_args=["--set", "finetune.enabled=false", "--state-dir", str(d.state_dir)])
    with pytest.raises(RemoteError, match="replay"):  # the record outlives a restart
        client_app.publish(signed[4], Context(run_id=1, node_id=1, node_config={
            **ctx.node_config, "maced-endpoint": again.endpoint}, state=RecordDict(), run_config={}))


def test_the_signature_covers_the_config_and_an_out_of_range_alpha_is_never_served(
        start_daemon: Callable, tiny_model: Path, tmp_path: Path) -> None:  # noqa: F811
    d = start_daemon(extra_args=["--set", "finetune.enabled=false"])
    private, public = tmp_path / "aggregator.key", tmp_path / "aggregator.pub"
    write_keypair(private, public)
    arrays = global_adapter(ModelConfig.from_dir(tiny_model))
    ctx = device(d, public)
    # Signed tensors with the config swapped on the way (the attack of issue #29): refused.
    honest = sign_publish(private, "run-1", 1, PEFT, arrays)
    with pytest.raises(PublishRefused, match="does not match"):
        client_app.publish(publish_message(arrays, "run-1", 1, {**PEFT, "lora_alpha": 1e38}, honest), ctx)
    with pytest.raises(PublishRefused, match="not plain JSON"):
        sign_publish(private, "run-1", 1, {**PEFT, "lora_alpha": float("inf")}, arrays)
    # Infinity in the config the device receives cannot even be read as the signed config.
    message = publish_message(arrays, "run-1", 1, PEFT, honest)
    message.content["config"]["lora.peft-config"] = canonical_config(PEFT).replace('"lora_alpha":8.0',
                                                                                  '"lora_alpha":Infinity')
    with pytest.raises(PublishRefused, match="not plain JSON"):
        client_app.publish(message, ctx)
    # Even the aggregator's own key cannot get an alpha past the limit served.
    huge = {**PEFT, "lora_alpha": 1e38}
    with pytest.raises(RemoteError) as info:
        client_app.publish(publish_message(arrays, "run-1", 2, huge, sign_publish(private, "run-1", 2, huge, arrays)),
                           ctx)
    assert info.value.code == "bad_request" and "lora_alpha" in info.value.message
    nan = {k: np.full_like(v, np.nan) for k, v in arrays.items()}
    with pytest.raises(RemoteError, match="not finite"):
        client_app.publish(publish_message(nan, "run-1", 3, PEFT, sign_publish(private, "run-1", 3, PEFT, nan)), ctx)
    with d.client() as c:
        assert c.fleet_status()["serving"] is None
