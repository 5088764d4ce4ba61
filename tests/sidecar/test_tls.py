"""TLS and mutual TLS on the gRPC server, with certificates made by the test, through
the CLI, a gRPC client and a real Envoy; and the warning for a plaintext non-loopback bind."""

from __future__ import annotations

import http.client
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from sidecar.protos.envoy.service.ratelimit.v3 import rls_pb2_grpc
from stack.envoy import ENVOY_CONFIGS, EnvoyPorts, EnvoyProcess, UpstreamTLS
from stack.processes import process_group
from stack.tls import OPENSSL, Certificates, make_certificates
from stack.upstream import UpstreamProcess
from tests.support.envoys import COUNTING_TIMEOUT
from tests.support.sidecars import OK, SidecarFactory, clean_env, free_port, log_events, request, run_cli

pytestmark = [pytest.mark.envoy]


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certificates:
    if OPENSSL is None:
        pytest.skip("openssl is not installed: cannot make certificates for the TLS tests")
    return make_certificates(tmp_path_factory.mktemp("certs"))


def tls_flags(certs: Certificates, mutual: bool = False) -> list[str]:
    flags = ["--tls-cert", str(certs.server_cert), "--tls-key", str(certs.server_key)]
    return [*flags, "--tls-client-ca", str(certs.ca)] if mutual else flags


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sidecar", *args], capture_output=True, text=True, timeout=30, check=False
    )


def ask(address: str, credentials: grpc.ChannelCredentials | None) -> int:
    """overall_code of one call, or raise grpc.RpcError."""
    channel = grpc.insecure_channel(address) if credentials is None else grpc.secure_channel(address, credentials)
    with channel:
        stub = rls_pb2_grpc.RateLimitServiceStub(channel)
        reply = stub.ShouldRateLimit(request("it", [("per_minute", "tls")]), timeout=5)
        return int(reply.overall_code)


def client_credentials(
    certs: Certificates, cert: Path | None = None, key: Path | None = None
) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        certs.ca.read_bytes(),
        key.read_bytes() if key else None,
        cert.read_bytes() if cert else None,
    )


def test_tls_server_answers_tls_clients_only(
    start_sidecar: SidecarFactory, config_dir: Path, certs: Certificates
) -> None:
    sidecar = start_sidecar(*tls_flags(certs), config=config_dir, probe_tls=certs.ca)
    assert ask(sidecar.address, client_credentials(certs)) == OK
    with pytest.raises(grpc.RpcError) as refused:
        ask(sidecar.address, None)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    result = cli("health", "--address", sidecar.address, "--tls-ca", str(certs.ca))
    assert (result.returncode, result.stdout.strip()) == (0, "SERVING"), result.stderr
    result = cli("query", "--address", sidecar.address, "--tls-ca", str(certs.ca), "--domain", "it", "per_minute=q")
    assert result.returncode == 0 and "overall: OK" in result.stdout, result.stderr


def test_mutual_tls_needs_a_client_certificate_from_the_trusted_ca(
    start_sidecar: SidecarFactory, config_dir: Path, certs: Certificates
) -> None:
    sidecar = start_sidecar(
        *tls_flags(certs, mutual=True),
        config=config_dir,
        probe_tls=certs.ca,
        probe_client=(certs.client_cert, certs.client_key),
    )
    assert ask(sidecar.address, client_credentials(certs, certs.client_cert, certs.client_key)) == OK
    for credentials in (client_credentials(certs), client_credentials(certs, certs.rogue_cert, certs.rogue_key)):
        with pytest.raises(grpc.RpcError) as refused:
            ask(sidecar.address, credentials)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    mutual = ["--tls-ca", str(certs.ca), "--tls-cert", str(certs.client_cert), "--tls-key", str(certs.client_key)]
    assert cli("health", "--address", sidecar.address, *mutual).returncode == 0
    assert cli("health", "--address", sidecar.address, "--tls-ca", str(certs.ca)).returncode == 1


def test_real_envoy_calls_the_sidecar_over_mutual_tls(
    start_sidecar: SidecarFactory, config_dir: Path, certs: Certificates, tmp_path: Path
) -> None:
    examples = ENVOY_CONFIGS.parent / "examples" / "config"
    sidecar = start_sidecar(
        *tls_flags(certs, mutual=True),
        config=examples,
        probe_tls=certs.ca,
        probe_client=(certs.client_cert, certs.client_key),
    )
    with process_group() as group:
        app = group.start_ready(lambda: UpstreamProcess("app", tmp_path))
        tls = UpstreamTLS(ca=certs.ca, cert=certs.client_cert, key=certs.client_key)
        envoy = group.start_ready(
            lambda: EnvoyProcess(
                "envoy",
                ENVOY_CONFIGS / "front.yaml",
                EnvoyPorts.free(app=app.port, ratelimit=sidecar.port),
                tmp_path,
                failure_mode_deny=True,  # a TLS failure shows as 500, not as a silent pass
                timeout_seconds=COUNTING_TIMEOUT,
                upstream_tls=tls,
            )
        )
        time.sleep(1.02 - time.time() % 1)  # one clock second for the 20/second limit
        statuses = []
        for _ in range(22):
            connection = http.client.HTTPConnection(f"127.0.0.1:{envoy.ports.listen}", timeout=5)
            connection.request("GET", "/", headers={"x-forwarded-for": "192.0.2.77"})
            statuses.append(connection.getresponse().status)
            connection.close()
        assert statuses == [200] * 20 + [429] * 2, "decided by the sidecar over mutual TLS"
        assert envoy.counters().get("error", 0) == 0


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--tls-cert", "/nonexistent/cert.pem", "--tls-key", "/nonexistent/key.pem"],
            "--tls-key /nonexistent/key.pem",
        ),
        (["--tls-cert", "/etc/hostname", "--tls-key", "/etc/hostname"], "not a PEM file"),
        (["--tls-cert", "x.pem"], "--tls-cert and --tls-key"),
    ],
)
def test_bad_tls_settings_fail_with_one_line(config_dir: Path, flags: list[str], message: str) -> None:
    result = run_cli("serve", "--config", str(config_dir), "--grpc-address", f"127.0.0.1:{free_port()}", *flags)
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("ratelimit-sidecar: error:") and message in last, result.stderr


def test_plaintext_on_a_non_loopback_address_logs_a_warning(
    start_sidecar: SidecarFactory, config_dir: Path, certs: Certificates
) -> None:

    port = free_port()
    env = clean_env(RLS_GRPC_ADDRESS=f"0.0.0.0:{port}", RLS_LOG_FORMAT="json")
    sidecar = start_sidecar(config=config_dir, env=env, port=port, pass_address=False)
    events = [event["event"] for event in log_events(sidecar.stderr())]
    assert "grpc_exposed_without_tls" in events
    port = free_port()
    env = clean_env(RLS_GRPC_ADDRESS=f"0.0.0.0:{port}", RLS_LOG_FORMAT="json")
    secure = start_sidecar(
        *tls_flags(certs), config=config_dir, env=env, port=port, pass_address=False, probe_tls=certs.ca
    )
    assert "grpc_exposed_without_tls" not in [event["event"] for event in log_events(secure.stderr())]
