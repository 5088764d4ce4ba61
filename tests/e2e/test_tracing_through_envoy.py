"""Real Envoy 1.40 with its OpenTelemetry tracer in front of a real sidecar: Envoy's ratelimit
call carries ``traceparent``, and the sidecar's span is the child of Envoy's span for that call.

What we found: Envoy propagates the trace context to the ratelimit gRPC call only when its
HTTP connection manager traces (``tracing.provider``, here ``envoy.tracers.opentelemetry``
exporting to the same in-test OTLP receiver as the sidecar). Its async gRPC client then
starts an egress span for ``ShouldRateLimit`` and injects it as the call's ``traceparent``.
Without a tracer, Envoy sends no ``traceparent`` and each sidecar span starts its own trace.
"""

from __future__ import annotations

import contextlib
import http.server
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("opentelemetry.sdk", reason="the [tracing] extra is not installed (pip install -e '.[dev]')")

from sidecar.tracing import SPAN_NAME
from stack.envoy import ROUTER, ConfiguredEnvoy, bootstrap, cluster
from stack.processes import ProcessGroup
from tests.support.envoys import send
from tests.support.otlp import OtlpReceiver
from tests.support.sidecars import SidecarFactory, clean_env, free_port, write_config

pytestmark = [pytest.mark.envoy, pytest.mark.slow]

CONFIG = """\
domain: traced
descriptors:
  - key: generic_key
    value: traced
    rate_limit: {unit: minute, requests_per_unit: 2}
"""


class _App(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("content-length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def app_port() -> Iterator[int]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _App)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()


HCM = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"


def envoy_config(
    listen: int, admin: int, app: int, sidecar: int, otlp: int, *, tracer: bool = True
) -> dict[str, object]:
    manager = {
        "@type": HCM,
        "stat_prefix": "ingress",
        # The part that makes Envoy send traceparent to the ratelimit cluster: a tracer.
        "tracing": {
            "random_sampling": {"value": 100},
            "provider": {
                "name": "envoy.tracers.opentelemetry",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.config.trace.v3.OpenTelemetryConfig",
                    "grpc_service": {"envoy_grpc": {"cluster_name": "otlp"}, "timeout": "1s"},
                    "service_name": "envoy",
                },
            },
        },
        "route_config": {
            "virtual_hosts": [
                {
                    "name": "app",
                    "domains": ["*"],
                    "routes": [
                        {
                            "match": {"prefix": "/"},
                            "route": {
                                "cluster": "app",
                                "rate_limits": [{"actions": [{"generic_key": {"descriptor_value": "traced"}}]}],
                            },
                        }
                    ],
                }
            ]
        },
        "http_filters": [
            {
                "name": "envoy.filters.http.ratelimit",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimit",
                    "domain": "traced",
                    "timeout": "2s",
                    "rate_limit_service": {
                        "transport_api_version": "V3",
                        "grpc_service": {"envoy_grpc": {"cluster_name": "ratelimit"}},
                    },
                },
            },
            ROUTER,
        ],
    }
    if not tracer:
        del manager["tracing"]
    clusters = [cluster("app", app, False), cluster("ratelimit", sidecar, True), cluster("otlp", otlp, True)]
    config = bootstrap(listen, admin, manager, clusters)
    # Export each span at once instead of every 5 s.
    config["layered_runtime"] = {
        "layers": [
            {
                "name": "static",
                "static_layer": {
                    "tracing.opentelemetry.min_flush_spans": 1,
                    "tracing.opentelemetry.flush_interval_ms": 100,
                },
            }
        ]
    }
    return config


@contextlib.contextmanager
def traced_pair(
    start_sidecar: SidecarFactory, tmp_path: Path, app_port: int, tracer: bool
) -> Iterator[tuple[OtlpReceiver, str]]:
    """A receiver, and the URL of an Envoy (with or without its tracer) in front of a traced sidecar."""
    with OtlpReceiver() as receiver:
        env = clean_env(
            OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint,
            OTEL_SERVICE_NAME="ratelimit-sidecar",
            OTEL_BSP_SCHEDULE_DELAY="100",
        )
        sidecar = start_sidecar(config=write_config(tmp_path / "config", CONFIG, "traced.yaml"), env=env)
        listen, admin = free_port(), free_port()
        config = envoy_config(listen, admin, app_port, sidecar.port, receiver.port, tracer=tracer)
        group = ProcessGroup()
        try:
            group.start_ready(lambda: ConfiguredEnvoy("envoy", config, tmp_path, listen=listen, admin=admin))
            yield receiver, f"http://127.0.0.1:{listen}"
        finally:
            group.close()


def test_the_sidecar_span_is_the_child_of_envoys_ratelimit_call(
    start_sidecar: SidecarFactory, tmp_path: Path, app_port: int
) -> None:
    with traced_pair(start_sidecar, tmp_path, app_port, tracer=True) as (receiver, url):
        statuses = [send(url, "/").status for _ in range(3)]
        assert 429 in statuses, statuses  # the limit (2/minute) bites: the sidecar decided

        def is_ours(span: Any) -> bool:
            return bool(span.name == SPAN_NAME and span.service == "ratelimit-sidecar")

        ours = receiver.wait_for(is_ours)
        deadline = time.monotonic() + 15
        while True:
            # Both exporters batch: look again at everything received, not at the first batch.
            ours = [span for span in receiver.spans if is_ours(span)]
            envoy_spans = {span.span_id: span for span in receiver.spans if span.service == "envoy"}
            linked = [span for span in ours if span.parent_span_id in envoy_spans]
            if len(linked) >= 3 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert len(linked) >= 3, (ours, sorted(envoy_spans))
        for span in linked:
            parent = envoy_spans[span.parent_span_id]
            assert parent.trace_id == span.trace_id
            assert "ShouldRateLimit" in parent.name, parent.name  # Envoy's egress span for the gRPC call
        verdicts = sorted(span.attributes["ratelimit.verdict"] for span in linked)
        assert "OVER_LIMIT" in verdicts and "OK" in verdicts


def test_without_a_tracer_envoy_sends_no_traceparent(
    start_sidecar: SidecarFactory, tmp_path: Path, app_port: int
) -> None:
    with traced_pair(start_sidecar, tmp_path, app_port, tracer=False) as (receiver, url):
        assert send(url, "/").status == 200
        (span,) = receiver.wait_for(lambda span: span.name == SPAN_NAME)
        assert span.parent_span_id == "", "a trace of the sidecar's own"
        assert not [span for span in receiver.spans if span.service == "envoy"]
