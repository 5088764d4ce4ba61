"""The ``envoy.service.ratelimit.v3.RateLimitService`` servicer.

The handler validates, matches every descriptor against the config tree, asks the
limiter once for the whole request (so the request is all-or-nothing) and writes
the response's wire bytes (:mod:`sidecar.service.wire`). It awaits only the limiter;
everything else is plain computation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from time import perf_counter
from typing import TYPE_CHECKING, Any

import grpc
import structlog
from google.protobuf.message import DecodeError

from sidecar.config.match import (
    OVERRIDE_SOURCE,
    Match,
    detailed_stat_key,
    drop_replaced,
    match_descriptor,
    override_rule,
    value_stat_key,
)
from sidecar.config.model import DomainConfig, RateLimitConfig
from sidecar.limiter.budget import caller_budget
from sidecar.limiter.protocol import Check, Decision, Limiter
from sidecar.limiter.windows import Clock, system_clock
from sidecar.metrics import ServiceStats
from sidecar.protos.envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc
from sidecar.service.headers import HeaderNames, ResponseHeaders
from sidecar.service.metadata import dynamic_metadata_field, response_metadata
from sidecar.service.reported import Applied, as_kept, reported_index
from sidecar.service.validate import request_problem
from sidecar.service.wire import (
    CODE_OK,
    CODE_OVER_LIMIT,
    PLAIN_OK_STATUS,
    UNLIMITED_STATUS,
    StatusParts,
    headers_fields,
    limited_status,
    overall,
)

if TYPE_CHECKING:
    from sidecar.tracing import Tracing

log = structlog.get_logger(__name__)

SERVICE_NAME = "envoy.service.ratelimit.v3.RateLimitService"


@dataclass(frozen=True, slots=True)
class Refusal:
    """A request the service does not decide: the gRPC status to answer, and its message."""

    code: grpc.StatusCode
    message: str


UNDECODABLE = Refusal(grpc.StatusCode.INVALID_ARGUMENT, "request: not a valid RateLimitRequest message")
INTERNAL = Refusal(grpc.StatusCode.INTERNAL, "internal error deciding the request; see sidecar logs")


class RateLimitService(rls_pb2_grpc.RateLimitServiceServicer):  # type: ignore[misc]
    """Answers ``ShouldRateLimit`` from the current config and a limiter backend."""

    def __init__(
        self,
        config: RateLimitConfig,
        limiter: Limiter,
        clock: Clock = system_clock,
        stats: ServiceStats | None = None,
        log_every: int = 0,
        *,
        response_headers: bool = False,
        header_names: HeaderNames | None = None,
        dynamic_metadata: bool = False,
    ) -> None:
        self.config = config
        """Swapped as a whole on reload; the handler reads it once per request."""
        self.limiter = limiter
        self.takes_budget: bool = getattr(limiter, "takes_budget", False)
        """The backend waits for Redis: each call's gRPC deadline is read and passed on as its
        budget (:func:`~sidecar.limiter.budget.caller_budget`); the memory backend pays nothing."""
        self.clock = clock
        self.stats = stats or ServiceStats()
        self.log_every = log_every
        """Log one decision in this many at debug level; 0 logs none (and costs nothing)."""
        self.in_flight = 0
        """Valid calls being decided right now; the drain waits for them."""
        self._parts = StatusParts()
        self.response_headers = response_headers
        """``--response-headers``: the one flag the request path checks (with the domain's soft limits)."""
        self.headers = ResponseHeaders(header_names or HeaderNames(), response_headers)
        self.dynamic_metadata = dynamic_metadata
        """``--response-dynamic-metadata``: answer with envoyproxy/ratelimit's dynamic metadata."""
        self.tracing: Tracing | None = None
        """OpenTelemetry spans (sidecar.tracing), set by the server when OTEL_* turns them on;
        with it None the request path pays this one attribute check."""

    async def ShouldRateLimit(  # noqa: N802 - name fixed by the proto
        self, request: Any, context: grpc.aio.ServicerContext[Any, Any]
    ) -> Any:
        """The RPC: INVALID_ARGUMENT for bad input, INTERNAL (logged) for our own faults.

        A Redis backend waits for Redis until shortly before the caller's deadline (Envoy
        sends its filter ``timeout`` as the gRPC deadline), at most ``--redis-timeout``.
        """
        budget = caller_budget(context.time_remaining()) if self.takes_budget else None
        if self.tracing is None:
            outcome = await self.handle(request, budget)
        else:
            outcome = await self.tracing.traced(
                lambda message: self.handle(message, budget), request, context.invocation_metadata()
            )
        if isinstance(outcome, Refusal):
            await context.abort(outcome.code, outcome.message)
        return outcome

    async def handle(self, request: Any | None, budget: float | None = None) -> bytes | Refusal:
        """The request path every transport shares (gRPC here, JSON in :mod:`sidecar.service.json_api`):
        validation, the decision and its metrics; the response's wire bytes, or why it is refused.
        ``budget``: seconds the backend may wait for Redis (None: its ``--redis-timeout``)."""
        stats = self.stats
        if request is None:
            stats.error("undecodable")
            return UNDECODABLE
        problem = request_problem(request)
        if problem is not None:
            stats.error("invalid_argument")
            return Refusal(grpc.StatusCode.INVALID_ARGUMENT, problem)
        started = perf_counter()
        self.in_flight += 1
        try:
            admitted, response = await self.answer(request, budget)
        except Exception:
            log.exception("decision_failed", domain=request.domain)
        else:
            stats.latency.observe(perf_counter() - started)
            stats.requests += 1
            if not admitted:
                stats.over_limit_requests += 1
            return response
        finally:
            self.in_flight -= 1
        stats.error("internal")
        return INTERNAL

    async def decide(self, request: Any) -> Any:
        """The response to a valid request as a message: for tests and tools, not the request path."""
        _, response = await self.answer(request)
        return rls_pb2.RateLimitResponse.FromString(response)

    async def answer(self, request: Any, budget: float | None = None) -> tuple[bool, bytes]:
        """Whether a valid request is admitted, and its response's wire bytes."""
        config = self.config
        domain = config.domains.get(request.domain)
        descriptors = request.descriptors
        if domain is None:
            response = overall(True) + PLAIN_OK_STATUS * len(descriptors)
            if self.dynamic_metadata:
                response += dynamic_metadata_field(response_metadata(request, (), None))
            return True, response
        matches = drop_replaced(
            [
                override_rule(domain.name, descriptor)
                if descriptor.HasField("limit")
                else match_descriptor(domain, descriptor.entries)
                for descriptor in descriptors
            ]
        )
        now = self.clock()
        checks, applied = self._checks(request, matches, domain)
        if not checks:
            response = self._respond([], applied, None, now, True)
            if self.dynamic_metadata:
                response += dynamic_metadata_field(response_metadata(request, applied, None))
            return True, response
        if budget is None:
            decision = await self.limiter.check(checks, now)
        else:
            decision = await self.limiter.check(checks, now, budget)
        if not decision.admitted:  # report what the counters kept, not the refused hits
            decision = as_kept(checks, decision)
        self._record(checks, applied, decision, now)
        if self.log_every and self.stats.requests % self.log_every == 0:
            log_decision(request, checks, decision, getattr(self.limiter, "suppression", None))
        admitted = decision.admitted
        response = self._respond(checks, applied, decision, now, admitted)
        if self.response_headers or domain.warns:
            headers = self.headers.pairs(checks, applied, decision, now, warns=domain.warns, stats=self.stats.rules)
            response += headers_fields(headers)
        if self.dynamic_metadata:
            response += dynamic_metadata_field(response_metadata(request, applied, decision))
        return admitted, response

    def _record(
        self, checks: Sequence[Check], applied: Sequence[Applied | None], decision: Decision, now: float
    ) -> None:
        """Per-rule metrics: plain integer additions, read only when Prometheus scrapes."""
        record = self.stats.rules.record
        suppressed = decision.suppressed
        if suppressed and not decision.admitted:
            self.stats.suppressed_requests += 1
        for item in applied:
            if item is not None and item.stats is not None and item.check is not None:
                index = item.check if not item.more else reported_index(item, checks, decision, now)
                record(
                    item.stats,
                    checks[index].hits,
                    decision.over[index],
                    shadow=item.rule.shadow_mode,
                    count=decision.counts[index],
                    limit=decision.limits[index],
                    suppressed=bool(suppressed) and suppressed[index],
                )

    def _checks(
        self, request: Any, matches: Sequence[Match | None], domain: DomainConfig
    ) -> tuple[list[Check], list[Applied | None]]:
        default_hits = request.hits_addend or 1
        rule_stats = self.stats.rules
        checks: list[Check] = []
        applied: list[Applied | None] = []
        for descriptor, match in zip(request.descriptors, matches, strict=True):
            if match is None:
                applied.append(None)
                continue
            rule = match.rule
            if rule.unlimited:
                applied.append(Applied(rule, None))
                continue
            hits = descriptor.hits_addend.value if descriptor.HasField("hits_addend") else default_hits
            if rule.detailed_metric:  # request values in the key: the row expires when idle
                row = rule_stats.row(detailed_stat_key(domain, descriptor.entries), rule.domain, minted=True)
            elif rule.values_in_stats and rule.source != OVERRIDE_SOURCE:  # value_to_metric: likewise
                row = rule_stats.row(value_stat_key(domain, descriptor.entries), rule.domain, minted=True)
            else:  # request overrides (keys chosen by the client) expire too
                row = rule_stats.row(rule.stat_key, rule.domain, minted=rule.source == OVERRIDE_SOURCE)
            more = tuple(extra.rule for extra in match.more)
            applied.append(Applied(rule, len(checks), row, more))
            if more:
                checks.extend(check_of(limit, hits) for limit in match.limits())
            else:  # check_of, inlined: this runs for every descriptor
                checks.append(
                    Check(
                        match.key,
                        rule.unit_seconds,
                        rule.limit,
                        hits,
                        rule.role,
                        rule.algorithm,
                        rule.interval_us,
                        rule.ban_seconds,
                        rule.count_past,
                        rule.suppress,
                    )
                )
        return checks, applied

    def _respond(
        self,
        checks: Sequence[Check],
        applied: Sequence[Applied | None],
        decision: Decision | None,
        now: float,
        admitted: bool,
    ) -> bytes:
        parts = [overall(admitted)]
        for item in applied:
            if item is None:
                parts.append(PLAIN_OK_STATUS)
            elif item.check is None or decision is None:
                parts.append(UNLIMITED_STATUS)
            else:
                rule, index = item.rule, item.check
                if item.more:
                    index = reported_index(item, checks, decision, now)
                    rule = item.rule if index == item.check else item.more[index - item.check - 1]
                over = decision.over[index]
                parts.append(
                    limited_status(
                        CODE_OVER_LIMIT if over and not rule.shadow_mode else CODE_OK,
                        self._parts.limit(rule),
                        decision.remaining(index),
                        decision.reset(checks[index], index, now),
                    )
                )
        return b"".join(parts)


def check_of(match: Match, hits: int) -> Check:
    """The check one limit of a matched descriptor asks the backend for."""
    rule = match.rule
    return Check(
        match.key,
        rule.unit_seconds,
        rule.limit,
        hits,
        rule.role,
        rule.algorithm,
        rule.interval_us,
        rule.ban_seconds,
        rule.count_past,
        rule.suppress,
    )


def log_decision(request: Any, checks: Sequence[Check], decision: Decision, suppression: Any = None) -> None:
    """One sampled request at debug level: enough to see what a client sends and gets, and,
    for ``overload: suppress`` checks, the ``p`` their counter is drawn with now."""
    demands = suppression.demands if suppression is not None else {}
    log.debug(
        "decision",
        domain=request.domain,
        descriptors=[[(entry.key, entry.value) for entry in item.entries] for item in request.descriptors],
        admitted=decision.admitted,
        counts=list(decision.counts),
        limits=list(decision.limits),
        hits=[check.hits for check in checks],
        suppressed=list(decision.suppressed),
        p=[round(demands[check.key].p, 4) if check.suppress and check.key in demands else None for check in checks],
    )


def parse_request(data: bytes) -> Any | None:
    """Decode a request; None for bytes that are not a ``RateLimitRequest``.

    gRPC answers a deserializer exception with UNKNOWN; returning None lets the
    handler answer INVALID_ARGUMENT like any other bad request.
    """
    try:
        return rls_pb2.RateLimitRequest.FromString(data)
    except DecodeError:
        return None


def add_to_server(service: RateLimitService, server: grpc.aio.Server) -> None:
    """Register ``ShouldRateLimit`` with the tolerant request parser."""
    method = grpc.unary_unary_rpc_method_handler(
        service.ShouldRateLimit,
        request_deserializer=parse_request,
        response_serializer=None,  # the handler returns wire bytes (sidecar.service.wire)
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, {"ShouldRateLimit": method}),))
