"""Latency that Envoy's rate-limit filter adds, with our sidecar behind it, at a fixed request rate.

Three variants run side by side on 127.0.0.1, all with ``envoy/front.yaml`` (its routes and
descriptors) in front of one sample upstream app (``stack/upstream.py``):

(a) ``no_filter``      Envoy without the rate-limit filter (``stack.envoy.render(ratelimit=False)``);
(b) ``memory``         Envoy + filter + sidecar, embedded memory backend;
(c) ``sync_redis``     Envoy + filter + sidecar in sync mode with a local redis-server.

The load is open loop: request ``i`` is scheduled at ``start + i / rate`` whatever happened
to the earlier ones, on keep-alive HTTP/1.1 connections (a new one is opened when none is
idle, up to ``--connections``), and its latency is measured from the *scheduled* time, so a
stall delays every request scheduled during it and shows in the percentiles (no coordinated
omission). The variants alternate in ``--rounds`` rounds (the order rotates each round), so
noise on this shared machine hits all of them; each run sends ``--warmup`` seconds unmeasured,
then ``--duration`` seconds measured. The report gives, per variant, the median over rounds of
p50 / p90 / p99 / max, and the added latency against (a): the median over rounds of the
difference to (a) in the same round. "gen lag p99" is how late the load generator sent
requests against their schedule: when it is large, the generator, not the server, is slow.

What is sent: ``GET /latency`` (the catch-all route: one descriptor, the client address,
limited to 20/s per address) with ``X-Forwarded-For`` cycling over 508 documentation
addresses (198.51.100.0/24, 203.0.113.0/24), so at 200 requests/s each address sends under
one request per second. Every request is decided by the sidecar and admitted: what is measured
is the cost of asking, not the cost of refusing. A 429 in the counts means a limit was hit
after all (raise the address count or lower ``--rate``).

Pinning: ``--server-cpus`` pins every server (Envoys, sidecars, redis-server, app) and
``--client-cpus`` the load generator (this process); giving only one pins the other to the
remaining usable cpus. Nothing is pinned by default. On 2 cores::

    python -m loadtest.envoy_latency --server-cpus 0 --client-cpus 1

Examples::

    python -m loadtest.envoy_latency                                   # 200 req/s, 3 rounds x 10 s per variant
    python -m loadtest.envoy_latency --rate 500 --duration 5 --rounds 5 --json loadtest/results/envoy-latency.json

Every child process is stopped at the end, also on Ctrl-C, SIGTERM or error.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import uvloop

from loadtest.common import (
    bounded_float,
    cpu_seconds_of,
    dash,
    machine_facts,
    md_table,
    median_or_none,
    percentile,
    positive_int,
    print_header,
    program_version,
    reproduce_command,
    run_cli,
    split_cpus,
    tool_parser,
    write_json,
)
from loadtest.http_load import Connection, HttpError, Pool
from stack.envoy import ENVOY_CONFIGS, EnvoyPorts, EnvoyProcess
from stack.processes import ProcessGroup
from stack.redis import RedisProcess
from stack.sidecar import SidecarProcess
from stack.upstream import UpstreamProcess

REPO = Path(__file__).resolve().parent.parent

EXAMPLE_CONFIG = REPO / "examples" / "config"
PATH = "/latency"
VARIANTS = {
    "no_filter": "(a) Envoy, no rate-limit filter",
    "memory": "(b) Envoy + filter + sidecar (memory)",
    "sync_redis": "(c) Envoy + filter + sidecar (sync, Redis)",
}
BASELINE = "no_filter"


def addresses() -> list[str]:
    """508 documentation addresses: at 200 requests/s each sends about 0.4 per second."""
    return [f"198.51.100.{i}" for i in range(1, 255)] + [f"203.0.113.{i}" for i in range(1, 255)]


# ---------------------------------------------------------------------------------
# The servers
# ---------------------------------------------------------------------------------


@dataclass
class Servers:
    """The processes of all three variants, and where each variant's Envoy listens."""

    group: ProcessGroup
    ports: dict[str, int] = field(default_factory=dict)
    pids: dict[str, list[int]] = field(default_factory=dict)


