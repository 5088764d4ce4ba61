"""OpenTelemetry tracing: off by default, configured only by the standard ``OTEL_*`` variables.

The rule (docs/deployment.md, Tracing): tracing is **on** when ``OTEL_EXPORTER_OTLP_ENDPOINT``
(or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) is set and not empty, and **off** otherwise, or
whenever ``OTEL_SDK_DISABLED=true`` or ``OTEL_TRACES_EXPORTER=none``. Everything else is
read by the OpenTelemetry SDK itself: ``OTEL_SERVICE_NAME`` and ``OTEL_RESOURCE_ATTRIBUTES``
(the resource), ``OTEL_TRACES_SAMPLER`` / ``OTEL_TRACES_SAMPLER_ARG`` (default
``parentbased_always_on``: a call Envoy sampled is sampled), and the OTLP/gRPC exporter's
``OTEL_EXPORTER_OTLP_*`` (insecure for an ``http://`` endpoint, headers, timeout).

The SDK (the optional ``[tracing]`` extra) is imported only when tracing is on, so with it
off the request path pays one attribute check (``RateLimitService.tracing is None``) and
the process does not even load the packages.

Spans, when on:

- ``envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit`` (SERVER), one per call,
  continuing the W3C ``traceparent``/``tracestate`` Envoy sends in the call's metadata.
  Attributes: ``ratelimit.domain``, ``ratelimit.verdict`` (``OK``/``OVER_LIMIT``),
  ``ratelimit.mode`` (``memory``/``sync``/``strict``), ``ratelimit.redis_on_path`` (this
  call waited for Redis: always false for memory, true in strict mode when the script
  was sent, true in sync mode when the call escalated), and the gRPC ``rpc.*`` ones.
- ``ratelimit.escalate`` (sync) and ``ratelimit.redis_call`` (strict), children of the
  request span, around the call's wait for Redis.
- ``ratelimit.flush``, a root span per flush of pending hits to Redis (sync) or of owed
  hits (strict), only when there is something to send.

These three are attached from outside the limiters, through the attribute both Redis
limiters declare for it (``redis_waits``, :mod:`sidecar.limiter.hooks`): set to a
:class:`LimiterSpans` only when tracing is on, so the limiter code has no tracing in it
and pays one ``is None`` check when it is off.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

import structlog

from sidecar.service.wire import overall

log = structlog.get_logger(__name__)

SPAN_NAME = "envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit"
OVER_LIMIT = overall(False)
"""How the wire bytes of an OVER_LIMIT response begin (the overall code is their first field)."""
TRACE_HEADERS = frozenset({"traceparent", "tracestate"})
"""The W3C trace-context metadata keys (gRPC metadata keys are lower case)."""
TRUE = frozenset({"true", "1", "yes", "on"})

ON_PATH_SPANS = {"sync": "ratelimit.escalate", "strict": "ratelimit.redis_call"}
"""Per mode, the span around a request's wait for Redis; it marks ``ratelimit.redis_on_path``."""
FLUSH_SPAN = "ratelimit.flush"
"""The root span around a flush of pending (sync) or owed (strict) hits to Redis."""

T = TypeVar("T")


