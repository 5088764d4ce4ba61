"""What OpenTelemetry tracing (sidecar/tracing.py) costs per ShouldRateLimit call, in this process.

    python -m loadtest.tracing_cost                     # about 1 minute on 2 cores
    python -m loadtest.tracing_cost --calls 20000 --repeat 5

The approach of ``loadtest/grpc_bench.py inproc``: the servicer's handler is awaited in a
loop, without gRPC, and the process's CPU time per call is the figure (all threads: the
span processor's export thread is counted). Each variant runs on a fresh memory limiter
with the same requests (the demo config, Envoy's descriptors for ``/api`` with an API key),
each call carrying a sampled W3C ``traceparent`` as Envoy sends it:

- ``off``: no OTEL_* endpoint, the default (``RateLimitService.tracing is None``);
- ``on, 1%``: ``OTEL_TRACES_SAMPLER=traceidratio``, ``OTEL_TRACES_SAMPLER_ARG=0.01``;
- ``on, 100%``: ``parentbased_always_on`` (the default) with Envoy sampling every request.

When on, spans go through the SDK's BatchSpanProcessor and OTLP/gRPC exporter to a
receiver in a child process (its CPU is not counted), as they would to a collector.
The check the request path pays when tracing is off is timed on its own too.
Bounded: ``--calls`` x ``--repeat`` per variant, and the receiver exits with this process.
"""

from __future__ import annotations

import argparse
import os
import secrets
import statistics
import subprocess
import sys
import time
import timeit
from collections.abc import Sequence
from concurrent import futures
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "examples" / "config"


class Context:
    """Enough of a grpc.aio ServicerContext: the call's metadata, and aborting is a bug."""

    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self.metadata = metadata

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self.metadata

    async def abort(self, code: Any, details: str) -> None:
        raise RuntimeError(f"abort {code}: {details}")


def requests(count: int) -> list[Any]:
    """Envoy's descriptors for ``GET /api`` with an API key (envoy/sidecar.yaml), many clients."""
    from sidecar.protos.envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
    from sidecar.protos.envoy.service.ratelimit.v3 import rls_pb2

    def descriptor(*entries: tuple[str, str]) -> Any:
        return ratelimit_pb2.RateLimitDescriptor(
            entries=[ratelimit_pb2.RateLimitDescriptor.Entry(key=k, value=v) for k, v in entries]
        )

    built = []
    for i in range(count):
        address = f"198.51.{i // 250 % 250}.{i % 250}"
        built.append(
            rls_pb2.RateLimitRequest(
                domain="demo",
                descriptors=[
                    descriptor(("remote_address", address)),
                    descriptor(("generic_key", "api")),
                    descriptor(("generic_key", "api"), ("api_key", f"key-{i % 1000}")),
                ],
            )
        )
    return built


def contexts(count: int) -> list[Context]:
    """A fresh sampled trace per call, as Envoy's tracer sends them."""
    return [Context((("traceparent", f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01"),)) for _ in range(count)]


def tracing(sampler: str, ratio: float, endpoint: str) -> Any:
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    from sidecar.tracing import Tracing

    chosen = TraceIdRatioBased(ratio) if sampler == "traceidratio" else ParentBased(TraceIdRatioBased(ratio))
    provider = TracerProvider(sampler=chosen, resource=Resource.create({"service.name": "tracing-cost"}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint, insecure=True)))
    return Tracing("memory", provider=provider)


async def per_call(variant: Any, config: Any, calls: Sequence[Any], metadata: Sequence[Context]) -> float:
    """CPU microseconds per awaited handler call, on a fresh limiter."""
    from sidecar.limiter.memory import MemoryLimiter
    from sidecar.service.servicer import RateLimitService

    service = RateLimitService(config, MemoryLimiter())
    service.tracing = variant
    handler = service.ShouldRateLimit
    started = time.process_time()
    for request, context in zip(calls, metadata, strict=True):
        await handler(request, context)
    return (time.process_time() - started) / len(calls) * 1e6


def off_check_ns() -> float:
    """Nanoseconds of the request path's one check when tracing is off."""
    from sidecar.limiter.memory import MemoryLimiter
    from sidecar.service.servicer import RateLimitService

    service = RateLimitService(_config(), MemoryLimiter())
    number = 2_000_000
    check = min(timeit.repeat("service.tracing is None", globals={"service": service}, number=number, repeat=5))
    empty = min(timeit.repeat("service", globals={"service": service}, number=number, repeat=5))
    return (check - empty) / number * 1e9


def _config() -> Any:
    from sidecar.config import load_config

    return load_config(CONFIG)


def start_receiver() -> tuple[subprocess.Popen[bytes], str]:
    """An OTLP/gRPC receiver in a child process (discards spans); its endpoint."""
    child = subprocess.Popen(
        [sys.executable, "-m", "loadtest.tracing_cost", "--receiver"],
        stdout=subprocess.PIPE,
        cwd=REPO,
    )
    assert child.stdout is not None
    port = int(child.stdout.readline())
    return child, f"http://127.0.0.1:{port}"


def run_receiver() -> None:
    """Child: accept OTLP exports until the parent goes (stdin closed or parent gone), at most 10 minutes."""
    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    class Sink(trace_service_pb2_grpc.TraceServiceServicer):  # type: ignore[misc]
        def Export(self, request: Any, context: Any) -> Any:  # noqa: N802 - name fixed by the proto
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Sink(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(port, flush=True)
    parent = os.getppid()
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and os.getppid() == parent:
        time.sleep(0.5)
    server.stop(0)


async def measure(calls: int, repeat: int, endpoint: str) -> dict[str, float]:
    config = _config()
    pool = requests(calls)
    variants = {
        "off": lambda: None,
        "on, 1% (traceidratio 0.01)": lambda: tracing("traceidratio", 0.01, endpoint),
        "on, 100% (parentbased_always_on)": lambda: tracing("parentbased", 1.0, endpoint),
    }
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeat + 1):  # the first pass warms up and is dropped
        for name, make in variants.items():
            variant = make()
            samples[name].append(await per_call(variant, config, pool, contexts(calls)))
            if variant is not None:
                variant.close()  # exports what is left: not counted, the timing is done
    return {name: statistics.median(values[1:]) for name, values in samples.items()}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=20_000, help="calls per variant and pass")
    parser.add_argument("--repeat", type=int, default=5, help="passes per variant (median)")
    parser.add_argument("--receiver", action="store_true", help=argparse.SUPPRESS)
    arguments = parser.parse_args(argv)
    if arguments.receiver:
        run_receiver()
        return 0
    import uvloop

    child, endpoint = start_receiver()
    try:
        import importlib.metadata

        import grpc

        print(
            f"python -m loadtest.tracing_cost --calls {arguments.calls} --repeat {arguments.repeat}\n"
            f"{os.cpu_count()} cores, Python {sys.version.split()[0]}, grpcio {grpc.__version__}, "
            f"opentelemetry-sdk {importlib.metadata.version('opentelemetry-sdk')}"
        )
        figures = uvloop.run(measure(arguments.calls, arguments.repeat, endpoint))
    finally:
        child.terminate()
        child.wait(10)
    off = figures["off"]
    print(f"CPU per ShouldRateLimit call (handler, memory backend), median of {arguments.repeat} passes:")
    for name, value in figures.items():
        extra = "" if name == "off" else f"  (+{value - off:.1f} us, +{(value / off - 1) * 100:.0f} %)"
        print(f"  {name:34s} {value:7.1f} us{extra}")
    print(f"  the off check itself ({'service.tracing is None'}): {off_check_ns():.1f} ns")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
