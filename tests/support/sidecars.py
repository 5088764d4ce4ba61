"""Run the real ``ratelimit-sidecar serve`` process and talk gRPC to it.

The command lines and the processes come from the one launcher, ``stack/sidecar.py``.
The fixtures in ``conftest.py`` hand these out; every process started through
:func:`sidecar_factory` is killed when the factory's context ends, whatever the
test did, so no process outlives its test (or the session, for the shared one).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import textwrap
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from sidecar.protos.envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from sidecar.protos.envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc
from stack.processes import free_port, spawn
from stack.sidecar import cli_argv, serve_argv

SERVICE_NAME = "envoy.service.ratelimit.v3.RateLimitService"
METHOD = f"/{SERVICE_NAME}/ShouldRateLimit"
STARTUP_DEADLINE = 20.0
"""Seconds a sidecar gets to report SERVING; generous for a loaded 2-core machine."""
CLI_TIMEOUT = 30.0
CHANNEL_OPTIONS = [
    # The first health probes usually race the bind; gRPC's default reconnect backoff
    # (1 s, growing) would then make every start take a second or more.
    ("grpc.initial_reconnect_backoff_ms", 20),
    ("grpc.min_reconnect_backoff_ms", 20),
    ("grpc.max_reconnect_backoff_ms", 100),
]
T = TypeVar("T")

OK = rls_pb2.RateLimitResponse.OK
OVER_LIMIT = rls_pb2.RateLimitResponse.OVER_LIMIT

CONFIG = textwrap.dedent(
    """\
    # Integration test config: key-only rules count each value separately,
    # so every test picks fresh values and never shares a counter with another.
    domain: it
    descriptors:
      - key: per_minute
        rate_limit:
          name: five_per_minute
          unit: minute
          requests_per_unit: 5
      - key: per_second
        rate_limit:
          unit: second
          requests_per_unit: 3
      - key: pair_a
        rate_limit:
          unit: minute
          requests_per_unit: 10
      - key: pair_b
        rate_limit:
          unit: minute
          requests_per_unit: 2
      - key: generous
        rate_limit:
          unit: hour
          requests_per_unit: 1000000
      - key: free
        rate_limit:
          unlimited: true
    """
)


def clean_env(**extra: str) -> dict[str, str]:
    """The test's environment without any ``RLS_*`` variable, plus ``extra``.

    The metrics endpoint is off unless ``extra`` asks for it: its default port is one
    per machine, and tests run many sidecars at once."""
    env = {name: value for name, value in os.environ.items() if not name.startswith("RLS_")}
    env["RLS_METRICS_ADDRESS"] = ""
    env.update(extra)
    return env


def run_cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = CLI_TIMEOUT
) -> subprocess.CompletedProcess[str]:
    """Run ``python -m sidecar ARGS`` to completion and capture its output."""
    return subprocess.run(
        cli_argv(*args),
        capture_output=True,
        text=True,
        env=env if env is not None else clean_env(),
        timeout=timeout,
        check=False,
    )


def write_config(directory: Path, text: str = CONFIG, name: str = "it.yaml") -> Path:
    """Write one config file into ``directory`` (created if needed) and return the directory."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / name).write_text(text)
    return directory


def request(domain: str, *descriptors: Sequence[tuple[str, str]], hits: int = 0) -> rls_pb2.RateLimitRequest:
    """A ``RateLimitRequest``; each descriptor is a sequence of ``(key, value)`` pairs."""
    return rls_pb2.RateLimitRequest(
        domain=domain,
        hits_addend=hits,
        descriptors=[
            ratelimit_pb2.RateLimitDescriptor(
                entries=[ratelimit_pb2.RateLimitDescriptor.Entry(key=key, value=value) for key, value in entries]
            )
            for entries in descriptors
        ],
    )


def window_of(moment: float, unit_seconds: int) -> int:
    """Start of the wall-clock window holding ``moment``, as the sidecar computes it."""
    whole = math.floor(moment)
    return whole - whole % unit_seconds


