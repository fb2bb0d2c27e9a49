"""Per-user adapter versions: `<root>/<user_id>/v<N>/` PEFT snapshots, the newest good one per
user, pins that keep the version an in-flight request started with, retire (rollback) markers,
an event log, the in-memory cache of loaded versions and the retention that trims old versions
(`keep_versions`: the newest k, any rolled back to, any pinned; docs/training.md). The fleet adapter, shared by every
user of the device, is one more owner under the reserved name `FLEET` (`<root>/+fleet/v<N>/`,
outside the user-id alphabet), versioned, pinned and rolled back like a user's; a request served
both is given one LoRA of the two ranks concatenated (`served_weights`).

Knows nothing of training or scheduling. With `root=None` versions live only in memory (tests,
benchmarks). Thread-safe: the trainer may publish while the engine thread looks versions up.
"""

from __future__ import annotations

import json
import re
import shutil
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from edge_runtime import durable
from edge_runtime.errors import BadRequest
from edge_runtime.ids import validate_user_id
from edge_runtime.lora.adapter import load_adapter, remove_stale_temps, save_snapshot
from edge_runtime.lora.cache import AdapterCache
from edge_runtime.lora.config import AdapterError, AdapterTrimmed
from edge_runtime.lora.weights import LoraWeights, concat_ranks
from edge_runtime.model.config import ModelConfig

_VERSION_DIR = re.compile(r"^v(\d+)$")
RETIRED_FILE = "retired.json"
EVENTS_FILE = "events.jsonl"
# The fleet adapter's owner name: '+' is not in the user-id alphabet (edge_runtime/ids.py), so no
# user can own it, and "+fleet@N" never equals a user's "name@N" in prefix-cache salts.
FLEET = "+fleet"


@dataclass(frozen=True, order=True)
class AdapterRef:
    """One immutable adapter version of one user."""

    user: str
    version: int

    @property
    def key(self) -> str:
        """"user@version": salts the prefix cache, so KV blocks never mix adapter versions."""
        return f"{self.user}@{self.version}"


@dataclass(frozen=True)
class ServedAdapter:
    """What one request's rows are computed with: the fleet version (beneath) and the user's
    version, either None. Both are pinned by the request; equal values share one batch group."""

    fleet: AdapterRef | None
    user: AdapterRef | None

    @property
    def key(self) -> str:
        """Salts the prefix cache: the same tokens under another fleet version are other keys."""
        return "+".join(r.key for r in (self.fleet, self.user) if r is not None)

    @property
    def parts(self) -> tuple[AdapterRef, ...]:
        return tuple(r for r in (self.fleet, self.user) if r is not None)


