"""The servers ``compare`` starts, each on a free loopback port with its log in a temporary file."""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from loadtest.common import health_serving, start_child
from loadtest.grpc_bench.mix import REPO
from stack.processes import free_port

# ---------------------------------------------------------------------------------
# Servers started by "compare"
# ---------------------------------------------------------------------------------


class ServerProcess:
    """A server child on a free loopback port, its log in a temporary file."""

    def __init__(
        self,
        label: str,
        argv: Sequence[str],
        cpus: tuple[int, ...] | None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.label = label
        self.env = {**os.environ, **(env or {})}
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.argv = [*argv, "--grpc-address", self.address]
        self.cpus = cpus
        self.log = tempfile.NamedTemporaryFile(  # noqa: SIM115 - closed in stop()
            prefix=f"grpc_bench-{label}-", suffix=".log", delete=False
        )
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        # Pinned to self.cpus, SIGTERM if we die; its own session: Ctrl-C reaches us only.
        self.process = start_child(self.argv, self.log, env=self.env, cpus=self.cpus)

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Until the health service says SERVING; fail with the log tail otherwise."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.label} exited at start:\n{self.log_tail()}")
            if health_serving(self.address):
                self.pin_threads()
                return
            time.sleep(0.1)
        raise RuntimeError(f"{self.label} not SERVING after {timeout:.0f} s:\n{self.log_tail()}")

    def pin_threads(self) -> None:
        """Re-apply the pinning to every thread (they inherit it; this is a check)."""
        if self.cpus is None:
            return
        for task in Path(f"/proc/{self.pid}/task").iterdir():
            with contextlib.suppress(OSError):
                os.sched_setaffinity(int(task.name), self.cpus)

    def log_tail(self, lines: int = 20) -> str:
        self.log.flush()
        text = Path(self.log.name).read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 5 s; always reaps the child."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=5)
        self.log.close()

    def discard_log(self) -> None:
        with contextlib.suppress(OSError):
            Path(self.log.name).unlink()


def config_path(text: str) -> str:
    """Absolute path of ``--config``: as given if it exists, else relative to the repo."""
    path = Path(text)
    return str(path.resolve() if path.exists() else REPO / path)
