"""The processes of the stack other than the proxies: redis-server, sidecars, the upstream app."""

from __future__ import annotations

import os
import shutil
import socket
import sys
from collections.abc import Sequence
from pathlib import Path

import grpc

from sidecar.client import health_status
from stack.processes import Child, free_port

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"


def tcp_answers(port: int, host: str = "127.0.0.1") -> bool:
    """True when something accepts TCP connections on ``host:port``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.settimeout(0.5)
        return probe.connect_ex((host, port)) == 0


class RedisProcess(Child):
    """redis-server on loopback without persistence, its files in ``directory``."""

    ready_sign = "PONG"

    def __init__(self, directory: Path, port: int = 0) -> None:
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}"
        argv = [
            REDIS_SERVER,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", str(directory),
            "--daemonize", "no",
            "--loglevel", "warning",
        ]  # fmt: skip
        super().__init__("redis", argv, directory / "redis.log")

    def ready(self) -> bool:
        """One PING over a raw socket (no client library needed)."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as connection:
                connection.sendall(b"PING\r\n")
                return connection.recv(16).startswith(b"+PONG")
        except OSError:
            return False


class SidecarProcess(Child):
    """``python -m sidecar serve`` with ``serve_args``; ``RLS_*`` variables are not inherited."""

    ready_sign = "gRPC health SERVING"

    def __init__(self, name: str, serve_args: Sequence[str], directory: Path, port: int = 0) -> None:
        self.port = port or free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.metrics_port = free_port()
        self.metrics_url = f"http://127.0.0.1:{self.metrics_port}"
        """``/metrics``, ``/config`` and ``/healthz`` of this sidecar."""
        argv = [
            sys.executable, "-m", "sidecar", "serve", *serve_args,
            "--grpc-address", self.address,
            "--metrics-address", f"127.0.0.1:{self.metrics_port}",
        ]  # fmt: skip
        env = {key: value for key, value in os.environ.items() if not key.startswith("RLS_")}
        super().__init__(name, argv, directory / f"{name}.log", env=env)

    def ready(self) -> bool:
        try:
            return health_status(self.address, timeout=0.5) == "SERVING"
        except grpc.RpcError:
            return False


class UpstreamProcess(Child):
    """The sample app (``stack/upstream.py``) answering 200 with its name in the body."""

    def __init__(self, name: str, directory: Path, port: int = 0) -> None:
        self.port = port or free_port()
        argv = [sys.executable, "-m", "stack.upstream", "--port", str(self.port), "--name", name]
        super().__init__(name, argv, directory / f"{name}.log")

    def ready(self) -> bool:
        return tcp_answers(self.port)
