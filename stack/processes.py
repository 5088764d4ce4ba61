"""Child processes of the local stack, and the group that stops them all.

Every child runs in its own session (Ctrl-C reaches the parent only, which then stops
the children in order), gets SIGTERM if the parent dies (``PR_SET_PDEATHSIG``), and
writes its output to a log file whose tail goes into every error about it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import shutil
import signal
import socket
import subprocess
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, TypeVar

REPO = Path(__file__).resolve().parent.parent
STARTUP_TIMEOUT = 30.0
STOP_TIMEOUT = 15.0


class StartError(RuntimeError):
    """A child did not come up; the message ends with the tail of its log."""


class PortTakenError(StartError):
    """A child could not bind: its port was free when picked, then taken (a race with
    another process on the machine); starting again on another port fixes it."""


PORT_TAKEN_MARKERS = ("address already in use", "cannot bind socket")


CHOSEN_PORTS = range(25_000, 30_000)
"""Where :func:`free_port` chooses: above the demo's fixed ports (8081-10081) and the Redis
Cluster nodes' (20,000-25,000, ``stack.redis``), below their bus ports (30,000-35,000) and
the kernel's ephemeral range (``ip_local_port_range``, 32768-60999 by default)."""
HANDED_OUT: deque[int] = deque(maxlen=1024)
"""Ports :func:`free_port_in` returned lately in this process, never returned again while
here. A port still free is not a port still unpromised: a batch of children (three sidecars,
each with a gRPC and a metrics port) is built before any binds, and one accuracy run gave two
sidecars the same port. The one that lost the bind exited 1. Its replica's calls then went
to the other sidecar, which had bound that port."""


