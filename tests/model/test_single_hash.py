"""A first start of a GGUF hashes the file once (to name its cache) and the cache it writes as it
writes it: no file is read back to hash it (#28: a 1B start re-hashed its 775 MiB cache); the
manifest's hashes are still the files' true sha256, which `verify` checks."""

from __future__ import annotations

import hashlib
import json

from edge_runtime.model import model_cache, source
from edge_runtime.model.block_cache import BLOCKS_FILE
from tests.model.quant_helpers import Q4_K_M_LIKE, private_cache, tiny_quant_gguf  # noqa: F401 (autouse fixture)


def test_a_first_start_hashes_the_gguf_once_and_reads_no_cache_file_back(tmp_path, monkeypatch):
    _, gguf = tiny_quant_gguf(tmp_path / "src", Q4_K_M_LIKE)
    hashed = []
    real = model_cache._sha256

    def counting(path):
        hashed.append(path.name)
        return real(path)

    monkeypatch.setattr(source, "_sha256", counting)
    resolved = source.resolve_model(gguf, cache_dir=tmp_path / "c", progress=False)
    assert hashed.count(gguf.name) == 1 and BLOCKS_FILE not in hashed
    files = json.loads((resolved.path / source.MANIFEST_NAME).read_text())["files"]
    for name, entry in files.items():
        assert entry["sha256"] == hashlib.sha256((resolved.path / name).read_bytes()).hexdigest(), name
    # A cached start hashes nothing; a verifying one checks every file against those hashes.
    hashed.clear()
    assert source.resolve_model(gguf, cache_dir=tmp_path / "c", progress=False).path == resolved.path
    assert hashed == []
    assert source.resolve_model(gguf, cache_dir=tmp_path / "c", progress=False, verify=True).path == resolved.path


def test_a_long_hash_logs_how_far_it_got(tmp_path, monkeypatch, caplog):
    path = tmp_path / "big.gguf"
    path.write_bytes(b"GGUF" + b"\0" * (3 << 22))  # four 4 MiB reads
    monkeypatch.setattr(model_cache, "PROGRESS_EVERY_S", 0.0)
    with caplog.at_level("INFO", logger=model_cache.__name__):
        assert model_cache._sha256(path) == hashlib.sha256(path.read_bytes()).hexdigest()
    lines = [r.getMessage() for r in caplog.records if "hashing big.gguf" in r.getMessage()]
    assert len(lines) == 4 and lines[-1].startswith("hashing big.gguf: 12 of 12 MiB (100%)")
