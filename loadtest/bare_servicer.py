"""A RateLimitService that does no work: the baseline the sidecar is compared against.

Same stack as the sidecar (``grpc.aio`` on uvloop, the same server options and method
registration, health and reflection registered), but ``ShouldRateLimit`` returns the
prebuilt wire bytes of ``RateLimitResponse(overall_code=OK)`` without reading the request. The
difference between this and the sidecar is therefore the cost of our own code
(validation, matching, the limiter, building the response), not of gRPC.

    python -m loadtest.bare_servicer --grpc-address 127.0.0.1:50051

For calibration and for splitting the sidecar's cost under real gRPC load, the
handler can instead do part of the sidecar's work (``--work``) or burn a fixed
amount of CPU (``--spin-us``):

- ``none``      constant response (the default; the baseline);
- ``sized``     a constant response the size of a typical real one (two limited
                statuses, 60 bytes): what sending a real answer costs the stack;
- ``validate``  ``request_problem(request)``, then the constant response;
- ``decide``    validate and ``RateLimitService.answer`` (match, limiter, write the
                response bytes), then return the *constant* response: the cost of
                our logic without sending the larger real response;
- ``handler``   the real ``RateLimitService.ShouldRateLimit``: the sidecar's request
                path in this minimal process (a control for ``sidecar serve``);
- ``floor``     a lower bound on any handler that answers these requests: match each
                descriptor, count it in one dict (emptied every second) and write its
                status with ``sidecar.service.wire``; no validation, windows, all-or-nothing
                or metrics. Not a rate limiter, a yardstick for the ratio's goal.

Stops on SIGTERM or SIGINT, and by itself after ``--max-seconds`` (default one
hour) so a forgotten process cannot outlive a benchmark for long.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import time
from typing import Any

import grpc
import uvloop
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from sidecar.config.match import match_descriptor
from sidecar.limiter.windows import seconds_until_reset
from sidecar.protos.envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc
from sidecar.server import SERVER_OPTIONS
from sidecar.service import wire
from sidecar.service.servicer import SERVICE_NAME, add_to_server

CONSTANT_RESPONSE = rls_pb2.RateLimitResponse(overall_code=rls_pb2.RateLimitResponse.OK).SerializeToString()
WORKS = ("none", "sized", "validate", "decide", "handler", "floor")


class BareRateLimitService(rls_pb2_grpc.RateLimitServiceServicer):  # type: ignore[misc]
    """Answers every call with the same OK response, touching nothing."""

    def __init__(self, response: bytes = CONSTANT_RESPONSE) -> None:
        self.response = response

    async def ShouldRateLimit(  # noqa: N802 - name fixed by the proto
        self, request: Any, context: grpc.aio.ServicerContext[Any, Any]
    ) -> Any:
        return self.response


def typical_response() -> bytes:
    """A real answer's bytes: OK, two descriptors under a 20/s limit (what ``sized`` returns)."""
    response = rls_pb2.RateLimitResponse(overall_code=rls_pb2.RateLimitResponse.OK)
    limit = rls_pb2.RateLimitResponse.RateLimit(name="per_address", requests_per_unit=20, unit=1)
    for _ in range(2):
        status = response.statuses.add(code=rls_pb2.RateLimitResponse.OK, current_limit=limit, limit_remaining=17)
        status.duration_until_reset.seconds = 1
    return bytes(response.SerializeToString())


class SpinningRateLimitService(rls_pb2_grpc.RateLimitServiceServicer):  # type: ignore[misc]
    """Calibration: burns ``spin`` seconds of CPU in the handler, then answers OK.

    Shows what a known amount of handler time costs in throughput on this stack.
    """

    def __init__(self, spin: float) -> None:
        self.spin = spin

    async def ShouldRateLimit(  # noqa: N802 - name fixed by the proto
        self, request: Any, context: grpc.aio.ServicerContext[Any, Any]
    ) -> Any:
        deadline = time.perf_counter() + self.spin
        while time.perf_counter() < deadline:
            pass
        return CONSTANT_RESPONSE


