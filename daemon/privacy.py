"""What the daemon writes about people outside the feedback store: user ids never reach its log.
At start, secret files other users could read and unauthenticated TCP are refused (check_start).

A log line names a user by a keyed pseudonym, HMAC-SHA256 of the id under a random key kept in
the state directory (0600). The same user has the same pseudonym across restarts, so an operator
can follow one user's lines; without the key, the pseudonym cannot be tied to an id.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from pathlib import Path
from typing import Any

from edge_runtime import durable

KEY_BYTES = 32


class LogPseudonyms:
    """`tag(user)` -> "user:3f9a0c21d7e4": how log lines name a user."""

    def __init__(self, key: bytes) -> None:
        self._key = key

    @classmethod
    def from_state_dir(cls, state_dir: Path) -> LogPseudonyms:
        """The state directory's key, created (0600) on first use."""
        path = state_dir / "log-key"
        try:
            key = path.read_bytes()
        except FileNotFoundError:
            key = b""
        if len(key) != KEY_BYTES:
            key = secrets.token_bytes(KEY_BYTES)
            state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            durable.write_bytes(path, key, mode=0o600)
        return cls(key)

    @classmethod
    def ephemeral(cls) -> LogPseudonyms:
        """A key that lives as long as the process (tests, embedded use without a state dir)."""
        return cls(secrets.token_bytes(KEY_BYTES))

    def tag(self, user: str) -> str:
        digest = hmac.new(self._key, user.encode("utf-8", "surrogatepass"), hashlib.sha256).hexdigest()
        return f"user:{digest[:12]}"

    def adapter(self, user: str, version: int) -> str:
        """An adapter version as a log line names it."""
        return f"{self.tag(user)}@{version}"

    def scrub(self, text: object, user: str) -> str:
        """`text` (an error message) with the user's id replaced by their pseudonym."""
        return str(text).replace(user, self.tag(user)) if user else str(text)


# -- secrets on disk and endpoints others can reach ----------------------------------------------


class StartRefused(RuntimeError):
    """A setting that would expose the daemon's secrets or endpoints to other local users."""


def check_secret_file(path: Path, setting: str) -> None:
    """Refuse a secret readable or writable by other users (the group may read: the service user
    often reads /etc/mace-edge through its group)."""
    try:
        mode = path.stat().st_mode & 0o777
    except OSError:
        return  # a missing file is the loader's error, with its own message
    if mode & 0o006:
        raise StartRefused(f"{setting} {path} has mode {mode:04o}: other users can read or change it; "
                           f"run `chmod 600 {path}` (or 640 with the service's group)")


def check_start(config: Any) -> None:
    """What maced refuses at start besides the configuration's own checks: secret files others
    can read, and a loopback TCP endpoint without CURVE unless server.tcp_without_curve says so
    (any local user could connect to it, unlike the 0660 ipc socket)."""
    if config.server.curve_secret_key:
        check_secret_file(Path(config.server.curve_secret_key).expanduser(), "server.curve_secret_key")
    if config.http.api_key_file:
        check_secret_file(Path(config.http.api_key_file).expanduser(), "http.api_key_file")
    if config.server.tcp and not config.curve_enabled and not config.server.tcp_without_curve:
        raise StartRefused(f"server.tcp {config.server.tcp} without CURVE lets every local user (and every "
                           "container sharing the network) act as an app; set server.curve_secret_key and "
                           "server.curve_authorized_keys, or opt in with server.tcp_without_curve = true")