def start_servers(directory: Path, server_cpus: tuple[int, ...] | None) -> Servers:
    """App, redis-server, two sidecars and three Envoys, each waited for until it serves.

    The servers inherit this process's affinity: when ``server_cpus`` is given it is set
    before they start (the caller moves itself to the client cpus afterwards).
    """
    if server_cpus is not None:
        os.sched_setaffinity(0, server_cpus)
    group = ProcessGroup()
    servers = Servers(group)
    try:
        # Through the launchers that build a child again on fresh ports when another process
        # took one between choosing and binding it.
        app = group.start_ready(lambda: UpstreamProcess("app", directory))
        redis = group.start_ready(lambda: RedisProcess(directory))
        config = ["--config", str(EXAMPLE_CONFIG), "--log-level", "warning"]
        sync_args = [*config, "--backend", "redis", "--redis-url", redis.url, "--mode", "sync"]
        memory, sync = group.start_all_ready(
            [
                functools.partial(SidecarProcess, "sidecar-memory", [*config, "--backend", "memory"], directory),
                functools.partial(SidecarProcess, "sidecar-sync", sync_args, directory),
            ]
        )
        template = ENVOY_CONFIGS / "front.yaml"

        def envoy(label: str, sidecar: SidecarProcess, ratelimit: bool = True) -> Callable[[], EnvoyProcess]:
            ports = functools.partial(EnvoyPorts.free, app.port, sidecar.port)
            return lambda: EnvoyProcess(label, template, ports(), directory, ratelimit=ratelimit)

        builds = [envoy("envoy-no-filter", memory, False), envoy("envoy-memory", memory), envoy("envoy-sync", sync)]
        envoys = dict(zip(("no_filter", "memory", "sync_redis"), group.start_all_ready(builds), strict=True))
    except BaseException:
        group.close()
        raise
    servers.ports = {name: envoy.ports.listen for name, envoy in envoys.items()}
    shared = [app.pid]
    servers.pids = {
        "no_filter": [envoys["no_filter"].pid, *shared],
        "memory": [envoys["memory"].pid, memory.pid, *shared],
        "sync_redis": [envoys["sync_redis"].pid, sync.pid, redis.pid, *shared],
    }
    return servers


# ---------------------------------------------------------------------------------
# The load generator: open loop, keep-alive HTTP/1.1 on asyncio
# ---------------------------------------------------------------------------------


@dataclass
class RunResult:
    """One measured run of one variant."""

    variant: str
    round: int
    sent: int = 0
    statuses: dict[str, int] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)
    connections: int = 0
    p50_ms: float = 0.0
    p90_ms: float = 0.0
    p99_ms: float = 0.0
    max_ms: float = 0.0
    lag_p99_ms: float = 0.0
    server_cpu_us_per_request: float | None = None
    """CPU time of the variant's servers (Envoy, sidecar, redis-server, app) per request sent, warm-up included."""


async def drive(
    port: int, *, rate: float, warmup: float, duration: float, limit: int, timeout: float
) -> dict[str, Any]:
    """Send ``rate`` requests/s for ``warmup + duration`` seconds; figures of the measured part."""
    perf = time.perf_counter
    requests = [
        f"GET {PATH} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nX-Forwarded-For: {address}\r\n\r\n".encode()
        for address in addresses()
    ]
    pool = Pool(port, limit)
    latencies: list[float] = []
    lags: list[float] = []
    statuses: Counter[str] = Counter()
    errors: Counter[str] = Counter()
    interval = 1.0 / rate
    total = round((warmup + duration) * rate)
    first_measured = round(warmup * rate)

    async def one(index: int, scheduled: float) -> None:
        connection: Connection | None = None
        try:
            async with asyncio.timeout(timeout):
                connection = await pool.acquire()
                sent = perf()
                status = await connection.exchange(requests[index % len(requests)])
        except (TimeoutError, OSError, ValueError, asyncio.IncompleteReadError, HttpError) as error:
            if connection is not None:  # else acquire() failed and gave its slot back itself
                connection.reusable = False
                await pool.release(connection)
            if index >= first_measured:
                errors[type(error).__name__] += 1
            return
        done = perf()
        await pool.release(connection)
        if index >= first_measured:
            latencies.append(done - scheduled)
            lags.append(sent - scheduled)
            statuses[str(status)] += 1

    tasks: set[asyncio.Task[None]] = set()
    start = perf() + 0.05
    try:
        for index in range(total):
            scheduled = start + index * interval
            delay = scheduled - perf()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(one(index, scheduled))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.wait(tasks, timeout=timeout + 1)
    finally:
        for task in tasks:
            task.cancel()
        pool.close()
    latencies.sort()
    lags.sort()
    return {
        "sent": total - first_measured,
        "statuses": dict(statuses),
        "errors": dict(errors),
        "connections": pool.opened,
        "p50_ms": percentile(latencies, 0.50) * 1000,
        "p90_ms": percentile(latencies, 0.90) * 1000,
        "p99_ms": percentile(latencies, 0.99) * 1000,
        "max_ms": (latencies[-1] if latencies else 0.0) * 1000,
        "lag_p99_ms": percentile(lags, 0.99) * 1000,
    }


