"""Child processes of the harness: one redis-server and R sidecars, all on loopback.

Every child runs in its own session (Ctrl-C reaches the harness only) and gets
SIGTERM if the harness dies (``PR_SET_PDEATHSIG``); :class:`stack.processes.ProcessGroup` stops
whatever it started, also on exceptions, so nothing outlives a run.
"""

from __future__ import annotations

import contextlib
import json
import signal
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from loadtest.common import health_serving, start_child
from stack import redis
from stack import sidecar as stack_sidecar
from stack.processes import Child as StackChild
from stack.processes import free_port

REPO = Path(__file__).resolve().parents[2]
REDIS_SERVER = redis.REDIS_SERVER
STARTUP_TIMEOUT = 30.0
STOP_TIMEOUT = 20.0
UNAVAILABLE_MARKERS = ("notimplemented", "not implemented", "not available", "unavailable", "unsupported")
"""Words in a startup error that mean "this backend does not exist yet", not "it is broken"."""


class ChildStartError(RuntimeError):
    """A child did not come up; the message holds the tail of its log."""

    def __init__(self, message: str, log_tail: str = "") -> None:
        super().__init__(message)
        self.log_tail = log_tail

    @property
    def means_unavailable(self) -> bool:
        """True when the child said its backend is not implemented / not available."""
        text = f"{self}\n{self.log_tail}".lower()
        return any(marker in text for marker in UNAVAILABLE_MARKERS)


SERVER_CPUS: tuple[int, ...] | None = None
"""Pin redis-server and the sidecars to these cpus (``--server-cpus``); None: no pinning."""


def clean_env() -> dict[str, str]:
    """The harness environment without ``RLS_*`` variables: only flags configure sidecars."""
    return stack_sidecar.clean_env()


class Child(StackChild):
    """A child of the harness: the stack's child, pinned to ``SERVER_CPUS``, configured by
    flags only (no ``RLS_*`` variables), and sent SIGTERM at most once."""

    def __init__(self, label: str, argv: Sequence[str], log_path: Path) -> None:
        super().__init__(label, argv, log_path, env=clean_env())
        self.terminated = False
        self.cpus: tuple[int, ...] | None = None
        """Pin to these cpus instead of ``SERVER_CPUS`` (a scenario's own pinning)."""

    def start(self) -> None:
        with self.log_path.open("wb") as log:
            # Pinned to SERVER_CPUS if set, SIGTERM when the harness dies, in its own session.
            self.process = start_child(self.argv, log, env=self.env, cpus=self.cpus or SERVER_CPUS)

    def signal(self, signum: int) -> None:
        """SIGTERM once only: a second one could land after the child removed its handler."""
        if signum == signal.SIGTERM:
            if self.terminated:
                return
            self.terminated = True
        super().signal(signum)

    def terminate(self) -> None:
        self.signal(signal.SIGTERM)


class RedisServer(Child):
    """redis-server on a free loopback port: no persistence, its files in ``directory``."""

    def __init__(self, directory: Path) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}"
        directory.mkdir(parents=True, exist_ok=True)
        argv = redis.server_argv(
            self.port, directory, extra=["--protected-mode", "yes", "--daemonize", "no", "--loglevel", "warning"]
        )
        super().__init__("redis", argv, directory / "redis.log")

    def client(self) -> Any:
        import redis as redis_client

        return redis_client.Redis(host="127.0.0.1", port=self.port, socket_timeout=10, decode_responses=True)

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT) -> None:
        import redis as redis_client

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise ChildStartError("redis-server exited at start", self.log_tail())
            with contextlib.suppress(redis_client.RedisError), self.client() as client:
                if client.ping():
                    return
            time.sleep(0.05)
        raise ChildStartError(f"redis-server not answering after {timeout:.0f} s", self.log_tail())


class Sidecar(Child):
    """``python -m sidecar serve`` on a free loopback port, JSON logs to a file."""

    def __init__(self, index: int, serve_args: Sequence[str], directory: Path) -> None:
        self.index = index
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        argv = stack_sidecar.serve_argv(
            [*serve_args, "--log-format", "json"], grpc_address=self.address, metrics_address=""
        )
        super().__init__(f"sidecar-{index}", argv, directory / f"sidecar-{index}.log")

    def serving(self) -> bool:
        """One gRPC health probe: True when SERVING."""
        return health_serving(self.address)

    def events(self) -> list[dict[str, Any]]:
        """The JSON log events this sidecar wrote (other lines skipped)."""
        events = []
        for line in self.log_text().splitlines():
            with contextlib.suppress(ValueError):
                parsed = json.loads(line)
                if isinstance(parsed, dict):
                    events.append(parsed)
        return events


class Hog(Child):
    """A CPU-bound busy loop pinned to ``cpus``: what shares a throttled sidecar's core."""

    def __init__(self, index: int, cpus: tuple[int, ...], directory: Path) -> None:
        super().__init__(f"hog-{index}", [sys.executable, "-c", "while True: pass"], directory / f"hog-{index}.log")
        self.cpus = cpus


def wait_all_serving(sidecars: Sequence[Sidecar], timeout: float = STARTUP_TIMEOUT) -> None:
    """Until every sidecar reports SERVING; :class:`ChildStartError` with its log otherwise."""
    deadline = time.monotonic() + timeout
    waiting = list(sidecars)
    while waiting:
        for sidecar in list(waiting):
            if not sidecar.alive():
                tail = sidecar.log_tail()
                last = tail.splitlines()[-1] if tail else "(no output)"
                raise ChildStartError(f"{sidecar.label} exited at start: {last}", tail)
            if sidecar.serving():
                waiting.remove(sidecar)
        if waiting and time.monotonic() > deadline:
            sidecar = waiting[0]
            raise ChildStartError(f"{sidecar.label} not SERVING after {timeout:.0f} s", sidecar.log_tail())
        if waiting:
            time.sleep(0.05)


def on_sigterm_raise_interrupt() -> Callable[[], None]:
    """Turn SIGTERM into KeyboardInterrupt so the ``finally`` blocks stop the children."""

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, handler)

    def restore() -> None:
        signal.signal(signal.SIGTERM, previous)

    return restore
