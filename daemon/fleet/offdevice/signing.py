"""The aggregator's signature on a fleet adapter it asks devices to publish (docs/fleet.md): Ed25519
over the round and every tensor, so a device serves only what its own aggregator's key signed,
whatever carried the message. Knows keys and bytes, not Flower or the daemon.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path

import numpy as np
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey


class PublishRefused(Exception):
    """A publish instruction the device will not act on; the message says why."""


def adapter_digest(server_round: int, arrays: Mapping[str, np.ndarray]) -> bytes:
    """SHA-256 over the round, then each tensor's name, dtype, shape and bytes in name order."""
    h = hashlib.sha256(f"mace-fleet-publish round={server_round}\n".encode())
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


def sign_publish(private_key: Path, server_round: int, arrays: Mapping[str, np.ndarray]) -> bytes:
    key = serialization.load_pem_private_key(private_key.read_bytes(), password=None)
    if not isinstance(key, Ed25519PrivateKey):
        raise ValueError(f"{private_key} is not an Ed25519 private key")
    return key.sign(adapter_digest(server_round, arrays))


def verify_publish(public_key: Path, server_round: int, arrays: Mapping[str, np.ndarray],
                   signature: bytes) -> None:
    """Return if `signature` is the aggregator's over exactly these tensors; else PublishRefused."""
    try:
        key = serialization.load_ssh_public_key(public_key.read_bytes())
    except (OSError, ValueError) as exc:
        raise PublishRefused(f"cannot read the aggregator's public key {public_key}: {exc}") from None
    if not isinstance(key, Ed25519PublicKey):
        raise PublishRefused(f"{public_key} is not an Ed25519 public key")
    if not signature:
        raise PublishRefused("the publish instruction carries no signature: not from this fleet's aggregator")
    try:
        key.verify(bytes(signature), adapter_digest(server_round, arrays))
    except InvalidSignature:
        raise PublishRefused("the publish instruction's signature does not match the aggregator's key "
                             "and these tensors: refused, nothing published") from None
