"""Every adapter load refuses bad values (issue #29 item 6): a PEFT folder, a user's snapshot on
disk and the fleet's wire tensors with NaN weights, a rank or lora_alpha out of range (alpha =
Infinity emptied every answer) or shapes that do not fit, each with a typed error; what is served
does not change."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from daemon.sdk import RemoteError
from edge_runtime.lora import AdapterError, AdapterRegistry, LoraSettings, LoraWeights
from edge_runtime.lora.adapter import WEIGHTS_FILE, load_adapter, write_adapter
from edge_runtime.lora.config import MAX_ALPHA, MAX_RANK
from edge_runtime.model.config import ModelConfig
from tests.daemon.conftest import start_daemon, tiny_model  # noqa: F401 - fixtures
from tests.daemon.test_fleet_round import LORA, global_adapter


def peft_folder(folder: Path, cfg: ModelConfig, seed: int = 1) -> Path:
    weights = LoraWeights.init(cfg, LoraSettings(rank=4, alpha=8.0), seed=seed)
    for key, b in weights.b.items():
        weights.b[key] = torch.randn(b.shape, generator=torch.Generator().manual_seed(seed)) * 2
    folder.mkdir(parents=True)
    write_adapter(folder, weights)
    return folder


def set_config(folder: Path, **changes: object) -> None:
    path = folder / "adapter_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))  # json writes float("inf") as Infinity, as the attack did


def poison(folder: Path, value: float = float("nan")) -> None:
    state = load_file(str(folder / WEIGHTS_FILE))
    name = next(k for k in state if "lora_B" in k)
    state[name][0, 0] = value
    save_file(state, str(folder / WEIGHTS_FILE), metadata={"format": "pt"})


@pytest.mark.parametrize("breakage, says", [
    ({"lora_alpha": float("inf")}, "lora_alpha inf is outside"),
    ({"lora_alpha": 1e38}, "is outside (0,"),
    ({"lora_alpha": 0}, "is outside (0,"),
    ({"r": 0}, "rank must be >= 1"),
    ({"r": MAX_RANK + 1}, f"outside [1, {MAX_RANK}]"),
    ({"r": 4.5}, "r must be an integer"),
    ({"lora_alpha": "16"}, "lora_alpha must be a number"),
])
def test_a_peft_folder_with_rank_or_alpha_out_of_range_is_refused(tiny_model_dir: Path, tmp_path: Path,
                                                                  breakage: dict, says: str) -> None:
    cfg = ModelConfig.from_dir(tiny_model_dir)
    folder = peft_folder(tmp_path / "a", cfg)
    set_config(folder, **breakage)
    with pytest.raises(AdapterError) as info:
        load_adapter(folder, cfg)
    assert says in str(info.value)
    assert MAX_ALPHA == 4 * MAX_RANK


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_a_peft_folder_with_non_finite_weights_is_refused(tiny_model_dir: Path, tmp_path: Path, value: float) -> None:
    cfg = ModelConfig.from_dir(tiny_model_dir)
    folder = peft_folder(tmp_path / "a", cfg)
    poison(folder, value)
    with pytest.raises(AdapterError, match="not finite"):
        load_adapter(folder, cfg)


def test_a_users_snapshot_poisoned_on_disk_is_skipped_and_nan_is_never_published(tiny_model_dir: Path,
                                                                                  tmp_path: Path) -> None:
    cfg = ModelConfig.from_dir(tiny_model_dir)
    registry = AdapterRegistry(tmp_path / "adapters", cfg)
    good = LoraWeights.init(cfg, LoraSettings(rank=4), seed=1)
    registry.publish("alice", good)
    registry.publish("alice", LoraWeights.init(cfg, LoraSettings(rank=4), seed=2))
    poison(tmp_path / "adapters" / "alice" / "v2")
    again = AdapterRegistry(tmp_path / "adapters", cfg)
    assert again.newest("alice").version == 1  # v2 fails to load: the older good one is served
    assert any(e["kind"] == "load_failed" and "not finite" in e["error"] for e in again.events("alice"))
    bad = good.to()
    next(iter(bad.b.values()))[0, 0] = float("nan")
    with pytest.raises(AdapterError, match="not finite"):
        again.publish("alice", bad)
    with pytest.raises(AdapterError, match="lora_alpha"):
        again.publish("alice", LoraWeights(LoraSettings(rank=4, alpha=float("inf")), good.a, good.b))
    assert again.versions("alice") == [1]


def test_the_daemon_refuses_nan_and_infinite_alpha_fleet_adapters_and_keeps_serving_the_same(
        start_daemon: Callable, tiny_model: Path, tmp_path: Path) -> None:  # noqa: F811
    from tests.security.test_fleet_publish import operator_client, publish_folder

    cfg = ModelConfig.from_dir(tiny_model)
    d = start_daemon(extra_args=["--set", "finetune.enabled=false", "--set", "fleet.enabled=true"])
    nan_folder = peft_folder(publish_folder(d) / "nan", cfg)
    poison(nan_folder)
    alpha_folder = peft_folder(publish_folder(d) / "alpha", cfg)
    set_config(alpha_folder, lora_alpha=float("inf"))
    with operator_client(d) as c:
        before = c.generate("The fleet adapter changes", max_tokens=8, ignore_eos=True).text
        for folder, says in ((nan_folder, "not finite"), (alpha_folder, "lora_alpha")):
            with pytest.raises(RemoteError) as info:
                c.fleet_publish(str(folder))
            assert info.value.code == "bad_request" and says in info.value.message
        assert c.fleet_status()["serving"] is None
        assert c.generate("The fleet adapter changes", max_tokens=8, ignore_eos=True).text == before
        # The same through a round's wire tensors: NaN and an alpha past the limit.
        given = global_adapter(cfg)
        nan = {k: np.full(v.shape, np.nan, np.float32) for k, v in given.items()}
        for adapter, lora in ((nan, LORA), (given, {**LORA, "lora_alpha": 1e38})):
            with pytest.raises(RemoteError) as info:
                c.fleet_evaluate(adapter, lora)
            assert info.value.code == "bad_request" and info.value.param == "adapter"
