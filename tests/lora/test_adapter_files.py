"""PEFT-format adapter files: our snapshots load in PEFT with the same outputs, PEFT's own
adapters load in our forward, and snapshots are immutable and atomic."""

from __future__ import annotations

import json

import pytest
import torch

from edge_runtime.lora import AdapterError, LoraSettings, LoraWeights
from edge_runtime.lora.adapter import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    load_adapter,
    remove_stale_temps,
    save_snapshot,
)
from edge_runtime.model.dense import dense_logits
from tests.lora.helpers import ALL_LINEAR, hf_model, peft_model, random_adapter


def test_snapshot_round_trip_loads_in_peft_with_identical_logits(tiny_model, tiny_model_dir, tmp_path):
    settings = LoraSettings(rank=4, alpha=8, target_modules=ALL_LINEAR)
    weights = random_adapter(tiny_model.cfg, settings, seed=3)
    path = save_snapshot(tmp_path / "alice" / "v1", weights, base_model=str(tiny_model_dir))

    assert sorted(p.name for p in path.iterdir()) == [CONFIG_FILE, WEIGHTS_FILE]
    loaded = load_adapter(path, tiny_model.cfg)
    assert loaded.settings == settings
    for key in weights.keys():
        assert torch.equal(loaded.a[key], weights.a[key]) and torch.equal(loaded.b[key], weights.b[key])

    ids = torch.tensor([[1, 40, 41, 42, 43, 44, 45, 46]])
    with torch.no_grad():
        theirs = peft_model(tiny_model_dir, path)(input_ids=ids).logits
        ours = dense_logits(tiny_model, ids, lora=loaded)
        base = dense_logits(tiny_model, ids)
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    assert (ours - base).abs().max() > 1e-3  # the adapter really changes the output


def test_adapter_saved_by_peft_loads_into_our_forward(tiny_model, tiny_model_dir, tmp_path):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(hf_model(tiny_model_dir), LoraConfig(
        r=2, lora_alpha=6, target_modules=["q_proj", "v_proj", "down_proj"], task_type="CAUSAL_LM"))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05)
    model.save_pretrained(tmp_path / "peft")

    loaded = load_adapter(tmp_path / "peft", tiny_model.cfg)
    assert loaded.settings == LoraSettings(rank=2, alpha=6, target_modules=("q_proj", "v_proj", "down_proj"))
    ids = torch.tensor([[1, 50, 60, 70, 80]])
    with torch.no_grad():
        torch.testing.assert_close(dense_logits(tiny_model, ids, lora=loaded), model.eval()(input_ids=ids).logits,
                                   rtol=1e-4, atol=1e-4)


def test_snapshot_refuses_to_overwrite_a_version(tiny_model, tmp_path):
    weights = LoraWeights.init(tiny_model.cfg, LoraSettings(rank=2))
    save_snapshot(tmp_path / "v1", weights)
    with pytest.raises(AdapterError, match="immutable"):
        save_snapshot(tmp_path / "v1", weights)


def test_failed_snapshot_leaves_no_version_and_no_temp(tiny_model, tmp_path, monkeypatch):
    import edge_runtime.lora.adapter as adapter

    def broken_save(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(adapter, "save_file", broken_save)
    with pytest.raises(OSError, match="disk full"):
        save_snapshot(tmp_path / "v1", LoraWeights.init(tiny_model.cfg, LoraSettings(rank=2)))
    assert list(tmp_path.iterdir()) == []


def test_stale_temp_from_a_crash_is_removed(tmp_path):
    (tmp_path / ".tmp-v3-deadbeef").mkdir()
    (tmp_path / ".tmp-v3-deadbeef" / CONFIG_FILE).write_text("{}")
    (tmp_path / "v2").mkdir()
    assert remove_stale_temps(tmp_path) == 1
    assert [p.name for p in tmp_path.iterdir()] == ["v2"]


@pytest.mark.parametrize("change, message", [
    ({"use_dora": True}, "use_dora"),
    ({"target_modules": "q_proj|v_proj"}, "regex"),
    ({"peft_type": "IA3"}, "only LORA"),
])
def test_unsupported_peft_configs_are_refused_with_the_reason(tiny_model, tmp_path, change, message):
    weights = LoraWeights.init(tiny_model.cfg, LoraSettings(rank=2))
    path = save_snapshot(tmp_path / "v1", weights)
    config = json.loads((path / CONFIG_FILE).read_text())
    config.update(change)
    (path / CONFIG_FILE).write_text(json.dumps(config))
    with pytest.raises(AdapterError, match=message):
        load_adapter(path, tiny_model.cfg)


def test_adapter_for_another_model_shape_is_refused(tiny_model, tmp_path):
    weights = LoraWeights.init(tiny_model.cfg, LoraSettings(rank=2))
    weights.a[(0, "q_proj")] = torch.zeros(2, 7)
    path = save_snapshot(tmp_path / "v1", weights)
    with pytest.raises(AdapterError, match="shapes"):
        load_adapter(path, tiny_model.cfg)


def test_bad_settings_are_refused():
    with pytest.raises(AdapterError, match="rank"):
        LoraSettings(rank=0)
    with pytest.raises(AdapterError, match="target modules"):
        LoraSettings(target_modules=("lm_head",))
    assert LoraSettings(target_modules=("v_proj", "q_proj")).target_modules == ("q_proj", "v_proj")
