"""The daemon's one configuration loader: defaults < TOML file < MACE_* environment < flags.

Every value remembers where it came from (`maced --print-config`). Sections reuse the runtime's
own dataclasses (EngineConfig, TelemetryConfig, FeedbackStoreConfig, AdmissionConfig); the daemon's own
sections are in `daemon/settings.py`.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import Any

from daemon.admission import AdmissionConfig
from daemon.fleet.device.terms import DeviceTerms
from daemon.limits import LimitSettings
from daemon.settings import (  # noqa: F401  (re-exported: callers import them from here)
    AdmissionSettings,
    DaemonSettings,
    FeedbackSettings,
    FineTuneSettings,
    FleetSettings,
    HttpSettings,
    KeepAliveSettings,
    ServerSettings,
)
from daemon.wire.endpoints import default_ipc_path, ipc_endpoint, is_loopback, parse_tcp
from edge_runtime.config import EngineConfig
from edge_runtime.feedback.config import FeedbackStoreConfig
from edge_runtime.paths import state_dir as runtime_state_dir
from edge_runtime.telemetry.config import TelemetryConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 (JetPack 6)
    import tomli as tomllib

CONFIG_ENV = "MACE_CONFIG"
SYSTEM_CONFIG = Path("/etc/mace-edge/maced.toml")
LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("auto", "text", "json", "journal")


class ConfigError(ValueError):
    """A setting that cannot be used, named with where it came from."""


_SECTIONS: dict[str, tuple[type, ...]] = {
    "daemon": (DaemonSettings,),
    "server": (ServerSettings,),
    "http": (HttpSettings,),
    "engine": (EngineConfig, KeepAliveSettings),
    "telemetry": (TelemetryConfig,),
    "feedback": (FeedbackSettings, FeedbackStoreConfig),
    "admission": (AdmissionSettings, AdmissionConfig),
    "finetune": (FineTuneSettings,),
    "fleet": (FleetSettings, DeviceTerms), "limits": (LimitSettings,),
}
# Changing these at run time cannot break a request in flight; the rest need a restart.
RELOADABLE = frozenset({
    "daemon.log_level", "server.max_message_bytes", "server.max_inflight_per_client",
    "server.max_inflight", "server.default_max_tokens", "server.drain_timeout_s",
    "server.admission_wait_s", "admission.min_dwell_s", "admission.stale_after_s",
    "admission.retry_after_s", "admission.power_budget_mw", "finetune.enabled",
    "finetune.pairs_per_version", "finetune.idle_s", "finetune.guard",
    "http.api_keys", "http.api_key_file", "fleet.delta", "fleet.heldout_fraction",
    "engine.keep_alive",
})
# Short names people already know, besides the generic MACE_<SECTION>_<KEY>.
_ENV_ALIASES = {"MACE_STATE_DIR": "daemon.state_dir", "MACE_MODEL": "engine.model",
                "MACE_LOG_LEVEL": "daemon.log_level"}
# Engine fields the daemon sets itself (adapters and stored prefixes live under the state dir,
# where erasure looks for them): not settings.
_DAEMON_OWNED = frozenset({"engine.adapters_root", "engine.prefix_store_dir"})
# Never printed by --print-config.
_SECRETS = frozenset({"http.api_keys"})
_SCALARS = {"str": str, "int": int, "float": float, "bool": bool}


@dataclass(frozen=True)
class Setting:
    section: str
    key: str
    owner: type
    kind: type
    optional: bool
    default: Any

    @property
    def name(self) -> str:
        return f"{self.section}.{self.key}"

    @property
    def env(self) -> str:
        return f"MACE_{self.section}_{self.key}".upper()

    def coerce(self, value: Any, where: str) -> Any:
        """Check a TOML value, or parse an env/flag string, into this setting's type."""
        if isinstance(value, str) and self.kind is not str:
            value = _parse_text(value, self, where)
        elif value == "" and self.optional:
            value = None  # an empty env/flag value unsets an optional string (e.g. replay_file)
        if value is None:
            if self.optional:
                return None
            raise ConfigError(f"{self.name} ({where}) cannot be empty")
        ok = isinstance(value, self.kind) and not (self.kind is int and isinstance(value, bool))
        if self.kind is float and isinstance(value, int) and not isinstance(value, bool):
            value, ok = float(value), True
        if not ok:
            raise ConfigError(f"{self.name} ({where}) must be {self.kind.__name__}; got {value!r}")
        return value


def _parse_text(text: str, setting: Setting, where: str) -> Any:
    raw = text.strip()
    if setting.optional and raw.lower() in ("", "none", "null"):
        return None
    try:
        if setting.kind is bool:
            lowered = raw.lower()
            if lowered in ("1", "true", "yes", "on"):
                return True
            if lowered in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if setting.kind is int:
            return int(raw, 0)
        return float(raw)
    except ValueError:
        raise ConfigError(f"{setting.name} ({where}) must be {setting.kind.__name__}; got {text!r}") from None