def ephemeral_ports(path: Path = Path("/proc/sys/net/ipv4/ip_local_port_range")) -> range:
    """The ports the kernel gives outgoing connections (its default where it does not say)."""
    try:
        low, high = (int(word) for word in path.read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999
    return range(low, high + 1)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now, outside the ephemeral range when there is room.

    A port the kernel picks (bind to 0) is an ephemeral one: between our closing it and a
    child binding it, any process's outgoing connection (a client to Redis, Envoy to its
    upstream) may be given it, and the child fails with "address already in use" (loaded CI
    runs did). Below the ephemeral range no outgoing connection takes a port, so the only
    race left is with another chooser, one port in thousands (and the retry of a port race).
    """
    below = range(CHOSEN_PORTS.start, min(CHOSEN_PORTS.stop, ephemeral_ports().start))
    port = free_port_in(below, host) if len(below) >= 1000 else None
    if port is not None:
        return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def free_port_in(
    ports: range, host: str = "127.0.0.1", *, also_free: Callable[[int], bool] = lambda port: True, tries: int = 64
) -> int | None:
    """A random port of ``ports`` free on ``host`` (and for which ``also_free`` holds), None
    when ``tries`` picks found none: how every port outside the kernel's choice is chosen."""
    for _ in range(tries):
        port = random.choice(ports)
        if port not in HANDED_OUT and port_free(port, host) and also_free(port):
            HANDED_OUT.append(port)
            return port
    return None


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    """True when ``port`` can be bound on ``host``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((host, port))
        except OSError:
            return False
        return True


SETPRIV = shutil.which("setpriv")
"""util-linux's setpriv sets the parent-death signal and execs the command, so no Python
code runs between fork and exec (see :func:`with_parent_death_signal`)."""


def _die_with_parent() -> None:
    """Runs in the child before exec: SIGTERM when the parent dies (fallback only)."""
    with contextlib.suppress(Exception):
        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def _pinned(cpus: tuple[int, ...], then: Callable[[], None] | None) -> Callable[[], None]:
    """Runs in the child before exec: pin it to ``cpus``, then ``then``."""

    def setup() -> None:
        os.sched_setaffinity(0, cpus)
        if then is not None:
            then()

    return setup


def with_parent_death_signal(argv: Sequence[str]) -> tuple[list[str], Callable[[], None] | None]:
    """``argv`` that gets SIGTERM when this process dies, and the preexec function it needs.

    A Python ``preexec_fn`` runs in the forked child of a process whose other threads
    (gRPC's, in the tests and tools) may hold locks: it crashed once in CI, leaving a
    redis-server restart dead before exec. ``setpriv --pdeathsig`` does the same in C
    after exec; the Python fallback is kept for systems without util-linux.
    """
    if SETPRIV is not None:
        return [SETPRIV, "--pdeathsig", "TERM", "--", *argv], None
    return list(argv), _die_with_parent


def spawn(
    argv: Sequence[str],
    *,
    stdout: IO[bytes] | int | None,
    stderr: IO[bytes] | int | None = subprocess.STDOUT,
    stdin: IO[bytes] | int | None = subprocess.DEVNULL,
    env: Mapping[str, str] | None = None,
    cwd: Path | str = REPO,
    own_session: bool = True,
    die_with_parent: bool = True,
    cpus: tuple[int, ...] | None = None,
) -> subprocess.Popen[bytes]:
    """Start one child: the one place the stack, the tools and the test harnesses call ``Popen``
    for a long-running server (redis-server, a sidecar, a proxy, the sample app).

    By default it runs in the checkout, in its own session (Ctrl-C reaches the parent only,
    which then stops its children in order), and gets SIGTERM if the parent dies; with
    ``cpus`` it is pinned to them before exec.
    """
    command, preexec = with_parent_death_signal(argv) if die_with_parent else (list(argv), None)
    if cpus is not None:
        preexec = _pinned(cpus, preexec)
    return subprocess.Popen(
        command,
        stdin=stdin,
        stdout=stdout,
        stderr=stderr,
        cwd=cwd,
        env=None if env is None else dict(env),
        start_new_session=own_session,
        preexec_fn=preexec,  # noqa: PLW1509 - only without setpriv (see with_parent_death_signal)
    )


def tcp_answers(port: int, host: str = "127.0.0.1") -> bool:
    """True when something accepts TCP connections on ``host:port``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.settimeout(0.5)
        return probe.connect_ex((host, port)) == 0


class Child:
    """One child process with its output in ``log_path``."""

    def __init__(self, label: str, argv: Sequence[str], log_path: Path, env: Mapping[str, str] | None = None) -> None:
        self.label = label
        self.argv = list(argv)
        self.log_path = log_path
        self.env = dict(os.environ if env is None else env)
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.process = spawn(self.argv, stdout=log, env=self.env)

    @property
    def pid(self) -> int:
        assert self.process is not None, f"{self.label} was never started"
        return self.process.pid

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 20) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    ready_sign = "a listening socket"
    """What :meth:`ready` looks for, for error messages."""

    def ready(self) -> bool:
        """True once the child serves; subclasses probe their own protocol."""
        return True

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT) -> None:
        """Poll :meth:`ready` until True; :class:`StartError` if the child exits or time runs out."""
        deadline = time.monotonic() + timeout
        while True:
            if not self.alive():
                tail = self.log_tail()
                error = PortTakenError if any(mark in tail.lower() for mark in PORT_TAKEN_MARKERS) else StartError
                raise error(f"{self.label} exited before {self.ready_sign}:\n{tail}")
            if self.ready():
                return
            if time.monotonic() > deadline:
                raise StartError(f"{self.label}: no {self.ready_sign} after {timeout:.0f} s:\n{self.log_tail()}")
            time.sleep(0.05)

    def signal(self, signum: int) -> None:
        """Send ``signum`` if the child still runs."""
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(signum)

    def stop(self, timeout: float = STOP_TIMEOUT) -> int | None:
        """SIGTERM, wait up to ``timeout``, then SIGKILL; returns the exit code."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.process.returncode

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=5)


ChildT = TypeVar("ChildT", bound=Child)


class ProcessGroup:
    """Every child started through it; :meth:`close` stops them, newest first."""

    def __init__(self) -> None:
        self.children: list[Child] = []

    def start(self, child: ChildT) -> ChildT:
        self.children.append(child)
        child.start()
        return child

    def start_ready(self, build: Callable[[], ChildT], attempts: int = 3) -> ChildT:
        """Start ``build()`` and wait until it serves; on a port race, build it again
        (``build`` picks fresh ports) up to ``attempts`` times."""
        for attempt in range(1, attempts + 1):
            child = build()
            self.start(child)
            try:
                child.wait_ready()
            except PortTakenError:
                child.kill()
                self.children.remove(child)
                if attempt == attempts:
                    raise
                continue
            return child
        raise AssertionError("unreachable")

    def start_all_ready(self, builds: Sequence[Callable[[], ChildT]]) -> list[ChildT]:
        """Start every ``build()`` at once (they come up in parallel), then wait for each;
        one that lost a port race is built again through :meth:`start_ready`."""
        started = [self.start(build()) for build in builds]
        ready = []
        for build, child in zip(builds, started, strict=True):
            try:
                child.wait_ready()
            except PortTakenError:
                child.kill()
                self.children.remove(child)
                ready.append(self.start_ready(build))
            else:
                ready.append(child)
        return ready

    def stop(
        self,
        children: Sequence[Child],
        while_waiting: Callable[[], None] | None = None,
        timeout: float = STOP_TIMEOUT,
    ) -> dict[str, int | None]:
        """SIGTERM all of ``children`` at once, wait for them (calling ``while_waiting``
        meanwhile), SIGKILL what is left after ``timeout``; returns the exit code per label."""
        for child in children:
            child.signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while any(child.alive() for child in children) and time.monotonic() < deadline:
            if while_waiting is not None:
                while_waiting()
            time.sleep(0.05)
        codes = {child.label: child.stop(timeout=0) for child in children}
        for child in children:
            with contextlib.suppress(ValueError):
                self.children.remove(child)
        return codes

    def close(self, timeout: float = STOP_TIMEOUT) -> dict[str, int | None]:
        """Stop every child still running, newest first (proxies before what they call)."""
        return self.stop(list(reversed(self.children)), timeout=timeout)


@contextlib.contextmanager
def process_group() -> Iterator[ProcessGroup]:
    """A :class:`ProcessGroup` closed on exit, whatever happened inside."""
    group = ProcessGroup()
    try:
        yield group
    finally:
        group.close()
