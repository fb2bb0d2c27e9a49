"""How the Flower processes of a fleet are started (docs/fleet.md): the aggregator's SuperLink with
TLS and SuperNode authentication, a device's SuperNode with the CA and its node key, the keys and
certificates a first setup (or a test) needs, node registration and run submission. Builds files
and command lines; knows nothing of rounds, adapters or feedback.

A SuperNode is never started without TLS and a node key unless `dev_insecure` says so explicitly.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

APP_DIR = Path(__file__).resolve().parent / "app"
CONNECTION = "fleet"  # the SuperLink connection's name in the aggregator's FLWR_HOME/config.toml


class FleetSetupError(Exception):
    """A fleet process asked for in a way that would weaken its security; the message says how."""


@dataclass(frozen=True)
class TlsFiles:
    ca_cert: Path  # the devices verify the SuperLink against it (--root-certificates)
    server_cert: Path
    server_key: Path


@dataclass(frozen=True)
class Addresses:
    """The SuperLink's three APIs: devices connect to `fleet`; `control` takes runs and node
    registrations (the operator's `flwr`); `serverappio` is its local ServerApp's."""

    fleet: str = "0.0.0.0:9092"
    control: str = "127.0.0.1:9093"
    serverappio: str = "127.0.0.1:9091"


def _bin(name: str) -> str:
    """A Flower executable next to this interpreter (a venv's bin/), else on PATH."""
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.exists() else (shutil.which(name) or name)


def flower_env(flwr_home: Path | None = None) -> dict[str, str]:
    """The environment for Flower processes: this interpreter's bin/ first on PATH (the SuperLink
    and SuperNode start `flower-superexec`, `flwr-serverapp` and `flwr-clientapp` from PATH), and
    this `daemon` package first on PYTHONPATH, so the apps they start (and `flwr run`'s check of
    the app's components) import the same code as the process that launched them."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    package_root = str(Path(__file__).resolve().parents[3])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH", "")) if p)
    if flwr_home is not None:
        env["FLWR_HOME"] = str(flwr_home)
    return env


def make_tls(folder: Path, hosts: Sequence[str] = ("127.0.0.1", "localhost"), days: int = 365) -> TlsFiles:
    """A CA and a SuperLink certificate it signed for `hosts` (IP addresses or DNS names)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    folder.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    valid = (now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days))
    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "MACE-edge fleet CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(valid[0]).not_valid_after(valid[1])
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .sign(ca_key, hashes.SHA256()))
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    key = ec.generate_private_key(ec.SECP384R1())
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(valid[0]).not_valid_after(valid[1])
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .sign(ca_key, hashes.SHA256()))
    files = TlsFiles(folder / "ca.crt", folder / "superlink.crt", folder / "superlink.key")
    files.ca_cert.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    files.server_cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    files.server_key.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                   serialization.NoEncryption()))
    files.server_key.chmod(0o600)
    return files


def make_node_key(folder: Path, name: str) -> tuple[Path, Path]:
    """A SuperNode's authentication key pair, as Flower 1.30 reads it: ECDSA P-384, OpenSSH format.
    The private key stays on the device; the public key is registered with the SuperLink."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    folder.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP384R1())
    private, public = folder / name, folder / f"{name}.pub"
    private.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                          serialization.NoEncryption()))
    private.chmod(0o600)
    public.write_bytes(key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                                     serialization.PublicFormat.OpenSSH))
    return private, public


def superlink_command(tls: TlsFiles | None, addresses: Addresses, *, database: Path | None = None,
                      dev_insecure: bool = False) -> list[str]:
    """The aggregator's SuperLink: TLS on every API devices and operators reach, and only
    registered SuperNodes admitted (`--enable-supernode-auth`)."""
    if tls is None and not dev_insecure:
        raise FleetSetupError("the SuperLink needs TLS files (make_tls); plaintext only with dev_insecure")
    cmd = [_bin("flower-superlink"), "--fleet-api-address", addresses.fleet,
           "--control-api-address", addresses.control, "--serverappio-api-address", addresses.serverappio,
           "--enable-supernode-auth"]
    if tls is None:
        cmd.append("--insecure")
    else:
        cmd += ["--ssl-ca-certfile", str(tls.ca_cert), "--ssl-certfile", str(tls.server_cert),
                "--ssl-keyfile", str(tls.server_key)]
    if database is not None:
        cmd += ["--database", str(database)]
    return cmd


def node_config_arg(values: Mapping[str, Any]) -> str:
    """Flower's `--node-config` syntax: space-separated key=TOML-value pairs."""
    return " ".join(f"{k}={json.dumps(v)}" for k, v in values.items())


def supernode_command(superlink: str, ca_cert: Path | None, node_key: Path | None,
                      node_config: Mapping[str, Any], *, clientappio: str = "127.0.0.1:9094",
                      max_retries: int | None = None, dev_insecure: bool = False) -> list[str]:
    """A device's SuperNode: verifies the SuperLink against `ca_cert` and authenticates with
    `node_key`. Without either it is refused, unless `dev_insecure` (development only)."""
    if (ca_cert is None or node_key is None) and not dev_insecure:
        raise FleetSetupError("a device's SuperNode needs the fleet CA (--root-certificates) and its node key "
                              "(--auth-supernode-private-key); without them only with dev_insecure")
    cmd = [_bin("flower-supernode"), "--superlink", superlink, "--clientappio-api-address", clientappio,
           "--node-config", node_config_arg(node_config)]
    if ca_cert is None:
        cmd.append("--insecure")
    else:
        cmd += ["--root-certificates", str(ca_cert)]
    if node_key is not None:
        cmd += ["--auth-supernode-private-key", str(node_key)]
    if max_retries is not None:
        cmd += ["--max-retries", str(max_retries)]
    return cmd


def write_connection(flwr_home: Path, control: str, ca_cert: Path | None) -> None:
    """The operator's `flwr` connection to the SuperLink's Control API, as FLWR_HOME/config.toml."""
    flwr_home.mkdir(parents=True, exist_ok=True)
    tls = f'root-certificates = "{ca_cert}"' if ca_cert is not None else "insecure = true"
    (flwr_home / "config.toml").write_text(
        f'[superlink]\ndefault = "{CONNECTION}"\n\n[superlink.{CONNECTION}]\naddress = "{control}"\n{tls}\n')


def register_node(flwr_home: Path, public_key: Path) -> int:
    """Admit a device's SuperNode: register its public key with the SuperLink; returns its node id."""
    done = subprocess.run([_bin("flwr"), "supernode", "register", str(public_key), CONNECTION, "--format", "json"],
                          env=flower_env(flwr_home), capture_output=True, text=True, timeout=60)
    try:
        reply = json.loads(done.stdout[done.stdout.index("{"):])
    except ValueError:
        reply = {}
    if done.returncode != 0 or not reply.get("success"):
        raise FleetSetupError(f"registering {public_key} failed: {done.stdout[-2000:]} {done.stderr[-2000:]}")
    return int(reply["node-id"])


def run_command(run_config: Mapping[str, Any], *, stream: bool = True) -> list[str]:
    """`flwr run` of the fleet app on the SuperLink connection, with `run_config` overrides."""
    cmd = [_bin("flwr"), "run", str(APP_DIR), CONNECTION, "--run-config", node_config_arg(run_config)]
    return cmd + (["--stream"] if stream else [])
