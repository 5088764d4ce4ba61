"""A small gRPC client for operators: ask the sidecar a question, or probe its health.

Used by ``ratelimit-sidecar query`` / ``health`` and by the demo, so people can see
decisions without installing grpcurl.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc
from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sidecar.limiter.windows import Unit


def parse_descriptor(text: str) -> Any:
    """``key=value,key2=value2`` (or a bare ``key``) into a ``RateLimitDescriptor``."""
    entries = []
    for part in text.split(","):
        key, _, value = part.partition("=")
        if not key:
            raise ValueError(f"descriptor {text!r}: every entry needs a key (key=value)")
        entries.append(ratelimit_pb2.RateLimitDescriptor.Entry(key=key, value=value))
    return ratelimit_pb2.RateLimitDescriptor(entries=entries)


def build_request(domain: str, descriptors: Sequence[str], hits: int = 0) -> Any:
    """A ``RateLimitRequest`` from command-line descriptor strings."""
    return rls_pb2.RateLimitRequest(
        domain=domain,
        descriptors=[parse_descriptor(text) for text in descriptors],
        hits_addend=hits,
    )


def describe(response: Any) -> list[str]:
    """Human lines: the overall verdict, then one line per descriptor."""
    code_name = rls_pb2.RateLimitResponse.Code.Name
    lines = [f"overall: {code_name(response.overall_code)}"]
    for index, status in enumerate(response.statuses):
        line = f"  [{index}] {code_name(status.code)}"
        if status.HasField("current_limit"):
            limit = status.current_limit
            name = f" name={limit.name}" if limit.name else ""
            unit = Unit(limit.unit).name.lower()
            line += (
                f" limit={limit.requests_per_unit}/{unit}{name} remaining={status.limit_remaining}"
                f" reset={status.duration_until_reset.seconds}s"
            )
        elif status.limit_remaining:
            line += " unlimited"
        else:
            line += " no rule matched"
        lines.append(line)
    return lines


def query(address: str, request: Any, timeout: float = 2.0) -> Any:
    """Send one ``ShouldRateLimit`` call and return the response."""
    with grpc.insecure_channel(address) as channel:
        return rls_pb2_grpc.RateLimitServiceStub(channel).ShouldRateLimit(request, timeout=timeout)


def health_status(address: str, service: str = "", timeout: float = 2.0) -> str:
    """The gRPC health status name (SERVING, NOT_SERVING, ...) of ``service``."""
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        response = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(response.status))
