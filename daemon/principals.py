"""Who makes a request (docs/security.md): an app or the operator, as identified by the fronts
(ipc peer uid, CURVE public key, HTTP API key), and where each app's users live in storage.

Reads the `[[apps]]` and `[operator]` tables of the config file; the fronts ask it, the service
checks rights. A principal is never taken from a request's fields.
"""

from __future__ import annotations

import hmac
import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from daemon.config import ConfigError
from daemon.wire import ProtocolError
from daemon.wire.args import APP_NAME

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 (JetPack 6)
    import tomli as tomllib

DEFAULT_APP = "default"
# Between an app's name and its user's id in storage: never in an id an app's string maps to
# (daemon.wire.fields.internal_user), so `notes~alice` is nobody's plain id.
SEPARATOR = "~"
IDENTITY_SECTIONS = frozenset({"apps", "operator"})


class IdentityConfigError(ConfigError):
    """An `[[apps]]` or `[operator]` entry that cannot be used."""


@dataclass(frozen=True)
class Principal:
    """Who a request acts as: kind "app" (its data is its app's users') or "operator" (the
    service's owner: every app's users, fleet and adapter administration)."""

    kind: str  # "app" | "operator"
    app: str = DEFAULT_APP  # the app whose users a request names (the operator: by default)
    via: str = ""  # how the front identified it, for refusals and logs

    @property
    def is_operator(self) -> bool:
        return self.kind == "operator"

    def describe(self) -> str:
        who = "the operator" if self.is_operator else f"app {self.app!r}"
        return f"{who} ({self.via})" if self.via else who


OPERATOR_LOCAL = Principal("operator", via="local")  # in-process callers (tests, tools)


def forbidden(principal: Principal, right: str) -> ProtocolError:
    return ProtocolError("forbidden", f"{principal.describe()} lacks the right to {right}")


def stored_user(app: str, user: str) -> str:
    """The id an app's user is stored under: the default app's plain (so data from before apps
    existed is the default app's, unchanged), any other app's as `<app>~<user>`."""
    return user if app == DEFAULT_APP else f"{app}{SEPARATOR}{user}"


def split_stored(stored: str) -> tuple[str, str]:
    """(app, user) of a stored id."""
    app, sep, user = stored.partition(SEPARATOR)
    return (app, user) if sep else (DEFAULT_APP, stored)


