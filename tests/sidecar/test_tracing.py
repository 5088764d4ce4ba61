"""OpenTelemetry tracing (sidecar/tracing.py): off unless OTEL_* asks, and real OTLP spans
from a real sidecar process that continue the caller's W3C ``traceparent``.

The spans go to a small OTLP/gRPC receiver in the test (tests/support/otlp.py), over the
SDK's real exporter: what a collector would get.
"""

from __future__ import annotations

import asyncio
import secrets
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

pytest.importorskip("opentelemetry.sdk", reason="the [tracing] extra is not installed (pip install -e '.[dev]')")

from sidecar.limiter.failure import FailurePolicy
from sidecar.limiter.redis.replicas import Replicas
from sidecar.limiter.redis.store import RedisStore
from sidecar.limiter.strict import StrictLimiter
from sidecar.limiter.sync import SyncLimiter
from sidecar.tracing import FLUSH_SPAN, SPAN_NAME, Tracing, tracing_requested
from tests.support.otlp import OtlpReceiver, ReceivedSpan
from tests.support.redis_servers import RedisServer, fresh_prefix
from tests.support.sidecars import OK, OVER_LIMIT, SidecarFactory, clean_env, request

SERVER_KIND = 2  # opentelemetry.proto.trace.v1.Span.SpanKind.SPAN_KIND_SERVER


@pytest.mark.parametrize(
    ("environ", "on"),
    [
        ({}, False),
        ({"OTEL_SERVICE_NAME": "x", "OTEL_TRACES_SAMPLER": "always_on"}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": ""}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}, True),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4317"}, True),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317", "OTEL_SDK_DISABLED": "true"}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317", "OTEL_SDK_DISABLED": "TRUE"}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317", "OTEL_SDK_DISABLED": "false"}, True),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317", "OTEL_TRACES_EXPORTER": "none"}, False),
    ],
)
def test_on_only_with_an_endpoint_and_not_disabled(environ: dict[str, str], on: bool) -> None:
    assert tracing_requested(environ) is on