def in_one_window(unit_seconds: int, attempt: Callable[[], T], tries: int = 4) -> T:
    """Run ``attempt`` until one run starts and ends in the same window; return its result.

    Counting tests assert exact numbers, which only hold if no window boundary passed
    while they ran. The sidecar stamps each call between our ``before`` and ``after``,
    so equal windows at both ends prove every call landed in one window. ``attempt``
    must use fresh descriptor values each time so a failed run leaves nothing behind.
    """
    for _ in range(tries):
        before = time.time()
        if unit_seconds == 1 and before % 1 > 0.6:
            # Too close to a per-second boundary on a slow machine: start just after it.
            time.sleep(math.ceil(before) - before + 0.01)
            before = time.time()
        result = attempt()
        if window_of(before, unit_seconds) == window_of(time.time(), unit_seconds):
            return result
    pytest.fail(f"every attempt straddled a {unit_seconds}s window boundary")


def metric(text: str, name: str, **labels: str) -> float | None:
    """The value of one sample in Prometheus text (``/metrics``), or None when it is absent."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return None


def log_events(stderr: str) -> list[dict[str, Any]]:
    """The JSON log lines of a sidecar's stderr, parsed (other lines skipped)."""
    events = []
    for line in stderr.splitlines():
        with contextlib.suppress(ValueError):
            parsed = json.loads(line)
            if isinstance(parsed, dict):
                events.append(parsed)
    return events


class Sidecar:
    """One real ``serve`` process on a loopback port, with a channel to it."""

    def __init__(
        self,
        workdir: Path,
        args: Sequence[str],
        env: dict[str, str],
        credentials: grpc.ChannelCredentials | None = None,
        metrics: bool = False,
    ) -> None:
        self.workdir = workdir
        self.args = list(args)
        self.env = env
        self.credentials = credentials
        """TLS credentials for a sidecar serving TLS; None for plaintext."""
        self.metrics = metrics
        """Whether the metrics endpoint listens, on :attr:`metrics_port` (picked with the gRPC port)."""
        self.metrics_port = 0
        self.port = 0
        self.address = ""
        self.process: subprocess.Popen[bytes] | None = None
        self.channel: grpc.Channel | None = None
        self.stderr_path = workdir / "stderr.log"
        self.stdout_path = workdir / "stdout.log"

    # -- life cycle -------------------------------------------------------------

    def start(self, port: int | None = None, pass_address: bool = True) -> Sidecar:
        """Start the process and return once gRPC health says SERVING.

        With ``pass_address`` False the caller provides the address itself (for example
        through ``RLS_GRPC_ADDRESS``) and must pass the matching ``port``.
        """
        attempts = 3 if port is None or self.metrics else 1  # a port of ours may be taken meanwhile
        for attempt in range(attempts):
            self.port = port if port is not None else free_port()
            self.address = f"127.0.0.1:{self.port}"
            args = self.args
            if self.metrics:  # a fresh port on each attempt: either port may be the one taken
                self.metrics_port = free_port()
                args = [*args, "--metrics-address", f"127.0.0.1:{self.metrics_port}"]
            command = serve_argv(args, grpc_address=self.address if pass_address else None)
            with self.stdout_path.open("wb") as out, self.stderr_path.open("wb") as err:
                self.process = spawn(
                    command, stdout=out, stderr=err, stdin=None, env=self.env, cwd=self.workdir,
                    own_session=False, die_with_parent=False,
                )  # fmt: skip
            try:
                self._wait_serving()
                return self
            except PortTakenError:
                # Another process took the free port between our probe and the bind.
                if attempt == attempts - 1:
                    raise
        raise AssertionError("unreachable")

    def _wait_serving(self) -> None:
        assert self.process is not None
        if self.credentials is None:
            self.channel = grpc.insecure_channel(self.address, options=CHANNEL_OPTIONS)
        else:
            self.channel = grpc.secure_channel(self.address, self.credentials, options=CHANNEL_OPTIONS)
        stub = health_pb2_grpc.HealthStub(self.channel)
        deadline = time.monotonic() + STARTUP_DEADLINE
        last_error = "no answer yet"
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                stderr = self.stderr()
                self.close_channel()
                if "Address already in use" in stderr:
                    raise PortTakenError(stderr)
                pytest.fail(f"sidecar exited with {self.process.returncode} before SERVING:\n{stderr}")
            try:
                answer = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
                if answer.status == health_pb2.HealthCheckResponse.SERVING:
                    return
                last_error = f"status {answer.status}"
            except grpc.RpcError as error:
                last_error = f"{error.code().name}: {error.details()}"
            time.sleep(0.02)
        self.kill()
        pytest.fail(f"sidecar not SERVING within {STARTUP_DEADLINE}s ({last_error}):\n{self.stderr()}")

    def send_signal(self, sig: signal.Signals) -> None:
        assert self.process is not None
        self.process.send_signal(sig)

    def wait(self, timeout: float) -> int:
        """Wait for the process to exit; returns its exit code."""
        assert self.process is not None
        return self.process.wait(timeout=timeout)

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def close_channel(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None

    def kill(self) -> None:
        """SIGKILL if still running, reap it, close the channel; safe to call twice."""
        self.close_channel()
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=10)

    # -- talking to it ------------------------------------------------------------

    @property
    def rls(self) -> rls_pb2_grpc.RateLimitServiceStub:
        assert self.channel is not None
        return rls_pb2_grpc.RateLimitServiceStub(self.channel)

    @property
    def health(self) -> health_pb2_grpc.HealthStub:
        assert self.channel is not None
        return health_pb2_grpc.HealthStub(self.channel)

    def ask(self, req: rls_pb2.RateLimitRequest, timeout: float = 5.0) -> Any:
        return self.rls.ShouldRateLimit(req, timeout=timeout)

    def health_status(self, service: str = "") -> int:
        answer = self.health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5.0)
        return int(answer.status)

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def event(self, name: str, timeout: float = 10.0) -> dict[str, Any]:
        """The first log event called ``name``, waiting for it: the sidecar reports SERVING
        before ``sidecar_started`` is written (the watcher's first look comes in between)."""
        deadline = time.monotonic() + timeout
        while True:
            found = [event for event in log_events(self.stderr()) if event.get("event") == name]
            if found:
                return found[0]
            if time.monotonic() > deadline:
                raise AssertionError(f"no {name} event within {timeout} s:\n{self.stderr()}")
            time.sleep(0.05)

    def stdout(self) -> str:
        return self.stdout_path.read_text(errors="replace")


