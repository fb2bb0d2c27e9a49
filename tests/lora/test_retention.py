"""Adapter versions do not pile up: a publish leaves the newest `keep_versions` on disk plus any
version rolled back to or in use, older versions leave the cache once superseded, a trimmed
version is refused with its own typed error (also after a restart), and erasure still removes
everything (docs/training.md, "Retention")."""

from __future__ import annotations

import pytest

from edge_runtime.lora import AdapterRef, AdapterRegistry, LoraSettings
from edge_runtime.lora.config import AdapterTrimmed
from tests.lora.helpers import random_adapter

K = 3


def _publish(registry, user, n, start=0):
    return [registry.publish(user, random_adapter(registry.model_cfg, LoraSettings(rank=2), seed=start + i))
            for i in range(n)]


def _on_disk(root, user):
    return sorted(int(p.name[1:]) for p in (root / user).iterdir() if p.is_dir() and p.name.startswith("v"))


def test_k_plus_three_publishes_leave_the_newest_k_on_disk(tiny_model, tmp_path):
    registry = AdapterRegistry(tmp_path, tiny_model.cfg, keep_versions=K)
    _publish(registry, "alice", K + 3)
    _publish(registry, "bob", 2)
    assert _on_disk(tmp_path, "alice") == [4, 5, 6] and registry.versions("alice") == [4, 5, 6]
    assert _on_disk(tmp_path, "bob") == [1, 2]  # per user
    trimmed = [e["versions"] for e in registry.events("alice") if e["kind"] == "trimmed"]
    assert trimmed == [[1], [2], [3]]
    # A restart reads the same and keeps numbering after the highest.
    restarted = AdapterRegistry(tmp_path, tiny_model.cfg, keep_versions=K)
    assert restarted.versions("alice") == [4, 5, 6]
    assert _publish(restarted, "alice", 1)[0].version == 7
    assert _on_disk(tmp_path, "alice") == [5, 6, 7]


def test_a_version_in_use_is_kept_until_released_then_trimmed(tiny_model, tmp_path):
    registry = AdapterRegistry(tmp_path, tiny_model.cfg, keep_versions=K)
    _publish(registry, "alice", 1)
    pinned = registry.acquire("alice")  # a request runs on v1
    _publish(registry, "alice", K + 2, start=1)
    assert 1 in _on_disk(tmp_path, "alice") and pinned in registry.cache
    assert registry.weights(pinned) is not None  # the request can still read it
    registry.release(pinned)
    _publish(registry, "alice", 1, start=9)
    assert _on_disk(tmp_path, "alice") == [5, 6, 7]
    assert pinned not in registry.cache


def test_a_rolled_back_to_version_is_kept_and_a_trimmed_one_is_refused(tiny_model, tmp_path):
    registry = AdapterRegistry(tmp_path, tiny_model.cfg, keep_versions=K)
    _publish(registry, "alice", 3)
    assert registry.rollback("alice", 2).version == 2  # v3 retired
    _publish(registry, "alice", K + 3, start=3)  # v4..v9
    assert _on_disk(tmp_path, "alice") == [2, 7, 8, 9]  # retired v3 and old v1, v4..v6 gone
    assert registry.versions("alice") == [2, 7, 8, 9]
    assert registry.rollback("alice", 2).version == 2  # still possible
    for reg in (registry, AdapterRegistry(tmp_path, tiny_model.cfg, keep_versions=K)):
        with pytest.raises(AdapterTrimmed, match=r"alice@5 was removed by the retention policy"):
            reg.rollback("alice", 5)
        with pytest.raises(AdapterTrimmed, match=r"versions kept for 'alice': \[2\]"):
            reg.pin(AdapterRef("alice", 1))
    assert AdapterTrimmed.code == "adapter_trimmed"


def test_superseded_versions_leave_the_cache_so_its_bytes_stay_bounded(tiny_model):
    registry = AdapterRegistry(None, tiny_model.cfg, keep_versions=K)
    refs = _publish(registry, "alice", 12) + _publish(registry, "bob", 12)
    one = registry.weights(refs[-1]).nbytes
    assert set(registry.cache.keys()) == {refs[11], refs[-1]}  # the newest of each user
    assert registry.cache.nbytes == 2 * one
    # A request naming an older kept version loads it again; it goes at the next publish.
    old = registry.pin(AdapterRef("alice", 11))
    registry.release(old)
    assert old in registry.cache
    _publish(registry, "alice", 1, start=50)
    assert old not in registry.cache and registry.cache.nbytes == 2 * one


def test_without_keep_versions_nothing_is_trimmed(tiny_model, tmp_path):
    registry = AdapterRegistry(tmp_path, tiny_model.cfg)
    _publish(registry, "alice", 7)
    assert _on_disk(tmp_path, "alice") == list(range(1, 8))
    assert registry.trim("alice", 2) == [1, 2, 3, 4, 5]  # explicit trims still work
    with pytest.raises(ValueError):
        AdapterRegistry(None, tiny_model.cfg, keep_versions=0)


def test_erasure_removes_every_version_and_numbering_restarts(tiny_model, tmp_path):
    registry = AdapterRegistry(tmp_path, tiny_model.cfg, keep_versions=K)
    _publish(registry, "alice", K + 3)
    registry.rollback("alice", 5)
    assert registry.forget("alice") == list(range(1, K + 4))
    assert not (tmp_path / "alice").exists() and registry.versions("alice") == []
    assert _publish(registry, "alice", 1)[0].version == 1  # no trimmed or kept numbers linger
    assert registry.pin(AdapterRef("alice", 1))
