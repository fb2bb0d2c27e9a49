"""A GGUF's header is parsed once for the several readers of one start (issue #28: an 8B file's
vocabulary takes seconds each time), and read again once the file changes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from edge_runtime.model import gguf_config
from edge_runtime.model.testing import make_tiny_gguf, make_tiny_model_dir


def test_the_last_header_is_reused_until_the_file_changes(tmp_path: Path) -> None:
    model = make_tiny_model_dir(tmp_path / "m")
    path = make_tiny_gguf(model, tmp_path / "a.gguf")
    first = gguf_config.read_header(path)
    assert gguf_config.read_header(str(path)) is first
    stat = os.stat(path)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    again = gguf_config.read_header(path)
    assert again is not first and again.metadata.keys() == first.metadata.keys()
    other = make_tiny_gguf(model, tmp_path / "b.gguf", quantize=False)
    assert gguf_config.read_header(other) is not again


def test_an_unreadable_file_is_still_refused(tmp_path: Path) -> None:
    from edge_runtime.errors import ModelNotAvailable

    with pytest.raises(ModelNotAvailable):
        gguf_config.read_header(tmp_path / "missing.gguf")