def _schema() -> dict[str, Setting]:
    """Every scalar field of every section's dataclasses (dict-valued knobs keep their defaults)."""
    settings: dict[str, Setting] = {}
    for section, owners in _SECTIONS.items():
        for owner in owners:
            for f in fields(owner):
                parts = [p.strip() for p in str(f.type).split("|")]
                optional = "None" in parts
                kinds = [p for p in parts if p != "None"]
                if len(kinds) != 1 or kinds[0] not in _SCALARS or f"{section}.{f.name}" in _DAEMON_OWNED:
                    continue
                if f.default is not MISSING:
                    default = f.default
                elif f.default_factory is not MISSING:
                    default = f.default_factory()
                else:
                    continue
                default = _DAEMON_DEFAULTS.get(f"{section}.{f.name}", default)
                setting = Setting(section, f.name, owner, _SCALARS[kinds[0]], optional, default)
                settings.setdefault(setting.name, setting)
    return settings


# Where the daemon's default differs from the library's: the daemon co-serves inference and
# fine-tuning, so its engine schedules with MACE (the library's default is plain FCFS); and it
# serves on the fastest backend that passes its self-check (the library's default is the torch
# reference, which exports no graph). A daemon answers before its cost calibration has run: it
# serves on nominal costs and calibrates while idle.
_DAEMON_DEFAULTS = {"engine.policy": "mace", "engine.backend": "auto", "engine.onnx_quantization": "auto",
                    "engine.cost_profile": "background"}


SCHEMA = _schema()


def find_config_file(explicit: str | None, environ: Mapping[str, str]) -> Path | None:
    """--config, else $MACE_CONFIG, else systemd's ConfigurationDirectory, else /etc/mace-edge."""
    if explicit:
        return Path(explicit)
    if environ.get(CONFIG_ENV):
        return Path(environ[CONFIG_ENV])
    conf_dir = environ.get("CONFIGURATION_DIRECTORY")
    candidates = [Path(conf_dir.split(":")[0]) / "maced.toml"] if conf_dir else []
    candidates.append(SYSTEM_CONFIG)
    return next((p for p in candidates if p.is_file()), None)


