"""The sidecar, the one launcher: ``python -m sidecar serve`` (and the other subcommands).

Every sidecar the stack, the load tools and the test harnesses start gets its command line
from :func:`serve_argv` and its process from :func:`stack.processes.spawn`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import grpc

from sidecar.client import health_status
from stack.processes import Child, free_port


def cli_argv(*args: str, program: Sequence[str] | None = None) -> list[str]:
    """``python -m sidecar ARGS`` with this interpreter, or ``PROGRAM ARGS`` (an installed
    ``ratelimit-sidecar`` console script, as the wheel test runs it)."""
    return [*(program or (sys.executable, "-m", "sidecar")), *args]


def serve_argv(
    serve_args: Sequence[str],
    *,
    grpc_address: str | None = None,
    metrics_address: str | None = None,
    program: Sequence[str] | None = None,
) -> list[str]:
    """``python -m sidecar serve SERVE_ARGS`` (or ``PROGRAM serve ...``) then the addresses, when given."""
    argv = cli_argv("serve", *serve_args, program=program)
    if grpc_address is not None:
        argv += ["--grpc-address", grpc_address]
    if metrics_address is not None:
        argv += ["--metrics-address", metrics_address]
    return argv


def clean_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """``base`` (this process's environment) without ``RLS_*``: only flags configure the sidecar."""
    return {key: value for key, value in (os.environ if base is None else base).items() if not key.startswith("RLS_")}


class SidecarProcess(Child):
    """``python -m sidecar serve`` (or ``program serve``) with ``serve_args``, in ``env`` (default:
    this process's environment); ``RLS_*`` variables are not inherited."""

    ready_sign = "gRPC health SERVING"

    def __init__(
        self,
        name: str,
        serve_args: Sequence[str],
        directory: Path,
        port: int = 0,
        *,
        program: Sequence[str] | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.port = port or free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.metrics_port = free_port()
        self.metrics_url = f"http://127.0.0.1:{self.metrics_port}"
        """``/metrics``, ``/config`` and ``/healthz`` of this sidecar."""
        argv = serve_argv(
            serve_args, grpc_address=self.address, metrics_address=f"127.0.0.1:{self.metrics_port}", program=program
        )
        super().__init__(name, argv, directory / f"{name}.log", env=clean_env(env))

    def ready(self) -> bool:
        try:
            return health_status(self.address, timeout=0.5) == "SERVING"
        except grpc.RpcError:
            return False
