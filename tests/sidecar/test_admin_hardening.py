"""Issue 21, defect 4: admin clients that never read must not pin ``/metrics`` for ever.

Real sockets against a real sidecar whose ``/metrics`` is legitimately large (a
``detailed_metric`` rule flooded up to the per-rule byte cap): a client that sends
``GET /metrics`` and stops reading is dropped after ``--admin-write-timeout``, and
connections past ``--admin-max-connections`` get a short 503. The settings are given
as ``RLS_*`` variables, which a sidecar without them ignores.
"""

from __future__ import annotations

import contextlib
import socket
import textwrap
import time
import urllib.request
from pathlib import Path

from sidecar.protos.envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from sidecar.protos.envoy.service.ratelimit.v3 import rls_pb2
from tests.support.sidecars import Sidecar, SidecarFactory, clean_env, free_port, write_config

CONFIG = textwrap.dedent(
    """\
    domain: big
    descriptors:
      - key: team
        detailed_metric: true
        rate_limit: {unit: hour, requests_per_unit: 1000000}
    """
)


def large_metrics(start_sidecar: SidecarFactory, tmp_path: Path, **env: str) -> tuple[Sidecar, int]:
    """A sidecar whose ``/metrics`` is several MiB: 10,240 detailed values of 1,000 characters."""
    port = free_port()
    sidecar = start_sidecar(
        config=write_config(tmp_path / "config", CONFIG, "big.yaml"),
        env=clean_env(RLS_METRICS_ADDRESS=f"127.0.0.1:{port}", **env),
    )
    for call in range(160):
        sidecar.ask(
            rls_pb2.RateLimitRequest(
                domain="big",
                descriptors=[
                    ratelimit_pb2.RateLimitDescriptor(
                        entries=[ratelimit_pb2.RateLimitDescriptor.Entry(key="team", value=f"{call}-{i}-" + "v" * 1000)]
                    )
                    for i in range(64)
                ],
            ),
            timeout=30,
        )
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as reply:
        assert len(reply.read()) > 4 * 1024 * 1024, "the body must outgrow the socket buffers"
    return sidecar, port


def stalled_scrape(port: int) -> socket.socket:
    """A connection that asks for ``/metrics`` and then does not read (small receive buffer)."""
    raw = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    raw.connect(("127.0.0.1", port))
    raw.sendall(b"GET /metrics HTTP/1.1\r\nhost: x\r\n\r\n")
    return raw


def drain_until_closed(raw: socket.socket, timeout: float) -> tuple[int, bool]:
    """Read everything now; ``(bytes read, closed by the server)`` within ``timeout``."""
    raw.settimeout(timeout)
    received = 0
    try:
        while chunk := raw.recv(1 << 20):
            received += len(chunk)
    except TimeoutError:
        return received, False
    except ConnectionResetError:
        pass
    return received, True


def test_a_client_that_stops_reading_is_dropped_after_the_write_timeout(
    start_sidecar: SidecarFactory, tmp_path: Path
) -> None:
    sidecar, port = large_metrics(start_sidecar, tmp_path, RLS_ADMIN_WRITE_TIMEOUT="1")
    stalled = [stalled_scrape(port) for _ in range(3)]
    try:
        time.sleep(3.0)  # the write timeout (1 s) and then some, without reading
        for raw in stalled:
            received, closed = drain_until_closed(raw, 5.0)
            assert closed, "the server kept a non-reading client's connection open"
            assert received < 4 * 1024 * 1024, f"got {received:,} bytes: the answer was not cut"
    finally:
        for raw in stalled:
            raw.close()
    # The endpoint still answers readers that read.
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=10) as reply:
        assert reply.status == 200
    assert sidecar.alive()


def test_connections_past_the_cap_get_a_short_503(start_sidecar: SidecarFactory, tmp_path: Path) -> None:
    port = free_port()
    start_sidecar(
        config=write_config(tmp_path / "config", CONFIG, "big.yaml"),
        env=clean_env(RLS_METRICS_ADDRESS=f"127.0.0.1:{port}", RLS_ADMIN_MAX_CONNECTIONS="4"),
    )
    idle = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(4)]
    try:
        time.sleep(0.3)  # let the server accept them all
        with socket.create_connection(("127.0.0.1", port), timeout=5) as extra:
            extra.sendall(b"GET /healthz HTTP/1.1\r\n\r\n")
            answer = b""
            with contextlib.suppress(ConnectionResetError):
                while chunk := extra.recv(4096):
                    answer += chunk
        assert answer.startswith(b"HTTP/1.1 503"), answer[:60]
    finally:
        for raw in idle:
            raw.close()
    time.sleep(0.3)  # the slots are given back as the idle connections close
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=10) as reply:
        assert reply.status == 200