class DaemonConfig:
    """Effective configuration: values, where each came from, and typed views per section."""

    def __init__(self, values: dict[str, Any], sources: dict[str, str], file: Path | None) -> None:
        self.values = values
        self.sources = sources
        self.file = file
        self.daemon: DaemonSettings = self._build("daemon", DaemonSettings)
        self.server: ServerSettings = self._build("server", ServerSettings)
        self.http: HttpSettings = self._build("http", HttpSettings)
        self.engine: EngineConfig = self._build("engine", EngineConfig)
        self.keep_alive: KeepAliveSettings = self._build("engine", KeepAliveSettings)
        self.telemetry: TelemetryConfig = self._build("telemetry", TelemetryConfig)
        self.feedback: FeedbackSettings = self._build("feedback", FeedbackSettings)
        self.admission: AdmissionSettings = self._build("admission", AdmissionSettings)
        self.finetune: FineTuneSettings = self._build("finetune", FineTuneSettings)
        self.fleet: FleetSettings = self._build("fleet", FleetSettings)
        self.fleet_terms: DeviceTerms = self._build("fleet", DeviceTerms)  # floors, budgets (issue #29)
        try:
            self.feedback_store: FeedbackStoreConfig = self._build("feedback", FeedbackStoreConfig)
            self.admission_config: AdmissionConfig = self._build("admission", AdmissionConfig)
            self.limits: LimitSettings = self._build("limits", LimitSettings)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        self.http_api_keys: frozenset[str] = self._read_api_keys()
        self._check()

    def _build(self, section: str, owner: type) -> Any:
        kwargs = {s.key: self.values[s.name] for s in SCHEMA.values()
                  if s.section == section and s.owner is owner}
        return owner(**kwargs)

    # -- derived values -----------------------------------------------------------------------

    @property
    def state_dir(self) -> Path:
        return Path(self.daemon.state_dir).expanduser() if self.daemon.state_dir else runtime_state_dir()

    @property
    def db_path(self) -> Path:
        return Path(self.feedback.db_path) if self.feedback.db_path else self.state_dir / "feedback.sqlite3"

    @property
    def adapters_dir(self) -> Path:
        return self.state_dir / "adapters"

    @property
    def prefix_store_dir(self) -> Path:
        return self.state_dir / "prefix-cache"

    @property
    def ipc_path(self) -> Path | None:
        ipc = self.server.ipc
        if not ipc:
            return None
        if ipc == "auto":
            return default_ipc_path()
        return Path(ipc.removeprefix("ipc://")).expanduser()

    @property
    def ipc_mode(self) -> int:
        return int(self.server.ipc_mode, 8)

    @property
    def max_frame_bytes(self) -> int:
        """The largest request frame read at all: fleet.max_message_bytes with fleet rounds on
        (only their ops may use it), else server.max_message_bytes."""
        return self.fleet.max_message_bytes if self.fleet.enabled else self.server.max_message_bytes

    @property
    def curve_enabled(self) -> bool:
        return bool(self.server.curve_secret_key)

    @property
    def http_address(self) -> tuple[str, int] | None:
        """(host, port) of the HTTP gateway, or None when it is off."""
        return parse_http_bind(self.http.bind) if self.http.bind else None

    def _read_api_keys(self) -> frozenset[str]:
        keys = [k.strip() for k in self.http.api_keys.split(",") if k.strip()]
        if self.http.api_key_file:
            path = Path(self.http.api_key_file).expanduser()
            try:
                text = path.read_text(encoding="utf-8")
            except OSError as exc:
                raise ConfigError(f"http.api_key_file {path}: {exc.strerror}") from None
            keys += [line.split("#", 1)[0].strip() for line in text.splitlines()]
        keys = [k for k in keys if k]
        short = [k for k in keys if len(k) < 16 or any(c.isspace() for c in k)]
        if short:
            raise ConfigError(f"{len(short)} HTTP API key(s) are shorter than 16 characters or contain "
                              "spaces; use long random keys (e.g. `openssl rand -hex 24`)")
        return frozenset(keys)

    def endpoints(self) -> list[str]:
        found = [ipc_endpoint(self.ipc_path)] if self.ipc_path is not None else []
        return found + ([self.server.tcp] if self.server.tcp else [])

    def _check(self) -> None:
        d, s = self.daemon, self.server
        if d.log_level.lower() not in LOG_LEVELS:
            raise ConfigError(f"daemon.log_level must be one of {', '.join(LOG_LEVELS)}; got {d.log_level!r}")
        if d.log_format not in LOG_FORMATS:
            raise ConfigError(f"daemon.log_format must be one of {', '.join(LOG_FORMATS)}; got {d.log_format!r}")
        if not self.endpoints():
            raise ConfigError("no endpoint: set server.ipc and/or server.tcp")
        try:
            mode = int(s.ipc_mode, 8)
        except ValueError:
            raise ConfigError(f"server.ipc_mode must be an octal mode like 0660; got {s.ipc_mode!r}") from None
        if mode & ~0o777 or mode & 0o007:
            raise ConfigError(f"server.ipc_mode {s.ipc_mode} must not give access to other users")
        if s.tcp:
            try:
                host, _ = parse_tcp(s.tcp)
            except ValueError as exc:
                raise ConfigError(f"server.tcp: {exc}") from None
            if not is_loopback(host) and not self.curve_enabled:
                raise ConfigError(
                    f"server.tcp {s.tcp} is reachable from other machines; refusing to serve it "
                    "without encryption and client authentication. Bind tcp://127.0.0.1:PORT, or set "
                    "server.curve_secret_key and server.curve_authorized_keys (CURVE)")
        if self.http.bind:
            try:
                host, _ = parse_http_bind(self.http.bind)
            except ValueError as exc:
                raise ConfigError(f"http.bind: {exc}") from None
            if not is_loopback(host) and not self.http_api_keys:
                raise ConfigError(
                    f"http.bind {self.http.bind} is reachable from other machines; refusing to serve "
                    "it without API keys. Bind 127.0.0.1:PORT, or set http.api_keys / "
                    "http.api_key_file (clients send 'Authorization: Bearer KEY')")
            origins = [o.strip() for o in self.http.cors_origins.split(",") if o.strip()]
            if "*" in origins and not self.http_api_keys:
                raise ConfigError("http.cors_origins '*' lets any web page a user visits call this "
                                  "daemon; set http.api_keys too, or list the origins")
            bad = [o for o in origins if o != "*" and not re.fullmatch(r"https?://[^/\s]+", o)]
            if bad:
                raise ConfigError(f"http.cors_origins: {bad[0]!r} is not an origin (scheme://host[:port])")
        if self.curve_enabled and not s.curve_authorized_keys:
            raise ConfigError("server.curve_secret_key needs server.curve_authorized_keys (a folder "
                              "of the clients' public keys): CURVE without it would admit anyone")
        for key in ("max_message_bytes", "max_inflight_per_client", "max_inflight", "send_hwm",
                    "default_max_tokens"):
            if getattr(s, key) < 1:
                raise ConfigError(f"server.{key} must be >= 1")
        if s.max_message_bytes < 1024:
            raise ConfigError("server.max_message_bytes must be at least 1024")
        if self.finetune.pairs_per_version < 1 or self.finetune.idle_s < 0:
            raise ConfigError("finetune.pairs_per_version must be >= 1 and finetune.idle_s >= 0")
        if not 0 < self.fleet.delta < 1 or not 0 <= self.fleet.heldout_fraction <= 0.95:
            raise ConfigError("fleet.delta must be in (0, 1) and fleet.heldout_fraction in [0, 0.95]")
        if (problem := self.fleet_terms.problem()) is not None:
            raise ConfigError(problem)
        if self.fleet.max_message_bytes < s.max_message_bytes:
            raise ConfigError("fleet.max_message_bytes must be at least server.max_message_bytes")
        if s.drain_timeout_s < 0 or s.admission_wait_s < 0:
            raise ConfigError("server.drain_timeout_s and server.admission_wait_s must be >= 0")

    # -- presentation -------------------------------------------------------------------------

    def as_dict(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for setting in SCHEMA.values():
            out.setdefault(setting.section, {})[setting.key] = self.values[setting.name]
        return out

    def render(self) -> str:
        """TOML of the effective values, each with a comment saying where it came from."""
        lines = [f"# effective maced configuration; file: {self.file or 'none'}",
                 f"# endpoints: {', '.join(self.endpoints())}", f"# state_dir: {self.state_dir}"]
        section = None
        for setting in SCHEMA.values():
            if setting.section != section:
                section = setting.section
                lines += ["", f"[{section}]"]
            value = self.values[setting.name]
            origin = self.sources[setting.name]
            if value is None:
                lines.append(f"# {setting.key} = (unset)  # {origin}")
            elif setting.name in _SECRETS and value:
                lines.append(f"# {setting.key} = (set, hidden)  # {origin}")
            else:
                lines.append(f"{setting.key} = {_toml_value(value)}  # {origin}")
        return "\n".join(lines) + "\n"


def parse_http_bind(bind: str) -> tuple[str, int]:
    """'HOST:PORT' or '[V6]:PORT' -> (host, port); ValueError with a readable message otherwise."""
    host, sep, port = bind.strip().rpartition(":")
    host = host.strip()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"expected HOST:PORT such as 127.0.0.1:8000 (PORT 0 = any free port); got {bind!r}")
    return host, int(port)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(str(value), ensure_ascii=False)  # JSON strings are TOML basic strings