def measure(servers: Servers, variant: str, round_number: int, arguments: argparse.Namespace) -> RunResult:
    before = cpu_seconds_of(servers.pids[variant])
    figures = uvloop.run(
        drive(
            servers.ports[variant],
            rate=arguments.rate,
            warmup=arguments.warmup,
            duration=arguments.duration,
            limit=arguments.connections,
            timeout=arguments.timeout,
        )
    )
    after = cpu_seconds_of(servers.pids[variant])
    result = RunResult(variant=variant, round=round_number, **figures)
    if before is not None and after is not None:
        requests = round((arguments.warmup + arguments.duration) * arguments.rate)
        result.server_cpu_us_per_request = (after - before) / requests * 1e6
    return result


# ---------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------


def summarize(results: Sequence[RunResult]) -> dict[str, dict[str, Any]]:
    """Per variant: totals, medians over rounds, and the median per-round difference to the baseline."""
    by_round = {(result.variant, result.round): result for result in results}
    rounds = sorted({result.round for result in results})
    summary = {}
    for variant, label in VARIANTS.items():
        runs = [by_round[variant, number] for number in rounds if (variant, number) in by_round]
        if not runs:
            continue
        statuses: Counter[str] = Counter()
        errors: Counter[str] = Counter()
        for run in runs:
            statuses.update(run.statuses)
            errors.update(run.errors)
        row: dict[str, Any] = {
            "label": label,
            "rounds": len(runs),
            "sent": sum(run.sent for run in runs),
            "statuses": dict(statuses),
            "errors": dict(errors),
            "connections": max(run.connections for run in runs),
        }
        row["server_cpu_us_per_request"] = median_or_none(run.server_cpu_us_per_request for run in runs)
        for key in ("p50_ms", "p90_ms", "p99_ms", "max_ms", "lag_p99_ms"):
            row[key] = statistics.median(getattr(run, key) for run in runs)
            pairs = [
                getattr(by_round[variant, number], key) - getattr(by_round[BASELINE, number], key)
                for number in rounds
                if (variant, number) in by_round and (BASELINE, number) in by_round
            ]
            row["added_" + key] = median_or_none(pairs) if variant != BASELINE else None
        summary[variant] = row
    return summary


def markdown_table(summary: dict[str, dict[str, Any]], arguments: argparse.Namespace) -> str:
    title = f"variant ({arguments.rate:g} req/s, median of {arguments.rounds} rounds x {arguments.duration:g} s)"
    header = [title, "requests", "200", "429", "other / errors", "p50 ms", "p90 ms", "p99 ms", "max ms"]
    header += ["added p50 ms", "added p90 ms", "added p99 ms", "server CPU µs/req", "gen lag p99 ms"]
    rows = []
    for row in summary.values():
        statuses = row["statuses"]
        other = sum(count for status, count in statuses.items() if status not in ("200", "429"))
        other += sum(row["errors"].values())
        counts = [row["sent"], statuses.get("200", 0), statuses.get("429", 0), other]
        times = [dash(row[key], ".2f") for key in ("p50_ms", "p90_ms", "p99_ms", "max_ms")]
        added = [dash(row[f"added_{key}"], "+.2f") for key in ("p50_ms", "p90_ms", "p99_ms")]
        cpu, lag = dash(row["server_cpu_us_per_request"], ".0f"), dash(row["lag_p99_ms"], ".2f")
        rows.append([row["label"], *(f"{count:,}" for count in counts), *times, *added, cpu, lag])
    return md_table(header, rows)


