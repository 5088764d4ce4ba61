"""Raw bytes to a real sidecar's ``ShouldRateLimit``: OK or INVALID_ARGUMENT, and it survives.

The payloads (``loadtest/reliability_harness/hostile_requests.py``, seeded, those of the reliability
report) are random bytes, mutated valid requests, invalid UTF-8 in string fields (upb
refuses it at parse time), hand-made wire formats (huge length prefixes, endless varints,
100,000 nested unknown groups, tens of thousands of descriptors) and one message over the
1 MiB receive cap. They go out as they are: a generic unary call with identity serializers.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
from grpc_health.v1 import health_pb2

from loadtest.reliability_harness.hostile_requests import RSS_GROWTH_LIMIT, expected_codes, raw_payloads, send_raw
from loadtest.reliability_harness.support import rss
from tests.support.sidecars import METHOD

REPO = Path(__file__).resolve().parents[2]

CALLS = 3_000
WARM_UP = 300
IN_FLIGHT = 16


def send_all(method: Any, payloads: Iterable[bytes]) -> tuple[Counter[str], list[str]]:
    """Send with up to ``IN_FLIGHT`` calls pending; returns the codes and the unexpected ones."""
    codes: Counter[str] = Counter()
    unexpected: list[str] = []
    for payload, code in send_raw(method, payloads, IN_FLIGHT):
        codes[code.name] += 1
        if code not in expected_codes(payload):
            unexpected.append(f"{code.name} for {len(payload)} bytes {payload[:32]!r}")
    return codes, unexpected


@pytest.mark.slow
def test_raw_bytes_get_ok_or_invalid_argument_and_the_sidecar_survives(start_sidecar):
    sidecar = start_sidecar("--max-counters", "10000", config=REPO / "examples" / "config")
    assert sidecar.channel is not None and sidecar.process is not None
    method = sidecar.channel.unary_unary(METHOD, request_serializer=None, response_deserializer=None)
    # Warm up first: the first calls import and allocate what every later call reuses.
    _, unexpected = send_all(method, raw_payloads(seed=101, count=WARM_UP))
    assert not unexpected, unexpected[:5]
    before = rss(sidecar.process.pid)

    codes, unexpected = send_all(method, raw_payloads(seed=7, count=CALLS))

    after = rss(sidecar.process.pid)
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
