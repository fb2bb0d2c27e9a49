"""The aggregator's signature on a fleet adapter it asks devices to publish (docs/fleet.md): Ed25519
over the run id, the round, the canonical PEFT config and every tensor, so a device serves only what
its own aggregator's key signed, whatever carried the message. Signatures of the first format
(round and tensors only) are refused: they left the config (lora_alpha) open to anyone on the path.
Knows keys and bytes, not Flower or the daemon.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey


class PublishRefused(Exception):
    """A publish instruction the device will not act on; the message says why."""


# The format tag opens the signed bytes: a signature over another format never verifies.
FORMAT = "mace-fleet-publish/2"


def canonical_config(peft_config: Mapping[str, Any]) -> str:
    """The PEFT `adapter_config.json` as signed: sorted keys, no whitespace, plain JSON (NaN and
    infinities are not JSON; a config holding one cannot be signed or verified)."""
    try:
        return json.dumps(peft_config, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except ValueError as exc:
        raise PublishRefused(f"the adapter config is not plain JSON ({exc}): refused") from None


def adapter_digest(run_id: str, server_round: int, peft_config: Mapping[str, Any],
                   arrays: Mapping[str, np.ndarray]) -> bytes:
    """SHA-256 over the format, run id, round and canonical config (each on its own length-
    prefixed line), then each tensor's name, dtype, shape and bytes in name order."""
    h = hashlib.sha256()
    for part in (FORMAT, run_id, str(server_round), canonical_config(peft_config)):
        data = part.encode()
        h.update(f"{len(data)}:".encode() + data + b"\n")
    for name in sorted(arrays):
        value = np.ascontiguousarray(arrays[name], dtype=np.float32)
        h.update(f"{name} float32 {list(value.shape)}\n".encode())
        h.update(value.tobytes())
    return h.digest()


def write_keypair(private_path: Path, public_path: Path) -> None:
    """A new Ed25519 key pair: PEM private key (0600) and OpenSSH public key for the devices."""
    key = Ed25519PrivateKey.generate()
    private_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
    private_path.chmod(0o600)
    public_path.write_bytes(key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                                          serialization.PublicFormat.OpenSSH))


def sign_publish(private_key: Path, run_id: str, server_round: int, peft_config: Mapping[str, Any],
                 arrays: Mapping[str, np.ndarray]) -> bytes:
    key = serialization.load_pem_private_key(private_key.read_bytes(), password=None)
    if not isinstance(key, Ed25519PrivateKey):
        raise ValueError(f"{private_key} is not an Ed25519 private key")
    return key.sign(adapter_digest(run_id, server_round, peft_config, arrays))


def verify_publish(public_key: Path, run_id: str, server_round: int, peft_config: Mapping[str, Any],
                   arrays: Mapping[str, np.ndarray], signature: bytes) -> None:
    """Return if `signature` is the aggregator's over exactly this run, round, config and these
    tensors; else PublishRefused."""
    try:
        key = serialization.load_ssh_public_key(public_key.read_bytes())
    except (OSError, ValueError) as exc:
        raise PublishRefused(f"cannot read the aggregator's public key {public_key}: {exc}") from None
    if not isinstance(key, Ed25519PublicKey):
        raise PublishRefused(f"{public_key} is not an Ed25519 public key")
    if not signature:
        raise PublishRefused("the publish instruction carries no signature: not from this fleet's aggregator")
    try:
        key.verify(bytes(signature), adapter_digest(run_id, server_round, peft_config, arrays))
    except InvalidSignature:
        raise PublishRefused("the publish instruction's signature does not match the aggregator's key "
                             f"and this run, round, config and tensors ({FORMAT}; signatures of an older "
                             "format are refused): refused, nothing published") from None
