"""Fixtures for the LoRA tests: the tiny model as our fused forward and its tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from edge_runtime.model.llama import LlamaModel
from edge_runtime.model.tokenizer import Tokenizer
from edge_runtime.model.weights import load_llama


@pytest.fixture(scope="session")
def tiny_model(tiny_model_dir: Path) -> LlamaModel:
    return load_llama(tiny_model_dir, dtype=torch.float32)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer(tiny_model_dir)
