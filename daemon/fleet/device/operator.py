"""Who may change the fleet adapter every user is served beneath (issue #29): the operator only, and
only from the folder set aside for publishes. Today the operator is whoever can read the operator
key, `<state>/fleet/operator.key` (0600, made at start): the service's own user (`macectl`, the
SuperNode's ClientApp) and root. The service first checks the caller's principal (docs/security.md);
the key is a second proof, so a leaked operator CURVE key alone cannot swap every user's base.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import os
import secrets
from pathlib import Path

from daemon.wire import ProtocolError
from edge_runtime import durable

OPERATOR_KEY_FILE = Path("fleet") / "operator.key"
PUBLISH_FOLDER = "fleet-staging"  # under the state dir, unless fleet.publish_dir names another


def ensure_operator_key(path: Path) -> str:
    """The operator key in `path`, made (random, owner-only) if there is none; an existing file is
    put back to owner-only, since anyone reading it could publish."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    if path.exists():
        os.chmod(path, 0o600)
        return path.read_text().strip()
    key = secrets.token_hex(32)
    durable.write_text(path, key + "\n", mode=0o600)  # a key lost to a crash would lock the operator out
    return key


class PublishedRounds:
    """The last round published per aggregator run, in `<state>/fleet/published.json`: a signed
    publish instruction is acted on once, and one for a round at or below its run's last
    published round (a replay, or an old round sent again) is refused."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lock = asyncio.Lock()  # check, publish and record as one step
        self.last: dict[str, int] = {}
        if path.exists():
            try:
                self.last = {str(k): int(v) for k, v in json.loads(path.read_text()).items()}
            except (OSError, ValueError, TypeError, AttributeError) as exc:
                raise ProtocolError("internal", f"the fleet publish record {path} cannot be read ({exc}); "
                                    "aggregator publishes stay refused until it is repaired") from None

    def check(self, run_id: str, round_number: int) -> None:
        last = self.last.get(run_id)
        if last is not None and round_number <= last:
            raise ProtocolError("bad_request", f"fleet.publish: round {round_number} of run {run_id[:64]!r} is at "
                                f"or below its last published round {last}: a replay, refused", param="round")

    def record(self, run_id: str, round_number: int) -> None:
        last = {**self.last, run_id: round_number}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        durable.write_json(self.path, last)
        self.last = last


class FleetOperator:
    """Checks that a fleet publish or rollback comes from the operator, that a publish reads only
    from `publish_dir`, and (`published`) that an aggregator's round is published once."""

    def __init__(self, state_dir: Path, publish_dir: str = "") -> None:
        self.key_path = state_dir / OPERATOR_KEY_FILE
        self._key = ensure_operator_key(self.key_path)
        self.publish_dir = (Path(publish_dir).expanduser() if publish_dir else state_dir / PUBLISH_FOLDER).resolve()
        self.publish_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.published = PublishedRounds(state_dir / "fleet" / "published.json")

    def is_operator(self, operator_key: str | None) -> bool:
        """Whether the request carries the operator key (after the service checked the principal)."""
        return operator_key is not None and hmac.compare_digest(operator_key.encode(), self._key.encode())

    def require(self, operator_key: str | None, op: str) -> None:
        if not self.is_operator(operator_key):
            raise ProtocolError("forbidden", f"{op} is the operator's right: this request does not carry the "
                                f"operator key ({self.key_path}, readable by the service's user only)",
                                param="operator_key")

    def publish_path(self, path: str) -> Path:
        """`path` resolved (links followed) if it lies inside the publish folder; else forbidden."""
        resolved = Path(path).resolve()
        if resolved == self.publish_dir or not resolved.is_relative_to(self.publish_dir):
            raise ProtocolError("forbidden", f"fleet.publish reads only folders inside {self.publish_dir} "
                                "(fleet.publish_dir); copy the adapter there first", param="path")
        return resolved
