"""Where the daemon listens and where clients look for it: ipc socket paths and TCP endpoints.

Standard library only (the client SDK uses it). Decides defaults; never binds or connects.
"""

from __future__ import annotations

import ipaddress
import os
import tempfile
from pathlib import Path

SOCKET_NAME = "maced.sock"
# The socket of the system service (systemd RuntimeDirectory=mace-edge).
SYSTEM_IPC_PATH = Path("/run/mace-edge") / SOCKET_NAME
ENDPOINT_ENV = "MACE_ENDPOINT"
# sockaddr_un.sun_path holds 108 bytes including the terminating NUL.
MAX_IPC_PATH_BYTES = 107


def default_ipc_path() -> Path:
    """The daemon's own socket: systemd's runtime directory, else $XDG_RUNTIME_DIR, else /tmp."""
    runtime = os.environ.get("RUNTIME_DIRECTORY")
    if runtime:
        return Path(runtime.split(":")[0]) / SOCKET_NAME
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        return Path(xdg) / "mace-edge" / SOCKET_NAME
    return Path(tempfile.gettempdir()) / f"mace-edge-{os.getuid()}" / SOCKET_NAME


def ipc_endpoint(path: str | Path) -> str:
    return f"ipc://{path}"


def default_client_endpoint() -> str:
    """$MACE_ENDPOINT, else this user's own daemon if its socket exists, else the system service."""
    explicit = os.environ.get(ENDPOINT_ENV)
    if explicit:
        return explicit
    own = default_ipc_path()
    for path in (own, SYSTEM_IPC_PATH):
        if path.exists() and (path != own or own_socket(path)):
            return ipc_endpoint(path)
    if own.exists():
        raise UntrustedSocket(f"{own} is not owned by this user (or its folder is writable by others): "
                              f"it may be another user's trap; remove it or set ${ENDPOINT_ENV}")
    return ipc_endpoint(own)


class UntrustedSocket(ValueError):
    """The default socket in a shared temporary folder belongs to someone else."""


def own_socket(path: Path) -> bool:
    """Whether a socket in a shared temporary folder is this user's: the folder and the socket
    are owned by us and no one else may write the folder. Anyone can create /tmp/mace-edge-<uid>
    first and listen there for another user's prompts; such a socket is not used."""
    if Path(tempfile.gettempdir()) not in path.parents:
        return True  # $RUNTIME_DIRECTORY / $XDG_RUNTIME_DIR are private to the user already
    try:
        folder, sock = path.parent.stat(), path.stat()
    except OSError:
        return False
    uid = os.getuid()
    return folder.st_uid == uid and sock.st_uid == uid and not folder.st_mode & 0o022


def parse_tcp(endpoint: str) -> tuple[str, int]:
    """'tcp://HOST:PORT' -> (host, port); ValueError with a readable message otherwise."""
    if not endpoint.startswith("tcp://"):
        raise ValueError(f"TCP endpoint must look like tcp://127.0.0.1:5555; got {endpoint!r}")
    rest = endpoint[len("tcp://"):]
    host, sep, port = rest.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"TCP endpoint needs a port in 1-65535: {endpoint!r}")
    return host.strip("[]"), int(port)


def is_loopback(host: str) -> bool:
    """Only 127.0.0.0/8, ::1 and 'localhost' count; '*' or 0.0.0.0 bind every interface."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # an interface name or a host name: may be reachable from outside


def prepare_ipc_dir(path: Path) -> None:
    """Create the socket's folder (owner + group only) and refuse one that another user controls,
    since whoever owns it could swap the socket for their own."""
    folder = path.parent
    if not folder.exists():
        folder.mkdir(parents=True, mode=0o750)
        os.chmod(folder, 0o750)  # explicit: the daemon's umask (077) would keep the group out

    info = folder.lstat()
    if folder.is_symlink() or info.st_uid != os.getuid():
        raise PermissionError(f"{folder} is not a directory owned by this user; refusing to put the "
                              "daemon's socket there")
    if len(str(path).encode()) > MAX_IPC_PATH_BYTES:
        raise ValueError(f"ipc socket path {path} is longer than {MAX_IPC_PATH_BYTES} bytes "
                         "(a Unix-socket limit); choose a shorter server.ipc")
