"""The plain-HTTP admin endpoint: ``/metrics``, ``/config`` and ``/healthz``.

Served on the event loop next to gRPC (``--metrics-address``). A minimal HTTP/1.1
server is enough: one GET per connection from Prometheus, a kubelet or an operator's
curl. What a client can hold is bounded: the request head (8 KiB, read within
:data:`READ_TIMEOUT`), the time it takes to read the answer (``--admin-write-timeout``:
a client that stops reading is dropped and its buffer freed) and the connections open at
once (``--admin-max-connections``: the rest get a short 503).

``/metrics`` never renders on the event loop: the numbers are copied there (a list
copy), and turned into text in a worker thread, one render at a time, shared by the
scrapes that arrive while it runs, so a large ``/metrics`` cannot stall gRPC.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable
from typing import Any

import structlog

from sidecar.config.model import DomainConfig, Level, RateLimitConfig, RateLimitRule
from sidecar.limiter.algorithms import Algorithm
from sidecar.metrics import render

log = structlog.get_logger(__name__)

MAX_REQUEST_HEAD = 8192
READ_TIMEOUT = 5.0
WRITE_TIMEOUT = 10.0
"""Default of ``--admin-write-timeout``: seconds a client gets to read a whole answer."""
MAX_CONNECTIONS = 16
"""Default of ``--admin-max-connections``: admin connections open at once."""
REFUSAL_LOG_SECONDS = 60.0
BUSY = b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 5\r\nconnection: close\r\n\r\nbusy\n"
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
        *,
        write_timeout: float = WRITE_TIMEOUT,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        self.registry = registry
        """What ``/metrics`` renders: an object with ``collect()``, or a callable returning
        one, called on the event loop (to copy numbers cheaply); ``collect()`` runs in a thread."""
        self.config = config
        self.serving = serving
        self.write_timeout = write_timeout
        self.max_connections = max_connections
        self.server: asyncio.Server | None = None
        self.port = 0
        self.connections = 0
        """Admin connections open right now."""
        self.refused = 0
        """Connections refused at :attr:`max_connections` (since start)."""
        self.dropped = 0
        """Clients dropped for not reading their answer within :attr:`write_timeout`."""
        self._refusal_logged = -REFUSAL_LOG_SECONDS
        self._rendering: asyncio.Future[bytes] | None = None

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
            return "200 OK", METRICS_CONTENT_TYPE, render(self.registry() if callable(self.registry) else self.registry)
        if path == "/config":
            body = json.dumps(self.config(), indent=2, ensure_ascii=False).encode() + b"\n"
            return "200 OK", "application/json", body
        if path == "/healthz":
            if self.serving():
                return "200 OK", "text/plain", b"SERVING\n"
            return "503 Service Unavailable", "text/plain", b"NOT_SERVING\n"
        return "404 Not Found", "text/plain", b"try /metrics, /config or /healthz\n"

    async def metrics_body(self) -> bytes:
        """``/metrics``: numbers copied here, text made in a worker thread. One render at a
        time; scrapes arriving meanwhile share its answer."""
        if self._rendering is None:
            source = self.registry() if callable(self.registry) else self.registry
            rendering = asyncio.ensure_future(asyncio.to_thread(render, source))
            self._rendering = rendering
            rendering.add_done_callback(self._rendered)
        return await asyncio.shield(self._rendering)

    def _rendered(self, rendering: asyncio.Future[bytes]) -> None:
        if self._rendering is rendering:
            self._rendering = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.connections >= self.max_connections:
            self._refuse(writer)
            return
        self.connections += 1
        try:
            await self._serve(reader, writer)
        finally:
            self.connections -= 1

    def _refuse(self, writer: asyncio.StreamWriter) -> None:
        """A short 503 without waiting for the client (it fits any socket buffer), then close."""
        self.refused += 1
        now = time.monotonic()
        if now - self._refusal_logged >= REFUSAL_LOG_SECONDS:
            self._refusal_logged = now
            log.warning("admin_connections_refused", open=self.connections, refused_total=self.refused)
        with contextlib.suppress(ConnectionError, RuntimeError):
            writer.write(BUSY)
        writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(READ_TIMEOUT):
                head = await reader.readuntil(b"\r\n\r\n")
            method, path, _ = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ", 2)
            if method in ("GET", "HEAD") and path.split("?", 1)[0] == "/metrics":
                status, content_type, body = "200 OK", METRICS_CONTENT_TYPE, await self.metrics_body()
            else:
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
            writer.write(head_out)
            if method != "HEAD":
                writer.write(body)  # the shared render's bytes, not a copy per client
            async with asyncio.timeout(self.write_timeout):
                await writer.drain()
        except TimeoutError:
            # A client that does not read would pin the answer for ever: drop it, now.
            self.dropped += 1
            log.info("admin_slow_reader_dropped", write_timeout=self.write_timeout, body_bytes=len(body))
            writer.transport.abort()
        except ConnectionError:
            pass
        finally:
            writer.close()