@dataclass
class Identities:
    """The configured apps and operator credentials, and the lookups the fronts make."""

    apps: tuple[str, ...] = (DEFAULT_APP,)
    api_keys: dict[str, Principal] = field(default_factory=dict)
    curve_keys: dict[str, Principal] = field(default_factory=dict)  # z85 public key -> principal
    uids: dict[int, Principal] = field(default_factory=dict)
    service_uid: int = field(default_factory=os.geteuid)

    @classmethod
    def from_config(cls, config: Any) -> Identities:
        """From the config file's `[[apps]]` / `[operator]` tables; `http.api_keys` (and
        `http.api_key_file`) are the default app's keys."""
        ids = cls()
        for i, key in enumerate(sorted(config.http_api_keys)):
            ids.api_keys[key] = Principal("app", DEFAULT_APP, f"http.api_keys key {i + 1}")
        tables: dict[str, Any] = {}
        if config.file is not None:
            with open(config.file, "rb") as f:
                tables = tomllib.load(f)
        apps = tables.get("apps", [])
        if not isinstance(apps, list):
            raise IdentityConfigError("[[apps]] must be an array of tables")
        names = [DEFAULT_APP]
        for entry in apps:
            name = entry.get("name") if isinstance(entry, dict) else None
            if not isinstance(name, str) or not APP_NAME.fullmatch(name):
                raise IdentityConfigError(f"[[apps]] name {name!r}: 1-32 of a-z, 0-9, '_', '-'")
            if name in names[1:]:
                raise IdentityConfigError(f"[[apps]] name {name!r} appears twice")
            if name != DEFAULT_APP:
                names.append(name)
            ids._add(entry, Principal("app", name), f"app {name!r}")
        operator = tables.get("operator", {})
        if not isinstance(operator, dict):
            raise IdentityConfigError("[operator] must be a table")
        ids._add(operator, Principal("operator"), "[operator]")
        ids.apps = tuple(names)
        return ids

    def _add(self, entry: dict[str, Any], who: Principal, where: str) -> None:
        unknown = set(entry) - {"name", "api_keys", "curve_keys", "uids"}
        if unknown:
            raise IdentityConfigError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}")
        for i, key in enumerate(_strings(entry.get("api_keys", []), where, "api_keys")):
            if len(key) < 16 or any(c.isspace() for c in key):
                raise IdentityConfigError(f"{where}: API keys must be 16+ characters without spaces")
            _claim(self.api_keys, key, Principal(who.kind, who.app, f"API key {i + 1}"), where)
        for key in _strings(entry.get("curve_keys", []), where, "curve_keys"):
            if len(key) != 40:
                raise IdentityConfigError(f"{where}: curve_keys are Z85 public keys of 40 characters")
            _claim(self.curve_keys, key, Principal(who.kind, who.app, f"CURVE key {key[:8]}..."), where)
        uids = entry.get("uids", [])
        if not isinstance(uids, list) or not all(isinstance(u, int) and u >= 0 for u in uids):
            raise IdentityConfigError(f"{where}: uids must be a list of user ids (numbers)")
        for uid in uids:
            _claim(self.uids, uid, Principal(who.kind, who.app, f"uid {uid}"), where)

    # -- the fronts' lookups ------------------------------------------------------------------

    def for_uid(self, uid: int) -> Principal:
        """An ipc peer: a configured uid's principal; else the service's own uid or root is
        the operator, and any other uid allowed to connect is the default app."""
        if uid in self.uids:
            return self.uids[uid]
        if uid in (self.service_uid, 0):
            return Principal("operator", via=f"uid {uid}")
        return Principal("app", DEFAULT_APP, f"uid {uid}")

    def for_curve_key(self, z85: str) -> Principal:
        """A CURVE client (admitted by the authorized-keys folder): its configured principal,
        else the default app."""
        return self.curve_keys.get(z85) or Principal("app", DEFAULT_APP, f"CURVE key {z85[:8]}...")

    def for_api_key(self, token: str) -> Principal | None:
        """The principal of an HTTP bearer key, or None; every key is compared in constant time."""
        found = None
        for key, who in self.api_keys.items():
            if hmac.compare_digest(token.encode(), key.encode()):
                found = who
        return found

    def target_app(self, principal: Principal, app: str | None) -> str:
        """The app whose user a request names: the principal's own, or (the operator only)
        the one the request's `app` field names."""
        if app is None or app == principal.app:
            return principal.app
        if not principal.is_operator:
            raise forbidden(principal, f"act for another app's users (app {app!r})")
        if app not in self.apps:
            raise ProtocolError("bad_request", f"no app named {app!r} is configured", param="app")
        return app


def _strings(value: Any, where: str, name: str) -> Iterable[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise IdentityConfigError(f"{where}: {name} must be a list of strings")
    return value


def _claim(table: dict[Any, Principal], key: Any, who: Principal, where: str) -> None:
    if key in table and table[key] != who:
        raise IdentityConfigError(f"{where}: a credential is already given to {table[key].describe()}")
    table[key] = who


def peer_uid(peer_address: str) -> int | None:
    """The uid libzmq read with SO_PEERCRED for an ipc peer (its `Peer-Address` metadata is
    `<host>:<uid>:<gid>:<pid>`), or None when the address carries none."""
    parts = peer_address.rsplit(":", 3)
    if len(parts) != 4 or not parts[1].isdigit():
        return None
    return int(parts[1])


def load_identities(config: Any) -> Identities:
    """The identities for a config, refusing a bad file with the config's own error type."""
    try:
        return Identities.from_config(config)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{config.file}: {exc}") from None
