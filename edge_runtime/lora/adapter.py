"""PEFT-format adapter files: `adapter_config.json` + `adapter_model.safetensors`, written as an
immutable snapshot (edge_runtime.durable.publish_directory) so a crash leaves either the whole
version or nothing. Knows file layout and key names, not users or versions.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from edge_runtime.durable import TargetExists, publish_directory
from edge_runtime.lora.config import AdapterError, LoraSettings
from edge_runtime.lora.weights import Key, LoraWeights
from edge_runtime.model.config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
TEMP_PREFIX = ".tmp-"

_MODULE = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp",
           "qkv_proj": "self_attn", "gate_up_proj": "mlp"}  # Phi-3's fused modules
# PEFT saves without the adapter name ("default"); accept it too, and any wrapper prefix.
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+_proj)\.lora_([AB])(?:\.[\w-]+)?\.weight$")


def peft_key(layer: int, target: str, which: str) -> str:
    """The tensor name PEFT's `save_pretrained` writes for a llama-family causal LM."""
    return f"base_model.model.model.layers.{layer}.{_MODULE[target]}.{target}.lora_{which}.weight"


def to_state_dict(weights: LoraWeights) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for layer, target in weights.keys():
        state[peft_key(layer, target, "A")] = weights.a[(layer, target)].detach().float().contiguous().cpu()
        state[peft_key(layer, target, "B")] = weights.b[(layer, target)].detach().float().contiguous().cpu()
    return state


def parse_peft_key(name: str) -> tuple[Key, str]:
    """((layer, projection), "A" or "B") of a PEFT LoRA tensor name (with or without the
    adapter's name), or AdapterError."""
    m = _KEY.search(name)
    if m is None:
        raise AdapterError(f"adapter tensor {name!r} is not a LoRA A/B weight of a llama-family layer")
    return (int(m.group(1)), m.group(2)), m.group(3)


def from_state_dict(state: dict[str, torch.Tensor], settings: LoraSettings) -> LoraWeights:
    a: dict[Key, torch.Tensor] = {}
    b: dict[Key, torch.Tensor] = {}
    for name, tensor in state.items():
        key, which = parse_peft_key(name)
        (a if which == "A" else b)[key] = tensor
    return LoraWeights(settings, a, b)


def write_adapter(directory: Path, weights: LoraWeights, base_model: str = "") -> None:
    """Write the two PEFT files into an existing directory (`save_snapshot` makes them durable)."""
    config_path = directory / CONFIG_FILE
    config_path.write_text(json.dumps(weights.settings.to_peft_config(base_model), indent=2, sort_keys=True))
    save_file(to_state_dict(weights), str(directory / WEIGHTS_FILE), metadata={"format": "pt"})


def save_snapshot(target: Path, weights: LoraWeights, base_model: str = "") -> Path:
    """Atomically create `target` holding the adapter; refuses to overwrite (versions are immutable)."""
    target = Path(target)
    try:
        return publish_directory(target, lambda tmp: write_adapter(tmp, weights, base_model), TEMP_PREFIX)
    except TargetExists as exc:
        raise AdapterError(f"adapter snapshot {target} already exists; versions are immutable") from exc


def load_adapter(directory: Path, cfg: ModelConfig | None = None) -> LoraWeights:
    """Read a PEFT LoRA adapter directory (ours or any PEFT user's) and check it: rank and alpha
    within limits, values finite, and (given `cfg`) shapes that fit the model."""
    directory = Path(directory)
    config_path, weights_path = directory / CONFIG_FILE, directory / WEIGHTS_FILE
    if not config_path.is_file() or not weights_path.is_file():
        raise AdapterError(f"{directory} is not a complete PEFT adapter ({CONFIG_FILE} + {WEIGHTS_FILE})")
    try:
        config = json.loads(config_path.read_text())
        state = load_file(str(weights_path))
    except Exception as exc:  # safetensors raises its own SafetensorError, not an OSError
        raise AdapterError(f"cannot read adapter in {directory}: {exc}") from exc
    if not isinstance(config, dict):
        raise AdapterError(f"{directory / CONFIG_FILE} is not a JSON object")
    weights = from_state_dict(state, LoraSettings.from_peft_config(config))
    if cfg is not None:
        weights.check_shapes(cfg)
    weights.check_values()
    return weights


def remove_stale_temps(parent: Path) -> int:
    """Delete half-written snapshots a crash left behind; returns how many."""
    removed = 0
    if parent.is_dir():
        for child in parent.iterdir():
            if child.name.startswith(TEMP_PREFIX) and child.is_dir():
                shutil.rmtree(child, ignore_errors=True)
                removed += 1
    return removed
