"""The plain-HTTP admin endpoint: ``/metrics``, ``/config`` and ``/healthz`` (``/healthcheck`` too,
envoyproxy/ratelimit's name, answering the same).

Served on the event loop next to gRPC (``--metrics-address``, on by default on loopback),
over :mod:`sidecar.http_server` (h11 under asyncio streams). What a client can hold is
bounded: the request head (8 KiB, read within :data:`READ_TIMEOUT`), the body (GET has
none: :data:`MAX_BODY_BYTES`), the idle time of a kept-alive connection
(:data:`IDLE_TIMEOUT`), the time it takes to read the answer (``--admin-write-timeout``: a
client that stops reading is dropped and its buffer freed) and the connections open at
once (``--admin-max-connections``: the rest get a short 503).

``/metrics`` and ``/config`` never render on the event loop: what they show is copied there
(numbers; the quota buckets' bounded descriptions; the config is immutable, swapped whole
on reload, so a reference is enough), and turned into text in a worker thread, one render
at a time per path, shared by the requests that arrive while it runs. ``/config`` is capped
at :data:`MAX_CONFIG_BYTES`: past it, rules are left out (the document says how many).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

from sidecar.config.model import DomainConfig, Level, RateLimitConfig, RateLimitRule
from sidecar.http_server import Answer, Bounds, HttpServer, Request
from sidecar.limiter.algorithms import Algorithm
from sidecar.metrics import render

READ_TIMEOUT = 5.0
IDLE_TIMEOUT = 5.0
"""Seconds a kept-alive admin connection may idle between requests (Prometheus reuses one)."""
MAX_BODY_BYTES = 1024
"""Admin requests are GETs; a larger body is refused (413) without being read."""
WRITE_TIMEOUT = 10.0
"""Default of ``--admin-write-timeout``: seconds a client gets to read a whole answer."""
MAX_CONNECTIONS = 16
"""Default of ``--admin-max-connections``: admin connections open at once."""
CONFIG_MAX_AGE = 1.0
"""Seconds a ``/config`` render is shown again to later readers (the same config still
active): the quota buckets it lists may be that much older than the answer."""
MAX_CONFIG_BYTES = 2 * 1024 * 1024
"""Largest ``/config`` answer. A config of 14,000 rules renders to 10 MB; past this cap the
rules that do not fit are left out (each domain says how many it has), so one GET costs
at most this much rendering and each slow reader pins at most this much."""
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

ConfigDocument = Callable[[], dict[str, Any]]
"""Builds the ``/config`` document; runs in a worker thread, so reads only what it was given."""


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
        "count_past_limit": rule.count_past,
        "overload": "suppress" if rule.suppress else "refuse",
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


def encoded(value: Any) -> bytes:
    """Indented JSON: ``indent`` also makes ``json`` use its Python encoder, which lets the
    GIL go every switch interval, so a render in a thread never holds the loop for long."""
    return json.dumps(value, indent=2, ensure_ascii=False).encode() + b"\n"


def capped_json(document: dict[str, Any], max_bytes: int) -> bytes:
    """``document`` (a :func:`config_json` one, with ``quota``) as JSON of at most ``max_bytes``.

    The rules are what grows: past the cap, each domain shows the rules that fit, in order,
    with ``rules_total``, and ``truncated`` says how many were left out. Measured rule by rule,
    so the cost is bounded by the cap, not by the config."""
    domains: dict[str, dict[str, Any]] = document.get("domains", {})
    skeleton = {**document, "domains": {name: {**domain, "rules": []} for name, domain in domains.items()}}
    note = {"max_bytes": max_bytes, "rules_left_out": 0}
    budget = max_bytes - len(encoded({**skeleton, "truncated": note})) - 64
    if budget < 0:
        skeleton["quota"] = {"left_out": f"over the /config cap of {max_bytes} bytes"}
        budget = max_bytes - len(encoded({**skeleton, "truncated": note})) - 64
    left_out = 0
    for name, domain in domains.items():
        rules: list[dict[str, Any]] = domain.get("rules", [])
        shown = skeleton["domains"][name]
        for rule in rules:
            text = json.dumps(rule, indent=2, ensure_ascii=False)
            size = len(text.encode()) + 8 * (text.count("\n") + 2)  # the deeper indent, the commas
            if budget < size:
                break
            budget -= size
            shown["rules"].append(rule)
        if len(shown["rules"]) < len(rules):
            shown["rules_total"] = len(rules)
            left_out += len(rules) - len(shown["rules"])
            budget = -1  # the rest is left out too: the shown rules stay a prefix of the config
    if left_out:
        skeleton["truncated"] = {"max_bytes": max_bytes, "rules_left_out": left_out}
    return encoded(skeleton)


class SharedRender:
    """One render at a time in a worker thread; callers arriving while it runs await the same
    bytes, and with ``max_age`` callers within that many seconds of a render get it again.

    A render in a thread still takes the GIL from the event loop, a switch interval at a time:
    one client looping ``GET /config`` (0.4 MB, ~60 ms a render) held the probe's p50 at
    46 ms. Reusing a render for ``max_age`` bounds what any number of readers cost to one
    render per ``max_age``; ``version`` (the active config object) makes a reload show at once.
    """

    def __init__(self, max_age: float = 0.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_age = max_age
        self.clock = clock
        self._rendering: asyncio.Future[bytes] | None = None
        self._last: tuple[float, object, bytes] | None = None
        """(when rendered, the version it showed, the bytes)."""
        self.renders = 0

    async def get(self, snapshot: Callable[[], Callable[[], bytes]], version: object = None) -> bytes:
        """``snapshot()`` runs here, on the loop (it copies what the thread may not read
        while the loop changes it); the function it returns runs in a thread."""
        last = self._last
        if last is not None and last[1] is version and self.clock() - last[0] < self.max_age:
            return last[2]
        if self._rendering is None:
            self.renders += 1
            rendering = asyncio.ensure_future(asyncio.to_thread(snapshot()))
            self._rendering = rendering
            rendering.add_done_callback(lambda done: self._rendered(done, version))
        return await asyncio.shield(self._rendering)

    def _rendered(self, rendering: asyncio.Future[bytes], version: object) -> None:
        if self._rendering is rendering:
            self._rendering = None
        if not rendering.cancelled() and rendering.exception() is None:
            self._last = (self.clock(), version, rendering.result())


def text_answer(status: int, text: str) -> Answer:
    return Answer(status, text.encode(), "text/plain")


def http_error(status: int, reason: str) -> Answer:
    """What an HTTP-level refusal (400, 408, 411, 413) gets on the admin endpoint."""
    return Answer(status, f"{reason}\n".encode(), "text/plain", close=True)


class AdminEndpoint:
    """Answers GET ``/metrics``, ``/config`` and ``/healthz``; anything else is 404/405."""

    def __init__(
        self,
        registry: Any,
        config: Callable[[], ConfigDocument],
        serving: Callable[[], bool],
        *,
        write_timeout: float = WRITE_TIMEOUT,
        max_connections: int = MAX_CONNECTIONS,
        max_config_bytes: int = MAX_CONFIG_BYTES,
        config_version: Callable[[], object] = lambda: None,
    ) -> None:
        self.registry = registry
        """What ``/metrics`` renders: an object with ``collect()``, or a callable returning
        one, called on the event loop (to copy numbers cheaply); ``collect()`` runs in a thread."""
        self.config = config
        """Called on the event loop for each ``/config`` render: snapshots what may change
        (the quota buckets) and returns the :data:`ConfigDocument` builder, run in a thread."""
        self.serving = serving
        self.max_config_bytes = max_config_bytes
        self.metrics = SharedRender()
        self.config_render = SharedRender(max_age=CONFIG_MAX_AGE)
        self.config_version = config_version
        """The active config object: a render showing another one is not reused."""
        bounds = Bounds(
            max_connections=max_connections,
            read_timeout=READ_TIMEOUT,
            idle_timeout=IDLE_TIMEOUT,
            write_timeout=write_timeout,
            max_body=MAX_BODY_BYTES,
        )
        self.http = HttpServer("admin", self.answer, bounds, http_error, text_answer(503, "busy\n"))

    @property
    def port(self) -> int:
        return self.http.port

    @property
    def refused(self) -> int:
        """Connections refused at ``max_connections`` (since start)."""
        return self.http.refused

    @property
    def dropped(self) -> int:
        """Clients dropped for not reading their answer within the write timeout (since start)."""
        return self.http.dropped

    async def start(self, address: str) -> None:
        await self.http.start(address)

    async def close(self) -> None:
        await self.http.close()

    async def answer(self, request: Request) -> Answer:
        """One request: a GET (or HEAD) of a known path."""
        if request.method not in ("GET", "HEAD"):
            return Answer(405, b"only GET\n", "text/plain", allow="GET, HEAD")
        if request.path == "/metrics":
            return Answer(200, await self.metrics_body(), METRICS_CONTENT_TYPE)
        if request.path == "/config":
            return Answer(200, await self.config_body(), "application/json")
        if request.path in ("/healthz", "/healthcheck"):
            return text_answer(200, "SERVING\n") if self.serving() else text_answer(503, "NOT_SERVING\n")
        return text_answer(404, "try /metrics, /config, /healthz or /healthcheck\n")

    async def metrics_body(self) -> bytes:
        """``/metrics``: numbers copied here, text made in a worker thread, shared."""

        def snapshot() -> Callable[[], bytes]:
            source = self.registry() if callable(self.registry) else self.registry
            return lambda: render(source)

        return await self.metrics.get(snapshot)

    async def config_body(self) -> bytes:
        """``/config``: the quota state copied here, the document built and capped in a thread, shared."""

        def snapshot() -> Callable[[], bytes]:
            document = self.config()
            return lambda: capped_json(document(), self.max_config_bytes)

        return await self.config_render.get(snapshot, self.config_version())