class PortTakenError(Exception):
    """The sidecar lost the race for the port :func:`free_port` found."""


SidecarFactory = Callable[..., Sidecar]


@contextlib.contextmanager
def sidecar_factory(base: Path) -> Iterator[SidecarFactory]:
    """Yield ``start(*serve_flags, config=, env=, port=, pass_address=, metrics=)``; kill them all on exit.

    ``metrics=True`` turns the metrics endpoint on, on a port picked with the gRPC port and
    picked again with it when a start finds either taken (``sidecar.metrics_port``)."""
    started: list[Sidecar] = []

    def start(
        *args: str,
        config: Path | None = None,
        env: dict[str, str] | None = None,
        port: int | None = None,
        pass_address: bool = True,
        probe_tls: Path | None = None,
        probe_client: tuple[Path, Path] | None = None,
        metrics: bool = False,
    ) -> Sidecar:
        workdir = base / f"sidecar-{len(started)}"
        workdir.mkdir(parents=True, exist_ok=True)
        argv = [*args, "--log-format", "json"]
        if config is not None:
            argv += ["--config", str(config)]
        credentials = None
        if probe_tls is not None:
            cert, key = probe_client or (None, None)
            credentials = grpc.ssl_channel_credentials(
                probe_tls.read_bytes(), key.read_bytes() if key else None, cert.read_bytes() if cert else None
            )
        sidecar = Sidecar(workdir, argv, env if env is not None else clean_env(), credentials, metrics)
        started.append(sidecar)
        return sidecar.start(port=port, pass_address=pass_address)

    try:
        yield start
    finally:
        for sidecar in started:
            sidecar.kill()


def wait_for_replicas(port: int, live: int, timeout: float = 10.0) -> None:
    """Poll a sidecar's /metrics until it counts ``live`` replicas."""
    deadline = time.monotonic() + timeout
    seen = None
    while time.monotonic() < deadline:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as answer:
            seen = metric(answer.read().decode(), "ratelimit_sidecar_replicas")
        if seen == live:
            return
        time.sleep(0.05)
    pytest.fail(f"the sidecar on metrics port {port} counted {seen} replicas, not {live}, after {timeout} s")
