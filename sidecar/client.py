"""A small gRPC client for operators: ask the sidecar a question, or probe its health.

Used by ``ratelimit-sidecar query`` / ``health`` and by the demo, so people can see
decisions without installing grpcurl; its channels serve :mod:`sidecar.consumer` too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sidecar.config.match import match_descriptor
from sidecar.config.model import RateLimitConfig
from sidecar.limiter.windows import Unit
from sidecar.protos.envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from sidecar.protos.envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc


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


@dataclass(frozen=True)
class Replaced:
    """A descriptor whose matched rules another matched rule ``replaces``: the service
    drops them and answers a bare OK, as for no match; the config tells the two apart."""

    rules: tuple[str, ...]
    """The names of the descriptor's rules that were dropped."""
    by: tuple[str, ...]
    """The names of the rules whose ``replaces`` dropped them."""


def replaced_rules(config: RateLimitConfig, request: Any) -> dict[int, Replaced]:
    """Descriptor index -> :class:`Replaced`, for the descriptors of ``request`` that match
    a rule of ``config`` whose every limit another matched limit ``replaces`` (the same
    matching and dropping as the service: :func:`sidecar.config.match.drop_replaced`)."""
    domain = config.domains.get(request.domain)
    if domain is None:
        return {}
    matches = [
        None if descriptor.HasField("limit") else match_descriptor(domain, descriptor.entries)
        for descriptor in request.descriptors
    ]
    replacers: dict[str, set[str]] = {}
    for match in matches:
        for limit in match.limits() if match else ():
            for name in limit.rule.replaces:
                replacers.setdefault(name, set()).add(limit.rule.name or "(unnamed)")
    found = {}
    for index, match in enumerate(matches):
        names = [limit.rule.name for limit in match.limits()] if match else []
        if names and all(name in replacers for name in names):
            by = sorted({replacer for name in names for replacer in replacers[str(name)]})
            found[index] = Replaced(tuple(str(name) for name in names), tuple(by))
    return found


def describe(response: Any, replaced: Mapping[int, Replaced] | None = None) -> list[str]:
    """Human lines: the overall verdict, then one line per descriptor.

    A bare OK status (no limit, nothing remaining) means no rule matched, or the rules that
    matched were replaced by another descriptor's (``replaces``). With ``replaced``
    (:func:`replaced_rules`, from the config) the line says which; without it (None: no
    config at hand) it says it cannot tell.

    ``limit`` is ``current_limit`` as sent: ``requests_per_unit`` per ``unit``, the window's
    limit, or a token bucket's refill rate (its size, ``burst``, is not in the response, so
    ``remaining`` can exceed it). The proto has no ``unit_multiplier``: a window of several
    units shows as its unit (5 per 5 minutes as ``5/minute``); ``reset`` shows the window.
    ``remaining`` is ``limit_remaining``: hits left in the window, or tokens left in the
    bucket. ``reset`` is ``duration_until_reset``: until the window ends, until the bucket
    is full again (for a refused request: until enough tokens are back), or until a ban ends.
    """
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
        elif replaced is not None and index in replaced:
            dropped = replaced[index]
            line += f" no limit: {', '.join(dropped.rules)} replaced by {', '.join(dropped.by)}"
        elif replaced is not None:
            line += " no rule matched"
        else:
            line += " no limit: no rule matched, or replaced (--config tells which)"
        lines.append(line)
    lines.extend(f"  header {header.key}: {header.value}" for header in response.response_headers_to_add)
    return lines


@dataclass(frozen=True)
class ClientTLS:
    """How to reach a sidecar serving TLS: the CA that signed its certificate and, for
    mutual TLS, this client's certificate and key (PEM file paths)."""

    ca: str
    cert: str = ""
    key: str = ""


def credentials(tls: ClientTLS) -> grpc.ChannelCredentials:
    """Channel credentials from the PEM files ``tls`` names."""
    chain = Path(tls.cert).read_bytes() if tls.cert else None
    key = Path(tls.key).read_bytes() if tls.key else None
    return grpc.ssl_channel_credentials(Path(tls.ca).read_bytes(), key, chain)


def channel(address: str, tls: ClientTLS | None = None) -> grpc.Channel:
    """A plaintext channel, or a TLS one when ``tls`` is given."""
    if tls is None:
        return grpc.insecure_channel(address)
    return grpc.secure_channel(address, credentials(tls))


def aio_channel(
    address: str, tls: ClientTLS | None = None, options: Sequence[tuple[str, Any]] = ()
) -> grpc.aio.Channel:
    """:func:`channel` for asyncio (``grpc.aio``), as :mod:`sidecar.consumer` uses it."""
    if tls is None:
        return grpc.aio.insecure_channel(address, options=list(options))
    return grpc.aio.secure_channel(address, credentials(tls), options=list(options))


def query(address: str, request: Any, timeout: float = 2.0, tls: ClientTLS | None = None) -> Any:
    """Send one ``ShouldRateLimit`` call and return the response."""
    with channel(address, tls) as open_channel:
        return rls_pb2_grpc.RateLimitServiceStub(open_channel).ShouldRateLimit(request, timeout=timeout)


def health_status(address: str, service: str = "", timeout: float = 2.0, tls: ClientTLS | None = None) -> str:
    """The gRPC health status name (SERVING, NOT_SERVING, ...) of ``service``."""
    with channel(address, tls) as open_channel:
        stub = health_pb2_grpc.HealthStub(open_channel)
        response = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(response.status))
