"""Raw bytes to a real sidecar's ``ShouldRateLimit``: OK or INVALID_ARGUMENT, and it survives.

The payloads (``loadtest/reliability_harness/bad_input.py``, seeded) are random bytes,
mutated valid requests, invalid UTF-8 in string fields (upb refuses it at parse time),
hand-made wire formats (huge length prefixes, endless varints, 100,000 nested unknown
groups, tens of thousands of descriptors) and one message over the 1 MiB receive cap.
They go out as they are: a generic unary call with identity serializers.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2
from sidecar_harness import METHOD

REPO = Path(__file__).resolve().parents[2]
LOADTEST = REPO / "loadtest"
if str(LOADTEST) not in sys.path:
    sys.path.insert(0, str(LOADTEST))

from reliability_harness.bad_input import MAX_MESSAGE_BYTES, raw_payloads  # noqa: E402

CALLS = 3_000
WARM_UP = 300
IN_FLIGHT = 16
RSS_GROWTH_LIMIT = 50 * 1024 * 1024


def vm_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def send_all(method: Any, payloads: Any) -> tuple[Counter[str], list[str]]:
    """Send with up to ``IN_FLIGHT`` calls pending; returns the codes and the unexpected ones."""
    codes: Counter[str] = Counter()
    unexpected: list[str] = []
    pending: list[tuple[bytes, Any]] = []

    def settle(payload: bytes, future: Any) -> None:
        try:
            future.result()
            code = grpc.StatusCode.OK
        except grpc.RpcError as error:
            code = error.code()
        codes[code.name] += 1
        expected = (
            {grpc.StatusCode.RESOURCE_EXHAUSTED}
            if len(payload) > MAX_MESSAGE_BYTES
            else {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT}
        )
        if code not in expected:
            unexpected.append(f"{code.name} for {len(payload)} bytes {payload[:32]!r}")

    for payload in payloads:
        pending.append((payload, method.future(payload, timeout=10.0)))
        if len(pending) >= IN_FLIGHT:
            settle(*pending.pop(0))
    for payload, future in pending:
        settle(payload, future)
    return codes, unexpected


@pytest.mark.slow
def test_raw_bytes_get_ok_or_invalid_argument_and_the_sidecar_survives(start_sidecar):
    sidecar = start_sidecar("--max-counters", "10000", config=REPO / "examples" / "config")
    assert sidecar.channel is not None and sidecar.process is not None
    method = sidecar.channel.unary_unary(METHOD, request_serializer=None, response_deserializer=None)
    # Warm up first: the first calls import and allocate what every later call reuses.
    _, unexpected = send_all(method, raw_payloads(seed=101, count=WARM_UP))
    assert not unexpected, unexpected[:5]
    before = vm_rss(sidecar.process.pid)

    codes, unexpected = send_all(method, raw_payloads(seed=7, count=CALLS))

    after = vm_rss(sidecar.process.pid)
    report = f"codes {dict(codes)}; RSS {before / 2**20:.1f} -> {after / 2**20:.1f} MB"
    print(report)
    assert not unexpected, f"{len(unexpected)} unexpected codes: {unexpected[:5]}"
    assert sum(codes.values()) == CALLS
    # Both kinds of answer really happened: the handler decided requests, and refused junk.
    assert codes["OK"] > 100 and codes["INVALID_ARGUMENT"] > 1000, report
    assert sidecar.alive(), sidecar.stderr()
    assert sidecar.health_status() == health_pb2.HealthCheckResponse.SERVING
    stderr = sidecar.stderr()
    assert "Traceback" not in stderr and "decision_failed" not in stderr, stderr[-2000:]
    assert after - before < RSS_GROWTH_LIMIT, report
