"""A sidecar started with only envoyproxy/ratelimit's environment serves what our flags serve.

The config lives where the reference reads it (RUNTIME_ROOT/RUNTIME_SUBDIRECTORY/config/),
the ports come from GRPC_HOST/GRPC_PORT, PORT and PROMETHEUS_ADDR, Redis from REDIS_URL:
the same requests get the same answers as from a sidecar configured with our flags.
Health answers where the reference's does (``/healthcheck``, the ``ratelimit`` gRPC
name), and gRPC serves on a unix socket from GRPC_UDS.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sidecar.protos.envoy.service.ratelimit.v3 import rls_pb2_grpc
from tests.support.redis_servers import RedisServer, fresh_prefix
from tests.support.sidecars import Sidecar, free_port, request

RULES = """\
domain: ref
descriptors:
  - key: user
    rate_limit: {unit: hour, requests_per_unit: 3}
  - key: plan
    value: free
    metadata: {tier: free}
    descriptors:
      - key: user
        rate_limit: {unit: hour, requests_per_unit: 2}
"""
REQUESTS = [
    request("ref", [("user", "alice")]),
    request("ref", [("plan", "free"), ("user", "bob")]),
    request("ref", [("user", "carol")], hits=2),
]


def reference_env(tmp_path: Path, **variables: str) -> dict[str, str]:
    """The test machine's environment without any of our variables, plus the reference's."""
    config = tmp_path / "runtime" / "current" / "ratelimit" / "config"
    config.mkdir(parents=True)
    (config / "ref.yaml").write_text(RULES)
    env = {name: value for name, value in os.environ.items() if not name.startswith("RLS_")}
    env.update(RUNTIME_ROOT=str(tmp_path / "runtime" / "current"), RUNTIME_SUBDIRECTORY="ratelimit", **variables)
    return env


def answers(sidecar: Sidecar) -> list[tuple[int, list[tuple[int, int]]]]:
    """Each request four times: overall code and (code, remaining) per descriptor."""
    seen = []
    for _ in range(4):
        for item in REQUESTS:
            response = sidecar.ask(item)
            seen.append((response.overall_code, [(s.code, s.limit_remaining) for s in response.statuses]))
    return seen


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


@pytest.fixture
def started(tmp_path: Path) -> Iterator[list[Sidecar]]:
    sidecars: list[Sidecar] = []
    yield sidecars
    for sidecar in sidecars:
        sidecar.kill()


def start_reference(tmp_path: Path, started: list[Sidecar], **variables: str) -> tuple[Sidecar, int, int]:
    grpc_port, http_port, metrics_port = free_port(), free_port(), free_port()
    env = reference_env(
        tmp_path,
        GRPC_HOST="127.0.0.1",
        GRPC_PORT=str(grpc_port),
        HOST="127.0.0.1",
        PORT=str(http_port),
        USE_PROMETHEUS="true",
        PROMETHEUS_ADDR=f"127.0.0.1:{metrics_port}",
        LOG_LEVEL="WARN",
        LOG_FORMAT="json",
        USE_STATSD="true",
        **variables,
    )
    workdir = tmp_path / "reference"
    workdir.mkdir()
    sidecar = Sidecar(workdir, [], env)
    started.append(sidecar)
    return sidecar.start(port=grpc_port, pass_address=False), http_port, metrics_port


def start_ours(tmp_path: Path, started: list[Sidecar], *flags: str) -> Sidecar:
    config = tmp_path / "ours"
    config.mkdir()
    (config / "ref.yaml").write_text(RULES)
    env = {name: value for name, value in os.environ.items() if not name.startswith("RLS_")}
    sidecar = Sidecar(config, ["--config", str(config / "ref.yaml"), "--metrics-address", "", *flags], env)
    started.append(sidecar)
    return sidecar.start()


def test_memory_the_reference_environment_serves_our_decisions(tmp_path: Path, started: list[Sidecar]) -> None:
    reference, http_port, metrics_port = start_reference(tmp_path, started)
    ours = start_ours(tmp_path, started)
    assert answers(reference) == answers(ours)
    for port in (http_port, metrics_port):
        assert get(f"http://127.0.0.1:{port}/healthcheck")[0] == 200
    assert get(f"http://127.0.0.1:{metrics_port}/metrics")[1].count('key1="user"') >= 5
    health = health_pb2_grpc.HealthStub(reference.channel)
    answer = health.Check(health_pb2.HealthCheckRequest(service="ratelimit"), timeout=5)
    assert answer.status == health_pb2.HealthCheckResponse.SERVING
    assert "reference_variable_ignored" in reference.stdout() + reference.stderr()
    assert "USE_STATSD" in reference.stdout() + reference.stderr()


@pytest.mark.redis
def test_redis_the_reference_environment_serves_our_decisions(
    tmp_path: Path, started: list[Sidecar], redis_server: RedisServer
) -> None:
    host_port = redis_server.url.removeprefix("redis://").split("/")[0]
    prefix = fresh_prefix()
    reference, _, _ = start_reference(
        tmp_path,
        started,
        REDIS_SOCKET_TYPE="tcp",
        REDIS_URL=host_port,
        CACHE_KEY_PREFIX=prefix,
        RESPONSE_DYNAMIC_METADATA="true",
    )
    flags = ["--backend", "redis", "--redis-url", redis_server.url, "--redis-prefix", fresh_prefix()]
    ours = start_ours(tmp_path, started, *flags, "--response-dynamic-metadata")
    assert answers(reference) == answers(ours)
    assert redis_server.client().keys(f"{prefix}*"), "the reference's CACHE_KEY_PREFIX names the keys"
    metadata = reference.ask(REQUESTS[1]).dynamic_metadata
    assert metadata["domain"] == "ref"
    assert list(metadata["descriptors"][0]["entries"]) == ["plan=free", "user=bob"]
    assert "metadata" not in metadata  # bob is over his limit by now: only passing descriptors bring theirs


def test_grpc_on_a_unix_socket_from_grpc_uds(tmp_path: Path) -> None:
    socket_path = tmp_path / "rl.sock"
    # PORT: a RUNTIME_* variable opens the reference's HTTP port, 8080 by default, one per machine.
    env = reference_env(tmp_path, GRPC_UDS=str(socket_path), LOG_FORMAT="json", PORT=str(free_port()))
    env["RLS_METRICS_ADDRESS"] = ""
    process = subprocess.Popen(
        [sys.executable, "-m", "sidecar", "serve"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:
        channel = grpc.insecure_channel(f"unix:{socket_path}")
        health = health_pb2_grpc.HealthStub(channel)
        deadline = time.monotonic() + 20
        while True:
            try:
                status = health.Check(health_pb2.HealthCheckRequest(service="ratelimit"), timeout=1).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    break
            except grpc.RpcError:
                pass
            assert process.poll() is None, process.communicate()[0].decode()
            assert time.monotonic() < deadline, "not SERVING on the unix socket"
            time.sleep(0.05)
        response = rls_pb2_grpc.RateLimitServiceStub(channel).ShouldRateLimit(REQUESTS[0], timeout=5)
        assert response.statuses[0].limit_remaining == 2
        channel.close()
    finally:
        process.terminate()
        process.wait(timeout=20)