def test_tracing_off_imports_no_opentelemetry() -> None:
    """Off, the server does not even load the SDK: nothing to pay at start or per call."""
    code = (
        "import sys, sidecar.server, sidecar.tracing\n"
        "assert sidecar.tracing.start_tracing('memory', {}) is None\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('opentelemetry'))\n"
        "assert not loaded, loaded\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(("mode", "on_path"), [("sync", "ratelimit.escalate"), ("strict", "ratelimit.redis_call")])
def test_the_hook_is_the_attribute_the_limiters_declare(mode: str, on_path: str) -> None:
    """Tracing sets the Redis limiters' ``redis_waits`` (no method replaced by name), and the
    spans it wraps their waits in: a child of the request's span, and a root span per flush."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    store = RedisStore.for_url("redis://127.0.0.1:1")  # never connected
    replicas = Replicas(store, 5.0)
    limiter = SyncLimiter(store, replicas) if mode == "sync" else StrictLimiter(store, replicas, FailurePolicy())
    assert limiter.redis_waits is None, "off: nothing wraps the waits"
    assert Tracing("memory", provider).hook(limiter) is False
    assert Tracing(mode, provider).hook(limiter) is True
    waits = limiter.redis_waits
    assert waits is not None

    async def waits_for_redis() -> None:
        with provider.get_tracer("test").start_as_current_span(SPAN_NAME):
            assert await waits.on_path(asyncio.sleep(0, "answer")) == "answer"
            assert await waits.flush(3, asyncio.sleep(0, "totals")) == "totals"

    asyncio.run(waits_for_redis())
    spans = {span.name: span for span in exporter.get_finished_spans()}
    request_span, child, flush = spans[SPAN_NAME], spans[on_path], spans[FLUSH_SPAN]
    assert request_span.attributes is not None and request_span.attributes["ratelimit.redis_on_path"] is True
    assert child.parent is not None and child.parent.span_id == request_span.context.span_id
    assert flush.parent is None, "a flush is a trace of its own"
    assert flush.attributes is not None and flush.attributes["ratelimit.flush.keys"] == 3


def traceparent() -> tuple[str, str, str]:
    """A sampled W3C traceparent and its trace and span ids (hex)."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


def otel_env(receiver: OtlpReceiver, **extra: str) -> dict[str, str]:
    return clean_env(
        OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint,
        OTEL_SERVICE_NAME="ratelimit-sidecar-test",
        OTEL_BSP_SCHEDULE_DELAY="100",  # ms: export soon, not after the default 5 s
        **extra,
    )


def request_spans(receiver: OtlpReceiver, trace_id: str) -> list[ReceivedSpan]:
    return receiver.wait_for(lambda span: span.name == SPAN_NAME and span.trace_id == trace_id, what=SPAN_NAME)


@pytest.mark.slow
def test_a_span_per_call_continues_the_callers_traceparent(start_sidecar: SidecarFactory, config_dir: Path) -> None:
    with OtlpReceiver() as receiver:
        sidecar = start_sidecar(config=config_dir, env=otel_env(receiver))
        value = uuid.uuid4().hex
        verdicts = []
        ids = []
        for _ in range(6):  # five_per_minute: 5 OK, then OVER_LIMIT
            header, trace_id, parent_id = traceparent()
            ids.append((trace_id, parent_id))
            response = sidecar.rls.ShouldRateLimit(
                request("it", [("per_minute", value)]), metadata=(("traceparent", header),), timeout=5
            )
            verdicts.append(response.overall_code)
        assert verdicts == [OK] * 5 + [OVER_LIMIT]

        for (trace_id, parent_id), verdict in zip(ids, verdicts, strict=True):
            (span,) = request_spans(receiver, trace_id)
            assert span.parent_span_id == parent_id, "the span continues the caller's trace"
            assert span.service == "ratelimit-sidecar-test"
            assert span.kind == SERVER_KIND
            assert span.attributes["ratelimit.domain"] == "it"
            assert span.attributes["ratelimit.mode"] == "memory"
            assert span.attributes["ratelimit.redis_on_path"] is False
            assert span.attributes["ratelimit.verdict"] == ("OK" if verdict == OK else "OVER_LIMIT")
            assert span.attributes["rpc.system"] == "grpc"

        # Without a traceparent the call starts a trace of its own (parentbased_always_on).
        sidecar.rls.ShouldRateLimit(request("it", [("generous", value)]), timeout=5)
        roots = receiver.wait_for(lambda span: span.name == SPAN_NAME and not span.parent_span_id, what="root span")
        assert {span.trace_id for span in roots}.isdisjoint(trace for trace, _ in ids)


@pytest.mark.slow
def test_sdk_disabled_sends_nothing(start_sidecar: SidecarFactory, config_dir: Path) -> None:
    with OtlpReceiver() as receiver:
        sidecar = start_sidecar(config=config_dir, env=otel_env(receiver, OTEL_SDK_DISABLED="true"))
        header, _, _ = traceparent()
        sidecar.rls.ShouldRateLimit(
            request("it", [("generous", uuid.uuid4().hex)]), metadata=(("traceparent", header),), timeout=5
        )
        sidecar.kill()
        assert receiver.spans == []
        assert "tracing_on" not in sidecar.stderr()


@pytest.mark.slow
def test_strict_mode_puts_redis_on_the_path(
    start_sidecar: SidecarFactory, config_dir: Path, redis_server: RedisServer
) -> None:
    with OtlpReceiver() as receiver:
        flags = ["--backend", "redis", "--redis-url", redis_server.url, "--redis-prefix", fresh_prefix("otl")]
        sidecar = start_sidecar(*flags, "--mode", "strict", config=config_dir, env=otel_env(receiver))
        header, trace_id, parent_id = traceparent()
        response = sidecar.rls.ShouldRateLimit(
            request("it", [("generous", uuid.uuid4().hex)]), metadata=(("traceparent", header),), timeout=5
        )
        assert response.overall_code == OK
        (span,) = request_spans(receiver, trace_id)
        assert span.parent_span_id == parent_id
        assert (span.attributes["ratelimit.mode"], span.attributes["ratelimit.redis_on_path"]) == ("strict", True)
        (child,) = receiver.wait_for(lambda s: s.name == "ratelimit.redis_call" and s.trace_id == trace_id)
        assert child.parent_span_id == span.span_id


@pytest.mark.slow
def test_sync_mode_decides_locally_and_traces_its_flushes(
    start_sidecar: SidecarFactory, config_dir: Path, redis_server: RedisServer
) -> None:
    with OtlpReceiver() as receiver:
        flags = ["--backend", "redis", "--redis-url", redis_server.url, "--redis-prefix", fresh_prefix("otl")]
        sidecar = start_sidecar(*flags, "--mode", "sync", config=config_dir, env=otel_env(receiver))
        header, trace_id, _ = traceparent()
        sidecar.rls.ShouldRateLimit(
            request("it", [("generous", uuid.uuid4().hex)]), metadata=(("traceparent", header),), timeout=5
        )
        (span,) = request_spans(receiver, trace_id)
        assert (span.attributes["ratelimit.mode"], span.attributes["ratelimit.redis_on_path"]) == ("sync", False)
        flushes = receiver.wait_for(lambda s: s.name == "ratelimit.flush" and s.attributes["ratelimit.flush.keys"] > 0)
        assert all(not flush.parent_span_id for flush in flushes), "a flush is a trace of its own"


@pytest.mark.slow
def test_sync_mode_escalation_near_the_limit_is_on_the_path(
    start_sidecar: SidecarFactory, config_dir: Path, redis_server: RedisServer
) -> None:
    """Two replicas, five_per_minute, a 5 % overshoot bound that allows none: near the limit
    neither replica can decide alone, so the call waits for Redis (an escalation)."""
    with OtlpReceiver() as receiver:
        flags = ["--backend", "redis", "--redis-url", redis_server.url, "--redis-prefix", fresh_prefix("otl")]
        pair = [start_sidecar(*flags, "--mode", "sync", config=config_dir, env=otel_env(receiver)) for _ in range(2)]
        time.sleep(2.5)  # the heartbeats: each replica sees the other
        value = uuid.uuid4().hex
        traces = []
        for index in range(6):
            header, trace_id, _ = traceparent()
            traces.append(trace_id)
            pair[index % 2].rls.ShouldRateLimit(
                request("it", [("per_minute", value)]), metadata=(("traceparent", header),), timeout=5
            )
        spans = [request_spans(receiver, trace_id)[0] for trace_id in traces]
        escalated = [span for span in spans if span.attributes["ratelimit.redis_on_path"]]
        assert escalated, [span.attributes for span in spans]
        for span in escalated:
            (child,) = receiver.wait_for(
                lambda s, span=span: s.name == "ratelimit.escalate" and s.trace_id == span.trace_id
            )
            assert child.parent_span_id == span.span_id


def test_the_installed_otlp_protos_carry_scope_spans() -> None:
    """xds-protos ships an old copy of the OpenTelemetry protos at opentelemetry-proto's paths;
    scripts/bootstrap puts opentelemetry-proto's files back, and the sidecar refuses to trace
    (one error line) when they were overwritten: here they must be the current ones."""
    from sidecar.tracing import proto_problem

    assert proto_problem() is None
