"""Fixtures shared by every test folder: a tiny random llama (fast tests) and the default model
(slow tests; `make test` fetches it first, so it is never downloaded inside a test)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from edge_runtime.model.testing import make_tiny_model_dir

    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    from edge_runtime.model.source import resolve_model

    return Path(resolve_model(None).path)
