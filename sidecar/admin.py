"""The plain-HTTP admin endpoint: ``/metrics``, ``/config`` and ``/healthz``.

Served on the event loop next to gRPC (``--metrics-address``), so a scrape reads the
same objects the request path writes without locks. A minimal HTTP/1.1 server is
enough: one GET per connection from Prometheus, a kubelet or an operator's curl.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import structlog

from sidecar.config.model import DomainConfig, Level, RateLimitConfig, RateLimitRule
from sidecar.limiter.algorithms import Algorithm
from sidecar.metrics import render

log = structlog.get_logger(__name__)

MAX_REQUEST_HEAD = 8192
READ_TIMEOUT = 5.0
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def rule_json(rule: RateLimitRule, together_with: tuple[RateLimitRule, ...] = ()) -> dict[str, Any]:
    """One rule as ``/config`` shows it; ``together_with``: the other limits of its descriptor
    (``rate_limits``), enforced with it all-or-nothing."""
    limited = not rule.unlimited
    bucket = rule.algorithm is Algorithm.TOKEN_BUCKET
    return {
        "stat_key": rule.stat_key,
        "name": rule.name,
        "path": rule.where,
        "requests_per_unit": rule.requests_per_unit if limited else None,
        "unit": rule.unit.name.lower() if rule.unit else None,
        "unit_multiplier": rule.unit_multiplier if limited else None,
        "window_seconds": rule.unit_seconds if limited else None,
        "algorithm": rule.algorithm.label if limited else None,
        "burst": rule.burst if bucket else None,
        "ban_duration_seconds": rule.ban_seconds or None,
        "unlimited": rule.unlimited,
        "shadow_mode": rule.shadow_mode,
        "quota_mode": rule.quota_mode,
        "replaces": sorted(rule.replaces),
        "detailed_metric": rule.detailed_metric,
        "warn_at": rule.warn_at,
        "together_with": [other.where for other in together_with],
        "source": rule.source,
    }


def limits_together(domain: DomainConfig) -> dict[int, tuple[RateLimitRule, ...]]:
    """For each rule (by ``id``) on a descriptor with several limits, the other limits there."""
    found: dict[int, tuple[RateLimitRule, ...]] = {}

    def visit(level: Level) -> None:
        for node in level.nodes():
            if node.rule is not None and node.more:
                limits = (node.rule, *node.more)
                for rule in limits:
                    found[id(rule)] = tuple(other for other in limits if other is not rule)
            visit(node.children)

    visit(domain.root)
    return found


def domain_json(domain: DomainConfig) -> dict[str, Any]:
    """One domain's rules in config order: every limit of a descriptor with several is listed,
    each naming the others in ``together_with``."""
    together = limits_together(domain)
    return {
        "source": domain.source,
        "rules": [rule_json(rule, together.get(id(rule), ())) for rule in domain.rules],
    }


def config_json(config: RateLimitConfig, loaded_at: float) -> dict[str, Any]:
    """The loaded rules, like envoyproxy/ratelimit's ``/rlconfig`` but as JSON."""
    return {
        "sha256": config.digest,
        "loaded_at": loaded_at,
        "files": list(config.files),
        "domains": {name: domain_json(domain) for name, domain in sorted(config.domains.items())},
    }


class AdminEndpoint:
    """Answers GET ``/metrics``, ``/config`` and ``/healthz``; anything else is 404/405."""

    def __init__(
        self,
        registry: Any,
        config: Callable[[], dict[str, Any]],
        serving: Callable[[], bool],
    ) -> None:
        self.registry = registry
        self.config = config
        self.serving = serving
        self.server: asyncio.Server | None = None
        self.port = 0

    async def start(self, address: str) -> None:
        host, _, port = address.rpartition(":")
        self.server = await asyncio.start_server(self._handle, host.strip("[]"), int(port), limit=MAX_REQUEST_HEAD)
        self.port = int(self.server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()

    def respond(self, method: str, path: str) -> tuple[str, str, bytes]:
        """``(status, content type, body)`` for one request."""
        if method not in ("GET", "HEAD"):
            return "405 Method Not Allowed", "text/plain", b"only GET\n"
        path = path.split("?", 1)[0]
        if path == "/metrics":
            return "200 OK", METRICS_CONTENT_TYPE, render(self.registry)
        if path == "/config":
            body = json.dumps(self.config(), indent=2, ensure_ascii=False).encode() + b"\n"
            return "200 OK", "application/json", body
        if path == "/healthz":
            if self.serving():
                return "200 OK", "text/plain", b"SERVING\n"
            return "503 Service Unavailable", "text/plain", b"NOT_SERVING\n"
        return "404 Not Found", "text/plain", b"try /metrics, /config or /healthz\n"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(READ_TIMEOUT):
                head = await reader.readuntil(b"\r\n\r\n")
            method, path, _ = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ", 2)
            status, content_type, body = self.respond(method, path)
        except (asyncio.LimitOverrunError, asyncio.IncompleteReadError, TimeoutError, ValueError):
            status, content_type, body, method = "400 Bad Request", "text/plain", b"bad request\n", "GET"
        except Exception:
            log.exception("admin_request_failed")
            status, content_type, body, method = "500 Internal Server Error", "text/plain", b"error\n", "GET"
        head_out = (
            f"HTTP/1.1 {status}\r\ncontent-type: {content_type}\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n"
        ).encode()
        try:
            writer.write(head_out + (b"" if method == "HEAD" else body))
            await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()
