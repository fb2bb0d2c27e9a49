"""Adapter registry: newest good version per user, pins, rollback that survives a restart, the
event log, and Chameleon's cost-aware cache eviction that never drops a pinned version."""

from __future__ import annotations

import pytest

from edge_runtime.errors import BadRequest
from edge_runtime.lora import AdapterError, AdapterRef, AdapterRegistry, LoraSettings
from edge_runtime.lora.adapter import WEIGHTS_FILE
from edge_runtime.lora.cache import AdapterCache
from tests.lora.helpers import random_adapter


def _publish(registry, user, n, rank=2):
    return [registry.publish(user, random_adapter(registry.model_cfg, LoraSettings(rank=rank), seed=i))
            for i in range(n)]


def test_versions_are_numbered_and_the_newest_is_served(tiny_model, tmp_path):
    registry = AdapterRegistry(tmp_path, tiny_model.cfg)
    refs = _publish(registry, "alice", 3)
    assert [r.version for r in refs] == [1, 2, 3]
    assert sorted(p.name for p in (tmp_path / "alice").iterdir() if p.is_dir()) == ["v1", "v2", "v3"]
    assert registry.newest("alice") == AdapterRef("alice", 3)
    assert registry.newest("bob") is None
    assert refs[2].key == "alice@3"


def test_restart_serves_newest_good_version_and_skips_broken_and_half_written(tiny_model, tmp_path):
    registry = AdapterRegistry(tmp_path, tiny_model.cfg)
    _publish(registry, "alice", 3)
    (tmp_path / "alice" / "v3" / WEIGHTS_FILE).write_bytes(b"not safetensors")  # corrupted on disk
    (tmp_path / "alice" / ".tmp-v4-0123abcd").mkdir()  # a crash mid-publish

    restarted = AdapterRegistry(tmp_path, tiny_model.cfg)
    assert restarted.preload() == {"alice": 2}
    assert not (tmp_path / "alice" / ".tmp-v4-0123abcd").exists()
    assert [e["kind"] for e in restarted.events("alice")][-1] == "load_failed"
    # Numbers are never reused, even past a broken version.
    assert restarted.publish("alice", random_adapter(tiny_model.cfg, LoraSettings(rank=2), seed=9)).version == 4


def test_pins_keep_a_version_cached_while_in_use(tiny_model):
    one = random_adapter(tiny_model.cfg, LoraSettings(rank=2), seed=0)
    registry = AdapterRegistry(None, tiny_model.cfg, cache_bytes=one.nbytes)  # room for one adapter
    registry.publish("alice", one)
    pinned = registry.acquire("alice")
    _publish(registry, "bob", 2)
    assert pinned in registry.cache  # over capacity rather than evicting what a request uses
    assert registry.pinned(pinned) == 1
    registry.release(pinned)
    registry.publish("carol", one)
    assert pinned not in registry.cache
    # Evicted from memory is not gone: it reloads on demand.
    assert registry.weights(pinned).settings.rank == 2
    with pytest.raises(ValueError, match="not pinned"):
        registry.release(pinned)


def test_rollback_retires_versions_durably(tiny_model, tmp_path):
    registry = AdapterRegistry(tmp_path, tiny_model.cfg)
    _publish(registry, "alice", 3)
    in_flight = registry.acquire("alice")
    assert registry.rollback("alice", reason="user asked") == AdapterRef("alice", 2)
    assert registry.pinned(in_flight) == 1  # running requests finish on the retired version
    with pytest.raises(AdapterError, match="not available"):
        registry.pin(AdapterRef("alice", 3))
    assert registry.rollback("alice", to_version=0) is None
    restarted = AdapterRegistry(tmp_path, tiny_model.cfg)
    assert restarted.newest("alice") is None
    assert (tmp_path / "alice" / "v3").is_dir()  # files stay; only serving stops
    kinds = [e["kind"] for e in restarted.events("alice")]
    assert kinds.count("rolled_back") == 2 and kinds.count("published") == 3


def test_bad_user_ids_are_refused(tiny_model, tmp_path):
    registry = AdapterRegistry(tmp_path, tiny_model.cfg)
    with pytest.raises(BadRequest):
        registry.acquire("../etc")
    (tmp_path / "not a user").mkdir()
    assert AdapterRegistry(tmp_path, tiny_model.cfg).users() == []


def test_chameleon_eviction_prefers_small_rare_stale_entries():
    now = [0.0]
    cache: AdapterCache[str, str] = AdapterCache(110, is_pinned=lambda k: k == "pinned", clock=lambda: now[0])
    cache.put("pinned", "p", 40)
    cache.put("big-popular", "b", 40)
    for _ in range(5):
        now[0] += 1
        cache.get("big-popular", lambda: ("x", 0))
    now[0] += 1
    cache.put("small-rare", "s", 10)
    now[0] += 1
    cache.put("newcomer", "n", 30)  # 120 bytes: one idle entry must go
    assert "small-rare" not in cache
    assert all(k in cache for k in ("pinned", "big-popular", "newcomer"))
    assert cache.resize(40) > 0 and "pinned" in cache and len(cache) == 1


def test_forget_erases_every_version_and_lets_in_flight_requests_finish(tiny_model, tmp_path):
    registry = AdapterRegistry(tmp_path, tiny_model.cfg)
    _publish(registry, "alice", 2)
    _publish(registry, "bob", 1)
    registry.rollback("alice")  # a retire marker on disk too
    in_flight = registry.acquire("alice")
    assert in_flight == AdapterRef("alice", 1)

    assert registry.forget("alice") == [1, 2]
    assert not (tmp_path / "alice").exists()
    assert registry.newest("alice") is None and registry.versions("alice") == []
    assert "alice" not in registry.users() and registry.events("alice") == []
    with pytest.raises(AdapterError):
        registry.pin(AdapterRef("alice", 2))
    # The request that started on alice@1 keeps its weights until it releases them.
    assert registry.weights(in_flight).settings.rank == 2
    # A new adapter after the erasure does not take the number still pinned.
    assert registry.publish("alice", random_adapter(tiny_model.cfg, LoraSettings(rank=2), seed=5)).version == 2
    registry.release(in_flight)
    assert in_flight not in registry.cache
    assert registry.newest("bob") == AdapterRef("bob", 1)  # other users untouched

    restarted = AdapterRegistry(tmp_path, tiny_model.cfg)
    assert restarted.versions("alice") == [2] and restarted.versions("bob") == [1]
