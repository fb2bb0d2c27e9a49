"""Helpers for the LoRA and training tests: adapters with non-zero B (a fresh adapter is the
identity, which would make every comparison pass trivially) and PEFT models to compare with."""

from __future__ import annotations

from pathlib import Path

import torch

from edge_runtime.lora import LoraSettings, LoraWeights
from edge_runtime.model.config import ModelConfig

ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def random_adapter(cfg: ModelConfig, settings: LoraSettings, seed: int, std: float = 0.05) -> LoraWeights:
    weights = LoraWeights.init(cfg, settings, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1000)
    for b in weights.b.values():
        b.copy_(torch.randn(b.shape, generator=gen) * std)
    return weights


def hf_model(model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=torch.float32)
    return model.eval()


def peft_model(model_dir: Path, adapter_dir: Path) -> torch.nn.Module:
    from peft import PeftModel

    return PeftModel.from_pretrained(hf_model(model_dir), str(adapter_dir)).eval()
