"""Limits from a control plane, end to end: the real ADS server (stack/xds_server.py) and three
real sidecar processes with ``--config-source xds``.

Every change is polled for (each probe uses a fresh descriptor value, so it reads the limit,
not an old count); nothing here asserts how long a change takes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from stack.processes import free_port, spawn
from stack.tls import OPENSSL, make_certificates
from tests.support.sidecars import OK, Sidecar, SidecarFactory, metric, request

pytestmark = pytest.mark.slow

DEADLINE = 30.0
"""Seconds a change may take to show on a loaded 2-core machine before the test gives up."""
PROBE_HITS = 12


def limits(per_hour: int | None) -> str:
    """domain ``xt``: ``tenant`` allows ``per_hour``; None leaves the unit out (a NACKed push)."""
    unit = "" if per_hour is None else "unit: hour, "
    return f"domain: xt\ndescriptors:\n  - key: tenant\n    rate_limit: {{{unit}requests_per_unit: {per_hour or 4}}}\n"


class ControlPlane:
    """``python -m stack.xds_server`` on a fixed port, its JSON lines in a log file."""

    def __init__(self, directory: Path, log: Path, extra: Sequence[str] = ()) -> None:
        self.directory, self.log, self.port, self.extra = directory, log, free_port(), list(extra)
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        argv = [sys.executable, "-m", "stack.xds_server", "--dir", str(self.directory), "--port", str(self.port)]
        argv += self.extra
        with self.log.open("ab") as out:
            self.process = spawn(argv, stdout=out, own_session=False, die_with_parent=False)
        poll_until(lambda: any(e["event"] == "listening" for e in self.events()), "the control plane listening")

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)

    def events(self) -> list[dict[str, Any]]:
        lines = self.log.read_text().splitlines() if self.log.exists() else []
        return [json.loads(line) for line in lines if line.startswith("{")]


def publish(file: Path, text: str) -> None:
    """Replace a limits file at once: the control plane never reads it half written."""
    scratch = file.with_suffix(".tmp")
    scratch.write_text(text)
    os.replace(scratch, file)


def poll_until(done: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + DEADLINE
    while not done():
        if time.monotonic() > deadline:
            raise AssertionError(f"not seen within {DEADLINE} s: {what}")
        time.sleep(0.1)


probes = iter(range(1_000_000))


def allowed(sidecar: Sidecar) -> int:
    """How many of PROBE_HITS requests with a never-used tenant the sidecar admits: its limit."""
    value = f"probe-{next(probes)}"
    return sum(sidecar.ask(request("xt", [("tenant", value)])).overall_code == OK for _ in range(PROBE_HITS))


def config_page(port: int) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/config", timeout=5) as answer:
        page: dict[str, Any] = json.load(answer)
    return page


def all_enforce(replicas: list[Sidecar], per_hour: int) -> bool:
    return all(allowed(replica) == per_hour for replica in replicas)


@pytest.fixture
def control_plane(tmp_path: Path) -> Iterator[ControlPlane]:
    directory = tmp_path / "limits"
    directory.mkdir()
    (directory / "tenants.yaml").write_text(limits(3))
    plane = ControlPlane(directory, tmp_path / "xds_server.log")
    plane.start()
    try:
        yield plane
    finally:
        plane.kill()


def test_three_replicas_follow_the_control_plane(control_plane: ControlPlane, start_sidecar: SidecarFactory) -> None:
    replicas = [
        start_sidecar(
            "--config-source", "xds", "--xds-server", f"127.0.0.1:{control_plane.port}",
            "--xds-node-id", f"replica-{n}", "--xds-backoff-max", "1",
            *([] if n == 0 else ["--metrics-address", ""]), metrics=n == 0,
        )
        for n in range(3)
    ]  # fmt: skip
    admin_port = replicas[0].metrics_port
    limits_file = control_plane.directory / "tenants.yaml"
    poll_until(lambda: all_enforce(replicas, 3), "the initial limit (3/hour) on every replica")

    publish(limits_file, limits(5))
    poll_until(lambda: all_enforce(replicas, 5), "the changed limit (5/hour) on every replica")

    publish(limits_file, limits(None))
    nacks = lambda: {e["node"]: e for e in control_plane.events() if e["event"] == "nack"}  # noqa: E731
    poll_until(lambda: len(nacks()) == 3, "a NACK from every replica")
    for nack in nacks().values():
        assert nack["error_detail"] == (
            "xds:tenants: descriptors[0].rate_limit.unit: invalid unit 'unknown' "
            "(one of second, minute, hour, day, week, month, year)"
        )
        assert nack["code"] == 3  # INVALID_ARGUMENT
    acked = {e["version"] for e in control_plane.events() if e["event"] == "ack"}
    assert {nack["version"] for nack in nacks().values()} <= acked  # the NACK names the version still served
    assert all_enforce(replicas, 5)  # the last good limits, still enforced
    shown = config_page(admin_port)
    assert shown["xds"]["version"] == nacks()["replica-0"]["version"]
    assert (shown["xds"]["applied"], shown["xds"]["rejected"]) == (2, 1)
    assert "unit" in shown["xds"]["last_error"]
    with urllib.request.urlopen(f"http://127.0.0.1:{admin_port}/metrics", timeout=5) as answer:
        text = answer.read().decode()
    assert metric(text, "ratelimit_sidecar_xds_updates_total", result="applied") == 2
    assert metric(text, "ratelimit_sidecar_xds_updates_total", result="rejected") == 1
    assert metric(text, "ratelimit_sidecar_xds_connected") == 1
    assert metric(text, "ratelimit_sidecar_xds_config_version", version=shown["xds"]["version"][:64]) == 1
    replicas[1].send_signal(signal.SIGHUP)  # no file reload in this mode
    replicas[1].event("config_reload_ignored")
    assert all_enforce(replicas, 5)

    control_plane.kill()
    assert all_enforce(replicas, 5)  # the server away: nothing changes
    publish(limits_file, limits(2))
    control_plane.start()
    poll_until(lambda: all_enforce(replicas, 2), "the limit of the restarted control plane (2/hour) on every replica")
    for replica in replicas:
        assert "xds_reconnecting" in replica.stderr()


def test_the_fallback_config_serves_until_the_first_push(tmp_path: Path, start_sidecar: SidecarFactory) -> None:
    fallback = tmp_path / "fallback"
    fallback.mkdir()
    (fallback / "tenants.yaml").write_text(limits(4))
    plane = ControlPlane(tmp_path / "limits", tmp_path / "xds_server.log")  # not started: nobody answers yet
    plane.directory.mkdir()
    (plane.directory / "tenants.yaml").write_text(limits(2))
    replica = start_sidecar(
        "--config-source", "xds", "--xds-server", f"127.0.0.1:{plane.port}", "--xds-backoff-max", "1",
        "--metrics-address", "", config=fallback,
    )  # fmt: skip
    try:
        assert allowed(replica) == 4
        plane.start()
        poll_until(lambda: allowed(replica) == 2, "the control plane's limit replacing the fallback")
    finally:
        plane.kill()


def test_a_missing_fallback_starts_with_no_limits(tmp_path: Path, start_sidecar: SidecarFactory) -> None:
    """The image's default --config (/etc/ratelimit/config) with nothing mounted: xDS alone."""
    nowhere = tmp_path / "not-mounted"
    replica = start_sidecar(
        "--config-source", "xds", "--xds-server", f"127.0.0.1:{free_port()}", "--metrics-address", "",
        config=nowhere,
    )  # fmt: skip
    assert replica.event("xds_fallback_missing")["config"] == str(nowhere)
    assert allowed(replica) == PROBE_HITS  # no limits yet: everything passes


