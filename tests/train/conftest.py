"""Fixtures for the training tests: a 4-layer tiny model (so layer groups can be cut several
ways), its tokenizer, and a few preference pairs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from edge_runtime.model.llama import LlamaModel
from edge_runtime.model.testing import make_tiny_model_dir
from edge_runtime.model.tokenizer import Tokenizer
from edge_runtime.model.weights import load_llama
from edge_runtime.train import PreferenceRecord
from tests.train.helpers import preference_records


@pytest.fixture(scope="session")
def tiny4_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny4"), num_layers=4)


@pytest.fixture(scope="session")
def tiny4(tiny4_dir: Path) -> LlamaModel:
    return load_llama(tiny4_dir, dtype=torch.float32)


@pytest.fixture(scope="session")
def tiny4_tokenizer(tiny4_dir: Path) -> Tokenizer:
    return Tokenizer(tiny4_dir)


@pytest.fixture
def pairs() -> list[PreferenceRecord]:
    return preference_records()
