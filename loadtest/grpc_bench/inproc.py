"""``inproc``: the CPU cost per call of each step of the request path, in this process, without gRPC."""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from loadtest.common import write_json
from loadtest.grpc_bench.mix import request_pool
from loadtest.grpc_bench.report import command_line, environment, print_header
from loadtest.grpc_bench.servers import config_path
from sidecar.protos.envoy.service.ratelimit.v3 import rls_pb2


def per_call(function: Callable[[Any], Any], items: Sequence[Any]) -> float:
    """CPU microseconds per call of ``function`` over ``items`` (loop overhead included).

    Process CPU time, not wall time, so other load on the machine does not inflate it.
    """
    started = time.process_time()
    for item in items:
        function(item)
    return (time.process_time() - started) / len(items) * 1e6


async def per_await(function: Callable[[Any], Any], items: Sequence[Any]) -> float:
    """CPU microseconds per ``await function(item)`` over ``items``."""
    started = time.process_time()
    for item in items:
        await function(item)
    return (time.process_time() - started) / len(items) * 1e6


class AbortingContext:
    """Enough of a ``ServicerContext`` for the handler: aborting is a bug here."""

    async def abort(self, code: Any, details: str) -> None:
        raise RuntimeError(f"abort {code}: {details}")


def unmetered_service(config: Any, response_headers: bool = False) -> Any:
    """The service with metric recording switched off: prices what recording costs."""
    from sidecar.limiter.memory import MemoryLimiter
    from sidecar.service.servicer import RateLimitService

    class Unmetered(RateLimitService):  # type: ignore[misc]
        def _record(self, *_: Any) -> None:
            """No per-rule counts."""

    service = Unmetered(config, MemoryLimiter(), response_headers=response_headers)
    service.stats.latency.observe = lambda _: None  # type: ignore[method-assign,assignment]  # no latency histogram
    return service


async def measure_inproc(
    config: Any, requests: Sequence[Any], repeat: int, response_headers: bool = False
) -> dict[str, float]:
    """Median over ``repeat`` passes of each step's cost, each pass on a fresh limiter."""
    from sidecar.limiter.memory import MemoryLimiter
    from sidecar.service.servicer import RateLimitService
    from sidecar.service.validate import request_problem

    payloads = [request.SerializeToString() for request in requests]
    context = AbortingContext()
    samples: dict[str, list[float]] = {}
    responses: list[Any] = []
    for _ in range(repeat + 1):  # the first pass warms up and is dropped
        service = RateLimitService(config, MemoryLimiter(), response_headers=response_headers)
        responses = [await service.decide(request) for request in requests]
        figures = {
            "parse request (FromString)": per_call(rls_pb2.RateLimitRequest.FromString, payloads),
            "validate (request_problem)": per_call(request_problem, requests),
            "answer (match + limiter + response bytes)": await per_await(
                RateLimitService(config, MemoryLimiter(), response_headers=response_headers).answer, requests
            ),
            "ShouldRateLimit handler (validate + answer)": await per_await(
                functools.partial(
                    RateLimitService(config, MemoryLimiter(), response_headers=response_headers).ShouldRateLimit,
                    context=context,
                ),
                requests,
            ),
            "handler without recording metrics": await per_await(
                functools.partial(unmetered_service(config, response_headers).ShouldRateLimit, context=context),
                requests,
            ),
        }
        for name, value in figures.items():
            samples.setdefault(name, []).append(value)
    result = {name: statistics.median(values[1:]) for name, values in samples.items()}
    result["metrics recording (handler - without)"] = (
        result["ShouldRateLimit handler (validate + answer)"] - result["handler without recording metrics"]
    )
    over = sum(1 for r in responses if r.overall_code == rls_pb2.RateLimitResponse.OVER_LIMIT)
    result["share OVER_LIMIT"] = over / len(requests)
    return result


async def profile_inproc(config: Any, requests: Sequence[Any], top: int) -> None:
    """cProfile of the handler over ``requests``, the ``top`` functions by own time."""
    import cProfile
    import pstats

    from sidecar.limiter.memory import MemoryLimiter
    from sidecar.service.servicer import RateLimitService

    service = RateLimitService(config, MemoryLimiter())
    context = AbortingContext()
    profiler = cProfile.Profile()
    profiler.enable()
    for request in requests:
        await service.ShouldRateLimit(request, context)
    profiler.disable()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(top)


def cmd_inproc(arguments: argparse.Namespace) -> int:
    """Per-call cost of each step of the request path, in this process, without gRPC."""
    import uvloop

    from sidecar.config import load_config

    env = environment()
    print_header(arguments, env)
    config = load_config(config_path(arguments.config))
    pool = request_pool(arguments.pattern, arguments.pool_size, arguments.seed, "inproc")
    requests = [pool[i % len(pool)] for i in range(arguments.calls)]
    figures = uvloop.run(measure_inproc(config, requests, arguments.repeat, arguments.response_headers))
    print(
        f"{arguments.calls} calls x {arguments.repeat} passes (median), pattern {arguments.pattern}, "
        f"{len(pool)} distinct requests:"
    )
    for name, value in figures.items():
        if name.startswith("share"):
            print(f"  {name:45} {value:.1%}")
        else:
            print(f"  {name:45} {value:7.2f} us/call")
    if arguments.profile:
        uvloop.run(profile_inproc(config, requests, arguments.profile))
    print(f"reproduce: {command_line(arguments)}")
    if arguments.json:
        write_json(
            arguments.json,
            {"command": command_line(arguments), "environment": env, "us_per_call": figures},
        )
    return 0