class PartialRateLimitService(rls_pb2_grpc.RateLimitServiceServicer):  # type: ignore[misc]
    """Does the first steps of the sidecar's request path, answers the constant response."""

    def __init__(self, work: str, config_path: str) -> None:
        from sidecar.config import load_config
        from sidecar.limiter.memory import MemoryLimiter
        from sidecar.service.servicer import RateLimitService
        from sidecar.service.validate import request_problem

        self.work = work
        self.validate = request_problem
        self.service = RateLimitService(load_config(config_path), MemoryLimiter())

    async def ShouldRateLimit(  # noqa: N802 - name fixed by the proto
        self, request: Any, context: grpc.aio.ServicerContext[Any, Any]
    ) -> Any:
        if self.validate(request) is None and self.work == "decide":
            await self.service.answer(request)
        return CONSTANT_RESPONSE


class FloorRateLimitService(rls_pb2_grpc.RateLimitServiceServicer):  # type: ignore[misc]
    """The least work that still answers each descriptor from a count: see ``floor`` above."""

    def __init__(self, config_path: str) -> None:
        from sidecar.config import load_config

        self.config = load_config(config_path)
        self.parts = wire.StatusParts()
        self.counts: dict[Any, int] = {}
        self.second = 0

    async def ShouldRateLimit(  # noqa: N802 - name fixed by the proto
        self, request: Any, context: grpc.aio.ServicerContext[Any, Any]
    ) -> Any:
        domain = self.config.domains[request.domain]
        now = time.time()
        if int(now) != self.second:
            self.second = int(now)
            self.counts.clear()
        counts = self.counts
        statuses = []
        admitted = True
        for descriptor in request.descriptors:
            match = match_descriptor(domain, descriptor.entries)
            if match is None or match.rule.unlimited:
                statuses.append(wire.PLAIN_OK_STATUS)
                continue
            rule = match.rule
            count = counts[match.key] = counts.get(match.key, 0) + 1
            over = count > rule.limit
            admitted = admitted and not over
            code = wire.CODE_OVER_LIMIT if over else wire.CODE_OK
            reset = seconds_until_reset(now, rule.unit_seconds)
            statuses.append(wire.limited_status(code, self.parts.limit(rule), max(0, rule.limit - count), reset))
        return wire.overall(admitted) + b"".join(statuses)


def build_servicer(work: str, spin_us: float, config_path: str) -> Any:
    """The servicer asked for on the command line."""
    if spin_us > 0:
        return SpinningRateLimitService(spin_us / 1e6)
    if work == "sized":
        return BareRateLimitService(typical_response())
    if work == "floor":
        return FloorRateLimitService(config_path)
    if work == "none":
        return BareRateLimitService()
    if work == "handler":
        from sidecar.config import load_config
        from sidecar.limiter.memory import MemoryLimiter
        from sidecar.service.servicer import RateLimitService

        return RateLimitService(load_config(config_path), MemoryLimiter())
    return PartialRateLimitService(work, config_path)


async def serve(address: str, max_seconds: float, servicer: Any) -> None:
    """Serve on ``address`` until a signal or ``max_seconds``, then stop at once."""
    server = grpc.aio.server(options=SERVER_OPTIONS)
    add_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    port = server.add_insecure_port(address)
    if port == 0:
        raise SystemExit(f"bare_servicer: cannot listen on {address}")
    await server.start()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    print(f"bare_servicer: serving on {address}", file=sys.stderr, flush=True)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await asyncio.wait_for(stop.wait(), timeout=max_seconds)
    except TimeoutError:
        print("bare_servicer: --max-seconds reached, stopping", file=sys.stderr, flush=True)
    await server.stop(0.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--grpc-address", default="127.0.0.1:50051", help="HOST:PORT to listen on")
    parser.add_argument("--max-seconds", type=float, default=3600.0, help="stop by itself after this long")
    parser.add_argument("--work", choices=WORKS, default="none", help="part of the sidecar's work to do")
    parser.add_argument("--config", default="examples/config", help="config for --work validate|decide|handler")
    parser.add_argument(
        "--spin-us",
        type=float,
        default=0.0,
        help="calibration: burn this many microseconds of CPU per call instead (default 0: off)",
    )
    arguments = parser.parse_args()
    servicer = build_servicer(arguments.work, arguments.spin_us, arguments.config)
    uvloop.run(serve(arguments.grpc_address, arguments.max_seconds, servicer))


if __name__ == "__main__":
    main()
