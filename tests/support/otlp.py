"""A small OTLP/gRPC trace receiver: the ``TraceService.Export`` method of an OpenTelemetry
collector, keeping every span it is sent, for tests that check real exported spans.

The service stubs come from ``opentelemetry-proto`` (the ``[tracing]`` extra); a test
module using this should ``pytest.importorskip("opentelemetry.proto")`` first.
"""

from __future__ import annotations

import threading
import time
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclass(frozen=True)
class ReceivedSpan:
    """One exported span, flattened: ids as hex, attributes as plain values."""

    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    kind: int
    attributes: dict[str, Any]


def _value(any_value: Any) -> Any:
    field = any_value.WhichOneof("value")
    return getattr(any_value, field) if field else None


class OtlpReceiver(trace_service_pb2_grpc.TraceServiceServicer):  # type: ignore[misc]
    """``with OtlpReceiver() as receiver:`` listens on ``receiver.endpoint`` (127.0.0.1, a free port)."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def Export(self, request: Any, context: Any) -> Any:  # noqa: N802 - name fixed by the proto
        received = []
        for resource_spans in request.resource_spans:
            resource = {item.key: _value(item.value) for item in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    received.append(
                        ReceivedSpan(
                            service=str(resource.get("service.name", "")),
                            name=span.name,
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_span_id=span.parent_span_id.hex(),
                            kind=span.kind,
                            attributes={item.key: _value(item.value) for item in span.attributes},
                        )
                    )
        with self._lock:
            self.spans.extend(received)
        return trace_service_pb2.ExportTraceServiceResponse()

    def wait_for(self, predicate: Any, timeout: float = 15.0, what: str = "spans") -> list[ReceivedSpan]:
        """The spans matching ``predicate`` once there is at least one; fails after ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                found = [span for span in self.spans if predicate(span)]
            if found:
                return found
            if time.monotonic() > deadline:
                with self._lock:
                    names = sorted({(span.service, span.name) for span in self.spans})
                raise AssertionError(f"no {what} within {timeout} s; received: {names}")
            time.sleep(0.05)

    def __enter__(self) -> OtlpReceiver:
        self.server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop(0)