@pytest.mark.skipif(OPENSSL is None, reason="openssl makes the test certificates")
def test_mutual_tls_to_the_control_plane(tmp_path: Path, start_sidecar: SidecarFactory) -> None:
    certs = make_certificates(tmp_path / "certs")
    tls = ["--tls-cert", str(certs.server_cert), "--tls-key", str(certs.server_key), "--tls-client-ca", str(certs.ca)]
    plane = ControlPlane(tmp_path / "limits", tmp_path / "xds_server.log", tls)
    plane.directory.mkdir()
    (plane.directory / "tenants.yaml").write_text(limits(3))
    plane.start()
    common = ["--config-source", "xds", "--xds-server", f"localhost:{plane.port}", "--metrics-address", ""]
    common += ["--xds-tls", "--xds-tls-ca", str(certs.ca)]
    client = ["--xds-tls-cert", str(certs.client_cert), "--xds-tls-key", str(certs.client_key)]
    rogue_client = ["--xds-tls-cert", str(certs.rogue_cert), "--xds-tls-key", str(certs.rogue_key)]
    try:
        trusted = start_sidecar(*common, *client, "--xds-tls-server-name", "127.0.0.1")
        refused = [
            start_sidecar(*common, *rogue_client),  # a client certificate the control plane does not trust
            start_sidecar(*common, *client, "--xds-tls-server-name", "elsewhere.example"),  # not the server's name
        ]
        poll_until(lambda: allowed(trusted) == 3, "the limit over mutual TLS")
        for replica in refused:
            poll_until(lambda replica=replica: "xds_stream_failed" in replica.stderr(), "a refused stream")
            assert allowed(replica) == PROBE_HITS  # nothing applied from a control plane it could not reach
            assert "xds_applied" not in replica.stderr()
    finally:
        plane.kill()
