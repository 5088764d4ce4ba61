"""redis-server, the one launcher: a plain server, TLS and ACL flags, Cluster nodes joined by
``redis-cli --cluster create``, and Sentinel.

Every redis-server the stack, the load tools and the test harnesses start gets its command
line from :func:`server_argv` (or :func:`sentinel_argv`) and its process from
:func:`stack.processes.spawn`: loopback only, no persistence unless asked for.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import IO

from stack.processes import Child, free_port, spawn

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"
REDIS_CLI = shutil.which("redis-cli") or "/usr/bin/redis-cli"


def available() -> bool:
    """True when redis-server is installed."""
    return Path(REDIS_SERVER).exists() or shutil.which("redis-server") is not None


def server_argv(port: int, directory: Path | None = None, *, tls: bool = False, extra: Sequence[str] = ()) -> list[str]:
    """redis-server on 127.0.0.1:``port`` (TLS only with ``tls``: plain port off), persistence
    off, its files in ``directory``; ``extra`` flags last (they win over the defaults)."""
    ports = ["--port", "0", "--tls-port", str(port)] if tls else ["--port", str(port)]
    files = ["--dir", str(directory)] if directory is not None else []
    return [REDIS_SERVER, *ports, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", *files, *extra]


def tls_flags(cert: Path, key: Path, ca: Path) -> list[str]:
    """The flags of a TLS-only server whose clients need no certificate of their own."""
    return [
        *("--tls-cert-file", str(cert), "--tls-key-file", str(key), "--tls-ca-cert-file", str(ca)),
        *("--tls-auth-clients", "no"),
    ]


def acl_flags(user: str, password: str) -> list[str]:
    """Only ``user`` with ``password`` gets in; the default user is off."""
    return ["--user", user, "on", f">{password}", "~*", "&*", "+@all", "--user", "default", "off"]


CLUSTER_FLAGS = ("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "2000")
"""The flags of a Cluster node (see :func:`create_cluster`)."""


def create_cluster(addresses: Sequence[str], timeout: float, replicas: int = 0) -> subprocess.CompletedProcess[str]:
    """``redis-cli --cluster create`` over running Cluster nodes: masters only by default,
    else ``replicas`` replicas per master (``addresses`` then holds masters x (1 + replicas))."""
    return subprocess.run(
        [REDIS_CLI, "--cluster", "create", *addresses, "--cluster-replicas", str(replicas), "--cluster-yes"],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def sentinel_argv(conf: Path) -> list[str]:
    """redis-server as a Sentinel reading ``conf`` (which it rewrites)."""
    return [REDIS_SERVER, str(conf), "--sentinel"]


def start(argv: Sequence[str], log: IO[bytes]) -> subprocess.Popen[bytes]:
    """A redis-server (or Sentinel) with its output to ``log``, as the test harnesses run it:
    in the caller's session and directory, killed by the caller."""
    return spawn(argv, stdout=log, stdin=None, cwd=Path.cwd(), own_session=False, die_with_parent=False)


class RedisProcess(Child):
    """redis-server on loopback without persistence, its files in ``directory``."""

    ready_sign = "PONG"

    def __init__(self, directory: Path, port: int = 0, extra: Sequence[str] = ()) -> None:
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}"
        argv = server_argv(self.port, directory, extra=["--daemonize", "no", "--loglevel", "warning", *extra])
        super().__init__("redis", argv, directory / "redis.log")

    def ready(self) -> bool:
        """One PING over a raw socket (no client library needed)."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as connection:
                connection.sendall(b"PING\r\n")
                return connection.recv(16).startswith(b"+PONG")
        except OSError:
            return False
