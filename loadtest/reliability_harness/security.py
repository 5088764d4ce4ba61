"""Security checks for the reliability report, against real processes.

Rows: gRPC TLS refuses plaintext clients; mutual TLS refuses clients without a
certificate and with one from another CA; the defaults bind loopback only (the
admin endpoint and gRPC); a Redis password (ACL user, URL-encoded in ``--redis-url``)
never appears in logs at debug level, ``/metrics``, ``/config``, or the report of a
refused login.
"""

from __future__ import annotations

import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path

import grpc

from loadtest.reliability_harness.support import (
    CHANNEL_OPTIONS,
    METHOD,
    Context,
    ProcessGroup,
    RedisProcess,
    Row,
    SidecarProcess,
    failed_row,
    process_group,
)
from sidecar.client import build_request
from sidecar.settings import SERVE_OPTIONS
from stack.tls import Certificates, make_certificates

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "config"
PASSWORD = "pa:ss@w/rd-Not-In-Logs"
USER = "limiter"


def call(address: str, credentials: grpc.ChannelCredentials | None) -> str:
    """The outcome of one ShouldRateLimit call: ``OK`` or the gRPC status name."""
    options = CHANNEL_OPTIONS
    channel = (
        grpc.insecure_channel(address, options=options)
        if credentials is None
        else grpc.secure_channel(address, credentials, options=options)
    )
    payload = build_request("demo", ["remote_address=192.0.2.9"]).SerializeToString()
    with channel:
        try:
            channel.unary_unary(METHOD)(payload, timeout=3)
        except grpc.RpcError as error:
            return str(error.code().name)
    return "OK"


def credentials(certs: Certificates, cert: Path | None = None, key: Path | None = None) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        certs.ca.read_bytes(), key.read_bytes() if key else None, cert.read_bytes() if cert else None
    )


def tls_rows(context: Context) -> list[Row]:
    directory = context.directory / "tls"
    certs = make_certificates(directory / "certs")
    tls = ["--tls-cert", str(certs.server_cert), "--tls-key", str(certs.server_key), "--tls-client-ca", str(certs.ca)]
    with process_group() as group:
        sidecar = SidecarProcess("sidecar-mtls", ["--config", str(EXAMPLES), *tls], directory)
        group.start(sidecar)
        trusted = credentials(certs, certs.client_cert, certs.client_key)
        deadline = time.monotonic() + 30
        while call(sidecar.address, trusted) != "OK":
            if time.monotonic() > deadline or not sidecar.alive():
                raise RuntimeError(f"the TLS sidecar never answered: {sidecar.log_tail(3)}")
            time.sleep(0.1)
        outcomes = {
            "plaintext client": call(sidecar.address, None),
            "TLS client without a certificate": call(sidecar.address, credentials(certs)),
            "client certificate from another CA": call(
                sidecar.address, credentials(certs, certs.rogue_cert, certs.rogue_key)
            ),
        }
    refused = {name: outcome for name, outcome in outcomes.items() if outcome != "OK"}
    return [
        Row(
            "security",
            "mutual TLS on gRPC: who gets in",
            inputs=len(outcomes) + 1,
            ok=len(refused) == len(outcomes),
            notes="client with a certificate from the CA: OK; "
            + "; ".join(f"{name}: {outcome}" for name, outcome in outcomes.items()),
        )
    ]


def defaults_row() -> Row:
    """What a sidecar started with defaults listens on (read from the settings table)."""
    defaults = {option.name: option.default for option in SERVE_OPTIONS}
    addresses = {name: str(defaults[name]) for name in ("grpc_address", "metrics_address")}
    loopback = all(address.startswith("127.0.0.1:") for address in addresses.values())
    return Row(
        "security",
        "defaults bind loopback only",
        ok=loopback,
        notes=", ".join(f"{name} {address}" for name, address in addresses.items()),
    )


def published_and_logged(group: ProcessGroup, directory: Path, url: str, name: str) -> tuple[str, str]:
    """What a sidecar on ``url`` serves on /metrics and /config, and logs at debug level."""
    flags = ["--config", str(EXAMPLES), "--backend", "redis", "--redis-url", url]
    flags += ["--log-level", "debug", "--request-log-sample", "1"]
    sidecar = group.start_ready(lambda: SidecarProcess(name, flags, directory))
    call(sidecar.address, None)
    wait_until(lambda: "redis_unavailable" in sidecar.log_text() or "wrong" not in name, 10)
    published = ""
    for path in ("/metrics", "/config"):
        with urllib.request.urlopen(sidecar.metrics_url + path, timeout=5) as reply:
            published += reply.read().decode()
    sidecar.stop()
    return published, sidecar.log_text()


def password_row(context: Context) -> Row:
    directory = context.directory / "secrets"
    directory.mkdir(parents=True, exist_ok=True)
    secret = urllib.parse.quote(PASSWORD, safe="")
    with process_group() as group:
        redis = group.start_ready(lambda: AclRedis(directory))
        base = f"127.0.0.1:{redis.port}"
        right = published_and_logged(group, directory, f"redis://{USER}:{secret}@{base}", "sidecar-right")
        wrong = published_and_logged(group, directory, f"redis://{USER}:{secret}-wrong@{base}", "sidecar-wrong")
    text = "".join(right + wrong)
    leaked = [form for form in (PASSWORD, secret) if form in text]
    refused_login = "AuthenticationError" in wrong[1]
    return Row(
        "security",
        "Redis password (ACL user) out of logs, /metrics, /config",
        inputs=2,
        ok=not leaked and refused_login,
        notes=f"debug logs and both endpoints of two sidecars scanned ({len(text):,} bytes); a wrong password "
        f"was reported {'as an authentication refusal' if refused_login else 'NOT AS EXPECTED'}; "
        f"leaked forms: {leaked or 'none'}",
    )


class AclRedis(RedisProcess):
    """redis-server whose only user is ``USER`` with ``PASSWORD``; PING needs no login (NOAUTH counts)."""

    def __init__(self, directory: Path) -> None:
        super().__init__(directory)
        self.argv += ["--user", USER, "on", f">{PASSWORD}", "~*", "&*", "+@all", "--user", "default", "off"]

    def ready(self) -> bool:
        import socket

        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as connection:
                connection.sendall(b"PING\r\n")
                return connection.recv(64).startswith((b"+PONG", b"-NOAUTH"))
        except OSError:
            return False


def wait_until(condition: Callable[[], bool], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)


def run(context: Context) -> list[Row]:
    rows = [defaults_row()]
    for build, name in ((tls_rows, "mutual TLS on gRPC"), (lambda c: [password_row(c)], "Redis password")):
        try:
            rows += build(context)
        except Exception as error:  # a failed scenario is a row, never a missing area
            rows.append(failed_row("security", name, error))
    return rows
