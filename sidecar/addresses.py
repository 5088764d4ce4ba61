"""Where the sidecar listens: addresses checked before gRPC binds, and unix sockets made private.

Kept apart from the server so the checks are tested on their own and the server module
stays about serving.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
from collections.abc import Iterator
from pathlib import Path

UNIX_SOCKET_MODE = 0o660
"""Mode of a ``unix:PATH`` gRPC socket, set after the bind whatever the umask.

Connecting to a unix socket needs write permission on it, so this says who may call the
sidecar: its own user and its group (the image's dedicated ``ratelimit`` group, 10001;
Envoy joins it with ``runAsGroup`` or ``supplementalGroups``), nobody else on the host.
"""


class StartupError(Exception):
    """The sidecar cannot start; the message is one line meant for the operator."""


def is_unix(address: str) -> bool:
    """A ``unix:PATH`` gRPC address (a unix domain socket)."""
    return address.startswith("unix:")


def is_loopback(address: str) -> bool:
    """True for addresses only this host can reach (127.0.0.0/8, ::1, localhost, unix sockets)."""
    if is_unix(address):
        return True
    host = address.rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def unix_socket_path(address: str) -> Path:
    """The file of a ``unix:PATH`` (or ``unix:///abs/path``) address."""
    return Path(address.removeprefix("unix:").removeprefix("//"))


@contextlib.contextmanager
def unix_socket_created_private(address: str) -> Iterator[None]:
    """While gRPC binds ``address``, a umask that creates a unix socket no wider than
    :data:`UNIX_SOCKET_MODE`; then the mode is set exactly.

    gRPC creates the socket ``0777 & ~umask`` and listens at once (it accepts only once the
    server starts, but a connection made meanwhile waits in the backlog), so setting the
    mode afterwards alone would leave an instant in which anyone could connect. The umask
    is the process's: this runs once, at startup, before anything is served.
    """
    if not is_unix(address):
        yield
        return
    previous = os.umask(0o777 & ~UNIX_SOCKET_MODE)
    try:
        yield
    finally:
        os.umask(previous)
    path = unix_socket_path(address)
    try:
        path.chmod(UNIX_SOCKET_MODE)
    except OSError as error:
        raise StartupError(f"cannot set the mode of {path}: {error.strerror}") from None


def ensure_bindable(address: str) -> None:
    """Fail with a plain message if ``address`` cannot be bound, before gRPC tries.

    gRPC's own bind failure arrives as a vague RuntimeError plus a C-core log line;
    binding a socket first names the real cause (in use, not an address of this host).
    A unix socket's directory must exist; gRPC replaces a socket file left behind.
    """
    if is_unix(address):
        path = unix_socket_path(address)
        if not path.parent.is_dir():
            raise StartupError(f"cannot listen on {address}: directory {path.parent} does not exist")
        return
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    try:
        infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except socket.gaierror as error:
        raise StartupError(f"cannot listen on {address}: {error.strerror}") from None
    family, kind, proto, _, sockaddr = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(sockaddr)
        except OSError as error:
            raise StartupError(f"cannot listen on {address}: {error.strerror}") from None
