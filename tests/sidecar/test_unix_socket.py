"""The gRPC service on a unix socket: its mode is set, not left to the umask.

Connecting to a unix socket needs write permission on it, so the socket's mode is who may
call the sidecar. Under ``umask 000`` gRPC creates it 0777 (anyone on the host could spend
every limit); the sidecar sets :data:`sidecar.addresses.UNIX_SOCKET_MODE` (0660: its user and
its group) after the bind and before it listens. The whole server runs in-process, on the
test's event loop, and is asked over the socket afterwards.
"""

from __future__ import annotations

import os
import socket
import stat
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sidecar.addresses import UNIX_SOCKET_MODE, unix_socket_created_private
from sidecar.config import load_config
from sidecar.limiter.memory import MemoryLimiter
from sidecar.protos.envoy.service.ratelimit.v3 import rls_pb2
from sidecar.server import Sidecar
from sidecar.settings import Settings

RULES = """\
domain: u
descriptors:
  - key: user
    rate_limit: {unit: second, requests_per_unit: 5}
"""


@pytest.fixture
def open_umask() -> Iterator[None]:
    """``umask 000`` for the test: what a careless init or container runtime may leave."""
    previous = os.umask(0)
    try:
        yield
    finally:
        os.umask(previous)


async def test_the_socket_mode_is_set_whatever_the_umask(tmp_path: Path, open_umask: None) -> None:
    (tmp_path / "u.yaml").write_text(RULES)
    path = tmp_path / "rls.sock"
    settings = Settings(config=str(tmp_path), grpc_address=f"unix:{path}", metrics_address="", watch_config=False)
    sidecar = Sidecar(settings, load_config(str(tmp_path)), MemoryLimiter())
    await sidecar.start()
    try:
        assert stat.S_ISSOCK(path.stat().st_mode)
        assert stat.S_IMODE(path.stat().st_mode) == UNIX_SOCKET_MODE == 0o660
        async with grpc.aio.insecure_channel(f"unix:{path}") as channel:  # the owner still connects
            health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            ask = channel.unary_unary(
                "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit",
                request_serializer=rls_pb2.RateLimitRequest.SerializeToString,
                response_deserializer=rls_pb2.RateLimitResponse.FromString,
            )
            request = rls_pb2.RateLimitRequest(domain="u")
            request.descriptors.add().entries.add(key="user", value="a")
            answer = await ask(request, timeout=5)
            assert answer.overall_code == rls_pb2.RateLimitResponse.OK
    finally:
        await sidecar.server.stop(0)


def test_the_socket_is_never_wider_not_even_between_bind_and_chmod(tmp_path: Path, open_umask: None) -> None:
    # gRPC listens as soon as it binds, so the mode must be right when the file is created.
    path = tmp_path / "early.sock"
    with unix_socket_created_private(f"unix:{path}"), socket.socket(socket.AF_UNIX) as bound:
        bound.bind(str(path))
        assert stat.S_IMODE(path.stat().st_mode) == 0o660
    assert stat.S_IMODE(path.stat().st_mode) == 0o660
    assert os.umask(0) == 0  # the process's umask is given back