def tracing_requested(environ: Mapping[str, str] = os.environ) -> bool:
    """The on/off rule of the module docstring."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() in TRUE:
        return False
    if environ.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "none":
        return False
    endpoint = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    return bool(endpoint and endpoint.strip())


class Tracing:
    """A tracer provider exporting over OTLP/gRPC, and the per-call span."""

    def __init__(self, mode: str, provider: Any = None) -> None:
        from opentelemetry import context as otel_context  # noqa: PLC0415 - only when tracing is on
        from opentelemetry.sdk.trace import TracerProvider  # noqa: PLC0415
        from opentelemetry.trace import SpanKind, Status, StatusCode, set_span_in_context  # noqa: PLC0415
        from opentelemetry.trace.propagation.tracecontext import (  # noqa: PLC0415
            TraceContextTextMapPropagator,
        )

        if provider is None:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter  # noqa: PLC0415
            from opentelemetry.sdk.resources import Resource  # noqa: PLC0415
            from opentelemetry.sdk.trace.export import BatchSpanProcessor  # noqa: PLC0415

            resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", "ratelimit-sidecar")})
            # No sampler argument: the SDK reads OTEL_TRACES_SAMPLER / OTEL_TRACES_SAMPLER_ARG.
            provider = TracerProvider(resource=resource, shutdown_on_exit=False)
            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        self.provider = provider
        self.mode = mode
        self.tracer = provider.get_tracer("ratelimit-sidecar")
        self._propagator = TraceContextTextMapPropagator()
        self._server = SpanKind.SERVER
        self._error = Status(StatusCode.ERROR)
        self._status = Status
        self._in_context = set_span_in_context
        self._attach = otel_context.attach
        self._detach = otel_context.detach

    async def traced(self, call: Callable[[Any], Awaitable[Any]], request: Any, metadata: Any) -> Any:
        """``call(request)`` inside a span continuing the caller's W3C trace context.

        ``call`` answers with the response's wire bytes (whose first field is the overall
        code), an ``(admitted, bytes)`` pair, or a refusal (anything else, with a
        ``message``), which marks the span as an error."""
        carrier: dict[str, str] = {}
        for key, value in metadata or ():
            if key in TRACE_HEADERS:
                carrier[key] = value
        parent = self._propagator.extract(carrier) if carrier else None
        span = self.tracer.start_span(
            SPAN_NAME,
            context=parent,
            kind=self._server,
            attributes={
                "rpc.system": "grpc",
                "rpc.service": "envoy.service.ratelimit.v3.RateLimitService",
                "rpc.method": "ShouldRateLimit",
                "ratelimit.domain": getattr(request, "domain", ""),
                "ratelimit.mode": self.mode,
                "ratelimit.redis_on_path": False,
            },
        )
        token = self._attach(self._in_context(span))
        try:
            outcome = await call(request)
        except BaseException as error:
            span.record_exception(error)
            span.set_status(self._error)
            raise
        else:
            if isinstance(outcome, tuple):
                span.set_attribute("ratelimit.verdict", "OK" if outcome[0] else "OVER_LIMIT")
            elif isinstance(outcome, bytes):
                span.set_attribute("ratelimit.verdict", "OVER_LIMIT" if outcome.startswith(OVER_LIMIT) else "OK")
            else:
                span.set_status(self._status(self._error.status_code, str(getattr(outcome, "message", outcome))))
            return outcome
        finally:
            self._detach(token)
            span.end()

    def hook(self, limiter: Any) -> bool:
        """Spans around a Redis limiter's waits for Redis and flushes: sets its ``redis_waits``
        (:mod:`sidecar.limiter.hooks`). False for a limiter that never waits for Redis."""
        on_path = ON_PATH_SPANS.get(self.mode)
        if on_path is None or not hasattr(limiter, "redis_waits"):
            return False
        limiter.redis_waits = LimiterSpans(self.tracer, on_path)
        return True

    def close(self) -> None:
        """Export what is buffered, then stop (blocks up to the exporter's timeout)."""
        self.provider.force_flush()
        self.provider.shutdown()


class LimiterSpans:
    """The spans a Redis limiter's waits go in (a :class:`~sidecar.limiter.hooks.RedisWaits`)."""

    def __init__(self, tracer: Any, on_path: str) -> None:
        from opentelemetry import trace  # noqa: PLC0415 - only when tracing is on
        from opentelemetry.context import Context  # noqa: PLC0415

        self.tracer = tracer
        self.on_path_name = on_path
        self._current_span = trace.get_current_span
        self._root = Context

    async def on_path(self, wait: Awaitable[T]) -> T:
        """A child of the request's span; the request's span is marked ``ratelimit.redis_on_path``."""
        self._current_span().set_attribute("ratelimit.redis_on_path", True)
        with self.tracer.start_as_current_span(self.on_path_name):
            return await wait

    async def flush(self, keys: int, flush: Awaitable[T]) -> T:
        """A root span (a flush serves many requests), with the number of keys it adds to."""
        with self.tracer.start_as_current_span(FLUSH_SPAN, context=self._root()) as span:
            span.set_attribute("ratelimit.flush.keys", keys)
            return await flush


def proto_problem() -> str | None:
    """Why the installed OTLP protos cannot carry spans, or None.

    xds-protos ships an old copy of the OpenTelemetry protos at the same paths as
    opentelemetry-proto. The sidecar no longer depends on it (sidecar/protos/), but an
    application may install it beside the sidecar; when pip installed it last,
    ``ResourceSpans`` has no ``scope_spans`` and every export would be dropped by collectors. Checked once, at
    startup, only when tracing is asked for.
    """
    try:
        from opentelemetry.proto.trace.v1 import trace_pb2  # noqa: PLC0415 - only when tracing is on
    except ImportError:
        return None  # the SDK's own import error says what to install
    if "scope_spans" not in trace_pb2.ResourceSpans.DESCRIPTOR.fields_by_name:
        return "opentelemetry/proto was overwritten by an older copy (xds-protos ships one): no scope_spans"
    return None


def start_tracing(mode: str, environ: Mapping[str, str] = os.environ) -> Tracing | None:
    """A :class:`Tracing` when the environment asks for it and the SDK is installed, else None.

    A missing SDK is logged, not fatal: the sidecar is on every request's path, and
    limits matter more than traces.
    """
    if not tracing_requested(environ):
        return None
    problem = proto_problem()
    if problem is not None:
        log.error(
            "tracing_unavailable", reason=problem, hint="pip install --force-reinstall --no-deps opentelemetry-proto"
        )
        return None
    try:
        tracing = Tracing(mode)
    except ImportError as error:
        log.warning(
            "tracing_unavailable",
            reason=str(error),
            hint="pip install 'ratelimit-sidecar[tracing]' (opentelemetry-sdk, opentelemetry-exporter-otlp-proto-grpc)",
        )
        return None
    log.info(
        "tracing_on",
        endpoint=environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"),
        sampler=environ.get("OTEL_TRACES_SAMPLER", "parentbased_always_on"),
        sampler_arg=environ.get("OTEL_TRACES_SAMPLER_ARG"),
    )
    return tracing