def load_config(
    file: str | Path | None = None,
    environ: Mapping[str, str] | None = None,
    flags: Sequence[tuple[str, Any, str]] = (),
) -> DaemonConfig:
    """Merge the four layers. `flags` are (section.key, value, flag spelling) triples."""
    environ = os.environ if environ is None else environ
    values = {name: s.default for name, s in SCHEMA.items()}
    sources = dict.fromkeys(SCHEMA, "default")
    path = find_config_file(str(file) if file else None, environ)
    if path is not None:
        for name, value in _read_toml(path).items():
            values[name] = SCHEMA[name].coerce(value, f"file {path}")
            sources[name] = f"file {path}"
    for env_name, text in sorted(environ.items()):
        name = _ENV_ALIASES.get(env_name) or _ENV_NAMES.get(env_name)
        if name is not None:
            values[name] = SCHEMA[name].coerce(text, f"env {env_name}")
            sources[name] = f"env {env_name}"
    for name, value, spelling in flags:
        if name not in SCHEMA:
            raise ConfigError(f"{spelling}: unknown setting {name!r}; see maced --print-config")
        values[name] = SCHEMA[name].coerce(value, f"flag {spelling}")
        sources[name] = f"flag {spelling}"
    return DaemonConfig(values, sources, path)


_ENV_NAMES = {s.env: name for name, s in SCHEMA.items()}


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    flat: dict[str, Any] = {}
    for section, table in data.items():
        if section in ("apps", "operator"):
            continue  # who may connect as what: daemon/principals.py reads these tables
        if section not in _SECTIONS or not isinstance(table, dict):
            raise ConfigError(f"{path}: unknown section [{section}]; known: {', '.join(_SECTIONS)}")
        for key, value in table.items():
            name = f"{section}.{key}"
            if name not in SCHEMA:
                raise ConfigError(f"{path}: unknown setting {name!r}; see maced --print-config")
            flat[name] = value
    return flat


def reload_changes(old: DaemonConfig, new: DaemonConfig) -> tuple[list[str], list[str]]:
    """(settings applied at run time, settings that changed but need a restart)."""
    changed = [n for n in SCHEMA if old.values[n] != new.values[n]]
    return [n for n in changed if n in RELOADABLE], [n for n in changed if n not in RELOADABLE]