class AdapterRegistry:
    def __init__(
        self,
        root: str | Path | None,
        model_cfg: ModelConfig,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        cache_bytes: int = 256 << 20,
        base_model: str = "",
        keep_versions: int | None = None,
    ) -> None:
        """`keep_versions`: how many of an owner's newest versions a publish leaves (None: all)."""
        self.root = Path(root) if root is not None else None
        self.keep_versions: int | None = None
        self.set_retention(keep_versions)
        self.model_cfg = model_cfg
        self.dtype = dtype
        self.device = torch.device(device)
        self.base_model = base_model
        self._lock = threading.RLock()
        self._versions: dict[str, list[int]] = {}  # usable versions, ascending
        self._highest: dict[str, int] = {}  # every number ever used (retired and bad included)
        self._retired: dict[str, set[int]] = {}
        self._bad: set[AdapterRef] = set()
        self._memory: dict[AdapterRef, LoraWeights] = {}  # the only copy when root is None
        self._events: dict[str, list[dict[str, Any]]] = {}
        self._pins: Counter[AdapterRef] = Counter()
        self._forgotten: set[AdapterRef] = set()  # erased, still pinned by in-flight requests
        self._trimmed: dict[str, set[int]] = {}  # removed by retention: a clear error, not "unknown"
        self._rolled_back_to: dict[str, set[int]] = {}  # versions a rollback made served: kept
        # Keys: a version (AdapterRef), or a fleet+user composition (ServedAdapter), pinned
        # while both its versions are.
        self.cache: AdapterCache[AdapterRef | ServedAdapter, LoraWeights] = AdapterCache(
            cache_bytes, is_pinned=self._is_pinned
        )
        if self.root is not None:
            self.scan()

    # -- discovery ---------------------------------------------------------------------------

    def scan(self) -> None:
        """Read `<root>/<user>/v<N>/` folders; drop half-written temps a crash left behind."""
        if self.root is None or not self.root.is_dir():
            return
        with self._lock:
            for user_dir in sorted(self.root.iterdir()):
                if not user_dir.is_dir() or not (user_dir.name == FLEET or _is_user_id(user_dir.name)):
                    continue  # not a user's folder (a temp, or something a person put there)
                user = user_dir.name
                remove_stale_temps(user_dir)
                numbers = sorted(int(m.group(1)) for c in user_dir.iterdir() if c.is_dir() and (m := _VERSION_DIR.match(c.name)))
                retired = self._read_retired(user_dir)
                self._retired[user] = retired
                self._highest[user] = max(numbers, default=0)
                self._versions[user] = [n for n in numbers if n not in retired]
                # Numbers below the highest without a folder were trimmed (an erasure removes the
                # whole user folder, so numbering never has gaps otherwise).
                self._trimmed[user] = set(range(1, self._highest[user] + 1)) - set(numbers)
                self._rolled_back_to[user] = {int(e["serving"]) for e in self.events(user)
                                              if e.get("kind") == "rolled_back" and e.get("serving")}

    def users(self) -> list[str]:
        """Users with a served version (the fleet is not a user)."""
        with self._lock:
            return sorted(u for u, v in self._versions.items() if v and u != FLEET)

    def versions(self, user: str) -> list[int]:
        with self._lock:
            return [n for n in self._versions.get(user, []) if AdapterRef(user, n) not in self._bad]

    def newest(self, user: str) -> AdapterRef | None:
        """The newest version of `user` that loads; a version that fails is marked bad, recorded
        as an event, and the next older one is tried."""
        _validate_owner(user)
        with self._lock:
            for number in reversed(self.versions(user)):
                ref = AdapterRef(user, number)
                try:
                    self.weights(ref)
                except AdapterError as exc:
                    self._bad.add(ref)
                    self.record_event(user, "load_failed", version=number, error=str(exc))
                    continue
                return ref
            return None

    def preload(self) -> dict[str, int]:
        """Load each user's and the fleet's newest good version (at start-up); returns owner -> version."""
        loaded = {}
        for user in [*self.users(), FLEET]:
            ref = self.newest(user)
            if ref is not None:
                loaded[user] = ref.version
        return loaded

    def path(self, ref: AdapterRef) -> Path | None:
        return None if self.root is None else self.root / ref.user / f"v{ref.version}"

    # -- pins: requests keep the version they started with -------------------------------------

    def acquire(self, user: str) -> AdapterRef | None:
        """Pin and return the user's newest version (None: the user has none, use the base)."""
        with self._lock:
            ref = self.newest(user)
            if ref is not None:
                self._pins[ref] += 1
            return ref

    def pin(self, ref: AdapterRef) -> AdapterRef:
        """Pin a specific version (it must be served: not retired, not bad) and load it."""
        _validate_owner(ref.user)
        with self._lock:
            if ref.version not in self.versions(ref.user):
                served = self.versions(ref.user)
                self._refuse_trimmed(ref.user, ref.version)
                raise AdapterError(f"adapter {ref.key} is not available (versions served for "
                                   f"{ref.user!r}: {served or 'none'})")
            self.weights(ref)
            self._pins[ref] += 1
            return ref

    def release(self, ref: AdapterRef | None) -> None:
        if ref is None:
            return
        with self._lock:
            if self._pins[ref] <= 0:
                raise ValueError(f"adapter {ref.key} is not pinned")
            self._pins[ref] -= 1
            if self._pins[ref] == 0:
                del self._pins[ref]
                if ref in self._forgotten:  # its user was erased while this request ran
                    self._forgotten.discard(ref)
                    self._discard_cached(ref)

    def pinned(self, ref: AdapterRef) -> int:
        with self._lock:
            return self._pins[ref]

    # -- weights -----------------------------------------------------------------------------

    def weights(self, ref: AdapterRef) -> LoraWeights:
        """The version's tensors in the engine's dtype/device (from the cache, loaded on a miss)."""
        with self._lock:
            return self.cache.get(ref, lambda: self._load(ref))

    def served_weights(self, served: ServedAdapter) -> LoraWeights:
        """The one LoRA a request's rows get: its fleet or user version alone, or both as one
        adapter of the two ranks concatenated (built once per pair of versions, cached like a
        version and kept while a request pins both)."""
        parts = served.parts
        if not parts:
            raise ValueError("a request without fleet and user adapter runs on the base model")
        if len(parts) == 1:
            return self.weights(parts[0])
        with self._lock:
            return self.cache.get(served, lambda: _sized(concat_ranks([self.weights(r) for r in parts])))

    def _is_pinned(self, key: AdapterRef | ServedAdapter) -> bool:
        if isinstance(key, ServedAdapter):
            return all(self._pins[r] > 0 for r in key.parts)
        return self._pins[key] > 0

    def _discard_cached(self, ref: AdapterRef) -> None:
        """Drop a version and every composition holding it from the cache."""
        self.cache.discard(ref)
        for key in self.cache.keys():
            if isinstance(key, ServedAdapter) and ref in key.parts:
                self.cache.discard(key)

    def _load(self, ref: AdapterRef) -> tuple[LoraWeights, int]:
        if ref in self._memory:
            source = self._memory[ref]
        else:
            path = self.path(ref)
            if path is None:
                raise AdapterError(f"adapter {ref.key} does not exist")
            source = load_adapter(path, self.model_cfg)
        weights = source.to(self.dtype, self.device)
        return weights, weights.nbytes

    # -- publishing and rollback -------------------------------------------------------------

    def publish(self, user: str, weights: LoraWeights, **info: Any) -> AdapterRef:
        """Write `weights` as the user's next version (atomic snapshot) and make it the newest."""
        _validate_owner(user)
        weights.validate(self.model_cfg)  # nothing changes unless the adapter can be served
        with self._lock:
            ref = AdapterRef(user, self._highest.get(user, 0) + 1)
            while ref in self._forgotten:  # numbering restarted after an erasure: skip live pins
                ref = AdapterRef(user, ref.version + 1)
            path = self.path(ref)
            if path is None:
                self._memory[ref] = weights.to(torch.float32, "cpu")
            else:
                save_snapshot(path, weights, self.base_model)
            self._highest[user] = ref.version
            self._versions.setdefault(user, []).append(ref.version)
            cached = weights.to(self.dtype, self.device)
            self.cache.put(ref, cached, cached.nbytes)
            self.record_event(user, "published", version=ref.version, **info)
            self._drop_superseded(user)
            if self.keep_versions is not None:
                self.trim(user, self.keep_versions)
            return ref

    def set_retention(self, keep_versions: int | None) -> None:
        """How many newest versions each publish leaves from now on (None: all)."""
        if keep_versions is not None and keep_versions < 1:
            raise ValueError("keep_versions must be >= 1 (or None to keep every version)")
        self.keep_versions = keep_versions

    def _drop_superseded(self, user: str) -> None:
        """Older versions leave the cache once a newer one is served, unless a request pins them:
        new requests get the newest, so an idle older version would only hold memory (a request
        that names it loads it again; the ledger sheds it like any idle adapter)."""
        newest = max(self._versions.get(user, []), default=None)
        for key in self.cache.keys():
            parts = key.parts if isinstance(key, ServedAdapter) else (key,)
            if (any(r.user == user and r.version != newest for r in parts)
                    and not self._is_pinned(key)):
                self.cache.discard(key)

    def trim(self, user: str, keep: int) -> list[int]:
        """Retention: remove `user`'s versions (files, cache, records) except the newest `keep`
        served ones, any version a rollback made served, and any a request pins (those wait for
        a later trim). Retired versions beyond them go too (they are never served again).
        Returns the versions removed; each is then refused with `AdapterTrimmed`."""
        if keep < 1:
            raise ValueError("keep must be >= 1")
        _validate_owner(user)
        with self._lock:
            served = self._versions.get(user, [])
            protected = set(served[-keep:]) | self._rolled_back_to.get(user, set())
            on_record = set(served) | self._retired.get(user, set())
            removed = sorted(n for n in on_record - protected if self._pins[AdapterRef(user, n)] == 0)
            if not removed:
                return []
            for number in removed:
                ref = AdapterRef(user, number)
                if number in served:
                    served.remove(number)
                self._retired.get(user, set()).discard(number)
                self._memory.pop(ref, None)
                self._bad.discard(ref)
                self._discard_cached(ref)
                path = self.path(ref)
                if path is not None and path.exists():
                    shutil.rmtree(path)
                self._trimmed.setdefault(user, set()).add(number)
            if user in self._retired:
                self._write_retired(user)
            self.record_event(user, "trimmed", versions=removed, keep=keep)
            return removed

    def _refuse_trimmed(self, user: str, version: int) -> None:
        if version in self._trimmed.get(user, ()):
            newest = "" if self.keep_versions is None else f"the newest {self.keep_versions}, "
            raise AdapterTrimmed(
                f"adapter {user}@{version} was removed by the retention policy (it keeps {newest}any "
                f"version rolled back to and any in use); versions kept for {user!r}: "
                f"{self.versions(user) or 'none'}")

    def rollback(self, user: str, to_version: int | None = None, reason: str = "") -> AdapterRef | None:
        """Retire the newest version, or every version newer than `to_version` (0: back to the
        base model). Retired files stay on disk but are never served to new requests; requests
        already pinned to them finish on them. Returns the version now served."""
        _validate_owner(user)
        with self._lock:
            current = self.newest(user)
            if current is None:
                raise AdapterError(f"user {user!r} has no adapter version to roll back")
            if to_version is None:
                retire = [current.version]
            else:
                if to_version != 0 and to_version not in self.versions(user):
                    self._refuse_trimmed(user, to_version)
                    raise AdapterError(f"cannot roll {user!r} back to version {to_version}: it is not "
                                       f"served (versions: {self.versions(user)})")
                retire = [v for v in self._versions[user] if v > to_version]
            for version in retire:
                self._retired.setdefault(user, set()).add(version)
                self._versions[user].remove(version)
            self._write_retired(user)
            now = self.newest(user)
            if now is not None:
                self._rolled_back_to.setdefault(user, set()).add(now.version)
            self.record_event(user, "rolled_back", retired=retire,
                              serving=None if now is None else now.version, reason=reason)
            return now

    def forget(self, user: str) -> list[int]:
        """Erase `user`: every version, the retire markers and the event log, in memory and on
        disk. No request gets any of them again; a request already pinned to one finishes on its
        cached weights, which are dropped at its release. Returns the versions forgotten."""
        _validate_owner(user)
        with self._lock:
            numbers = set(range(1, self._highest.get(user, 0) + 1))
            numbers |= {r.version for r in self._memory if r.user == user}
            for number in numbers:
                ref = AdapterRef(user, number)
                self._memory.pop(ref, None)
                self._bad.discard(ref)
                if self._pins[ref] > 0:
                    self._forgotten.add(ref)
                else:
                    self._discard_cached(ref)
            for table in (self._versions, self._highest, self._retired, self._events, self._trimmed,
                          self._rolled_back_to):
                table.pop(user, None)
            if self.root is not None and (self.root / user).exists():
                shutil.rmtree(self.root / user)
            return sorted(numbers)

    # -- events ------------------------------------------------------------------------------

    def record_event(self, user: str, kind: str, **fields: Any) -> dict[str, Any]:
        """Append to the user's event log (`events.jsonl` beside the versions, fsynced)."""
        event = {"time": time.time(), "user": user, "kind": kind, **fields}
        with self._lock:
            self._events.setdefault(user, []).append(event)
            if self.root is not None:
                user_dir = self.root / user
                user_dir.mkdir(parents=True, exist_ok=True)
                durable.append_line(user_dir / EVENTS_FILE, json.dumps(event, default=str))
        return event

    def events(self, user: str) -> list[dict[str, Any]]:
        """This process's events plus, with a root, the ones logged before it started."""
        with self._lock:
            if self.root is None:
                return list(self._events.get(user, []))
            path = self.root / user / EVENTS_FILE
            if not path.exists():
                return []
            return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]

    # -- state files -------------------------------------------------------------------------

    def _read_retired(self, user_dir: Path) -> set[int]:
        path = user_dir / RETIRED_FILE
        if not path.exists():
            return set()
        try:
            return {int(v) for v in json.loads(path.read_text())}
        except (ValueError, TypeError) as exc:
            raise AdapterError(f"{path} is corrupt ({exc}); fix or delete it to serve this user's adapters") from exc

    def _write_retired(self, user: str) -> None:
        if self.root is None:
            return
        durable.write_json(self.root / user / RETIRED_FILE, sorted(self._retired[user]))

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "adapter_users": len(self.users()),
                "adapter_versions": sum(len(self.versions(u)) for u in self.users()),
                "adapters_cached": len(self.cache),
                "adapter_cache_bytes": self.cache.nbytes,
                "adapter_cache_capacity_bytes": self.cache.capacity_bytes,
                "adapter_cache_hits": self.cache.stats.hits,
                "adapter_cache_misses": self.cache.stats.misses,
                "adapter_cache_evictions": self.cache.stats.evictions,
                "adapters_pinned": sum(1 for n in self._pins.values() if n > 0),
                "fleet_versions": len(self.versions(FLEET)),
            }


def _validate_owner(name: str) -> None:
    """An adapter owner is a user (a valid user id) or the fleet."""
    if name != FLEET:
        validate_user_id(name)


def _sized(weights: LoraWeights) -> tuple[LoraWeights, int]:
    return weights, weights.nbytes


def _is_user_id(name: str) -> bool:
    try:
        validate_user_id(name)
    except BadRequest:
        return False
    return True