def command_line(arguments: argparse.Namespace) -> str:
    return reproduce_command(["python", "-m", "loadtest.envoy_latency"], arguments, skip={"json"})


def run(arguments: argparse.Namespace) -> int:
    server_cpus, client_cpus = split_cpus(arguments.server_cpus, arguments.client_cpus)
    facts = machine_facts()
    pins = f"pinning: servers {server_cpus or 'no'}, load generator {client_cpus or 'no'}"
    details = f"Python {facts['python']}, {program_version('envoy')}; {pins}"
    print_header(command_line(arguments), facts, os.getloadavg()[0], details)
    print(
        f"load: GET {PATH} at {arguments.rate:g} req/s open loop, X-Forwarded-For over {len(addresses())} addresses "
        f"(under every limit), up to {arguments.connections} keep-alive connections; "
        f"{arguments.warmup:g} s warm-up + {arguments.duration:g} s measured per run",
        flush=True,
    )
    results: list[RunResult] = []
    with tempfile.TemporaryDirectory(prefix="envoy-latency-") as directory:
        original = os.sched_getaffinity(0)
        servers = start_servers(Path(directory), server_cpus)
        try:
            os.sched_setaffinity(0, client_cpus or original)
            order = list(VARIANTS)
            for number in range(1, arguments.rounds + 1):
                shift = (number - 1) % len(order)
                for variant in order[shift:] + order[:shift]:
                    result = measure(servers, variant, number, arguments)
                    results.append(result)
                    failures = sum(result.errors.values())
                    print(
                        f"round {number}/{arguments.rounds} {variant:<10} {result.sent} requests "
                        f"{dict(sorted(result.statuses.items()))}"
                        f"{f' errors {result.errors}' if failures else ''}: p50 {result.p50_ms:.2f} ms, "
                        f"p99 {result.p99_ms:.2f} ms, max {result.max_ms:.2f} ms, "
                        f"gen lag p99 {result.lag_p99_ms:.2f} ms",
                        flush=True,
                    )
        finally:
            servers.group.close()
    summary = summarize(results)
    print()
    print(markdown_table(summary, arguments))
    print()
    print(
        "added: median over rounds of (variant - (a)) in the same round; latency from each request's scheduled "
        "send time; server CPU: Envoy + sidecar (+ redis-server) + app, per request; "
        "gen lag: how late the load generator sent against the schedule"
    )
    print(f"Reproduce: `{command_line(arguments)}`")
    if arguments.json:
        document = {
            "command": command_line(arguments),
            "machine": {**facts, "server_cpus": server_cpus, "client_cpus": client_cpus},
            "summary": summary,
            "runs": [asdict(result) for result in results],
        }
        write_json(arguments.json, document)
    errors = sum(sum(row["errors"].values()) for row in summary.values())
    return 0 if errors == 0 else 2


def build_parser() -> argparse.ArgumentParser:
    parser = tool_parser("loadtest.envoy_latency", __doc__)
    parser.add_argument(
        "--rate", type=bounded_float(0, 5000, include_low=False), default=200.0, help="requests/s (default 200)"
    )
    parser.add_argument(
        "--duration",
        type=bounded_float(0, 600, include_low=False),
        default=10.0,
        help="measured seconds per run (default 10)",
    )
    parser.add_argument("--warmup", type=float, default=1.0, help="unmeasured seconds before each run (default 1)")
    parser.add_argument("--rounds", type=positive_int, default=3, help="rounds of all three variants (default 3)")
    parser.add_argument(
        "--connections", type=positive_int, default=64, help="most keep-alive connections open at once (default 64)"
    )
    parser.add_argument(
        "--timeout", type=bounded_float(0, 60, include_low=False), default=2.0, help="per request, seconds (default 2)"
    )
    parser.add_argument("--server-cpus", help="pin every server to these cpus, e.g. 0")
    parser.add_argument("--client-cpus", help="pin the load generator to these cpus, e.g. 1")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON, e.g. loadtest/results/...")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    arguments = build_parser().parse_args(argv)
    if arguments.warmup < 0:
        raise SystemExit("envoy_latency: --warmup must be >= 0")
    signals = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    return run_cli("envoy_latency", functools.partial(run, arguments), signals)


if __name__ == "__main__":
    sys.exit(main())
