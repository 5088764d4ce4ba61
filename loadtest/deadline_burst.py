"""Issue 17's burst driven by h2load: bare servicer, sync and strict sidecars side by side.

Why: ``loadtest.accuracy``'s ``burst_hour`` sends the burst from a Python gRPC client, which
eats about half of this 2-core machine; Envoy, the real caller, is C++. Here ``h2load``
(nghttp2, C) sends the calls, so the rest of the machine goes to the servers.

The burst: one descriptor limited to ``--limit`` (20) per hour, ``--replicas`` (3) replicas,
``--calls`` (300) split evenly over them, ``--in-flight`` (32) in flight per replica (one h2load
and one HTTP/2 connection per replica, all started at once), every call with Envoy's
``--deadline-ms`` (25 ms) gRPC deadline. Targets: ``bare`` (``loadtest.bare_servicer``, constant
OK: the floor of any Python handler here), ``memory`` (sidecars ``--backend memory``: the
handler's own cost, each replica counting alone), ``sync`` and ``strict`` (sidecars
``--backend redis --mode sync|strict`` on one redis-server). Each round starts fresh processes per target (the
sidecars on a FLUSHALL'd Redis), warms every replica with ``WARMUP_CALLS`` calls on another
value (lazy imports and first calls stay out of the burst), then fires the burst on a value of
its own. h2load sees every gRPC answer as HTTP 200 (a call past its deadline ends as
DEADLINE_EXCEEDED in the trailers), so "past the deadline" is counted from latency. For
sidecars: what Redis holds for the burst's value, and the failure-mode decisions and
full-window refusals of the burst (``/metrics`` after minus before, all replicas). The target
order rotates each round; the table gives medians over rounds.

    python -m loadtest.deadline_burst                       # 3 rounds of bare, memory, sync, strict
    python -m loadtest.deadline_burst --targets sync,strict --rounds 5 --json /tmp/burst.json

Only 127.0.0.1; every child is stopped at the end, also on Ctrl-C, SIGTERM or error.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from loadtest.common import METHOD, health_serving, machine_facts, percentile, positive_int, reproduce_command, run_cli
from loadtest.reliability_harness.support import CounterNames, redis_command, redis_counts, scrape
from stack import redis as stack_redis
from stack.processes import Child, ProcessGroup, free_port
from stack.redis import RedisProcess
from stack.sidecar import SidecarProcess

TARGETS = {
    "bare": "bare servicer (no work)",
    "memory": "sidecar, memory backend",
    "sync": "sidecar, redis sync",
    "strict": "sidecar, redis strict",
}
REDIS_TARGETS = ("sync", "strict")
DOMAIN, KEY = "burst", "client"
PREFIX = "rls"
"""The sidecars' default ``--redis-prefix``."""
WARMUP_CALLS = 200
SETTLE_SECONDS = 0.5
"""Pause after the warm-up and after the burst: ten sync intervals, so background flushes land."""
H2LOAD_TIMEOUT = 60.0
BARE_MAX_SECONDS = 600
FAILURES = "ratelimit_sidecar_failure_decisions_total{"
FULL_WINDOW = "ratelimit_sidecar_full_window_refusals_total"


def config_text(limit: int) -> str:
    """envoyproxy/ratelimit's format: ``limit`` per hour for each value of the one key."""
    rule = f"rate_limit: {{unit: hour, requests_per_unit: {limit}}}"
    return f"domain: {DOMAIN}\ndescriptors:\n  - key: {KEY}\n    {rule}\n"


def grpc_frame(domain: str, key: str, value: str) -> bytes:
    """The body h2load sends with ``-d``: one gRPC message (flag byte 0, 4-byte length, request)."""
    from sidecar.protos.envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
    from sidecar.protos.envoy.service.ratelimit.v3 import rls_pb2

    entry = ratelimit_pb2.RateLimitDescriptor.Entry(key=key, value=value)
    request = rls_pb2.RateLimitRequest(domain=domain, descriptors=[ratelimit_pb2.RateLimitDescriptor(entries=[entry])])
    message = bytes(request.SerializeToString())
    return b"\x00" + struct.pack(">I", len(message)) + message


def parse_h2load_log(text: str) -> list[tuple[int, float]]:
    """``(HTTP status, latency ms)`` per call from ``--log-file`` (start µs, status, elapsed µs)."""
    calls = []
    for line in text.splitlines():
        fields = line.split("\t")
        if len(fields) >= 3:
            calls.append((int(fields[1]), int(fields[2]) / 1000))
    return calls


def latency_figures(latencies_ms: Sequence[float], deadline_ms: float) -> tuple[float, float, int]:
    """p50 and p99 (nearest rank) and how many calls ended after the deadline."""
    ordered = sorted(latencies_ms)
    over = sum(1 for latency in ordered if latency > deadline_ms)
    return percentile(ordered, 0.50), percentile(ordered, 0.99), over


def split_calls(calls: int, replicas: int) -> list[int]:
    """``calls`` spread over ``replicas`` as evenly as whole numbers allow."""
    return [calls // replicas + (1 if index < calls % replicas else 0) for index in range(replicas)]


@dataclass
class Context:
    arguments: argparse.Namespace
    directory: Path
    redis: RedisProcess | None


class BareServicer(Child):
    """``python -m loadtest.bare_servicer`` on a free port; it stops by itself after 10 minutes."""

    ready_sign = "gRPC health SERVING"

    def __init__(self, name: str, directory: Path) -> None:
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        argv = [sys.executable, "-m", "loadtest.bare_servicer", "--grpc-address", self.address]
        super().__init__(name, [*argv, "--max-seconds", str(BARE_MAX_SECONDS)], directory / f"{name}.log")

    def ready(self) -> bool:
        return health_serving(self.address)


def start_replicas(group: ProcessGroup, context: Context, target: str, number: int) -> list[Any]:
    """Fresh servers of ``target``, started in parallel and waited for."""
    names = [f"{target}-r{number}-{index}" for index in range(context.arguments.replicas)]
    if target == "bare":
        return group.start_all_ready([functools.partial(BareServicer, name, context.directory) for name in names])
    serve = ["--config", str(context.directory / "config"), "--watch-config", "false", "--log-level", "warning"]
    if target in REDIS_TARGETS:
        assert context.redis is not None
        serve += ["--backend", "redis", "--redis-url", context.redis.url, "--mode", target]
    else:  # each replica its own limit: the handler's cost without Redis, not a shared limit
        serve += ["--backend", "memory"]
    return group.start_all_ready([functools.partial(SidecarProcess, n, serve, context.directory) for n in names])


def h2load_binary() -> str:
    found = shutil.which("h2load")
    if found is None:
        raise RuntimeError("no h2load: install nghttp2-client (apt-get install nghttp2-client)")
    return found


def h2load_argv(port: int, calls: int, arguments: argparse.Namespace, body: Path, log: Path) -> list[str]:
    return [
        h2load_binary(), "-n", str(calls), "-c", "1", "-m", str(arguments.in_flight),
        "-H", "content-type: application/grpc", "-H", "te: trailers",
        "-H", f"grpc-timeout: {arguments.deadline_ms}m",
        "-d", str(body), f"--log-file={log}", f"http://127.0.0.1:{port}{METHOD}",
    ]  # fmt: skip


def fire(
    ports: Sequence[int], calls: Sequence[int], arguments: argparse.Namespace, body: Path, value: str
) -> list[Any]:
    """One h2load per replica, all started at once, each call on ``value``; every call's ``(status, latency ms)``."""
    body.write_bytes(grpc_frame(DOMAIN, KEY, value))
    logs = [body.with_name(f"{body.stem}-{index}.log") for index in range(len(ports))]
    argvs = [
        h2load_argv(port, count, arguments, body, log) for port, count, log in zip(ports, calls, logs, strict=True)
    ]
    processes = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for argv in argvs]
    try:
        outputs = [process.communicate(timeout=H2LOAD_TIMEOUT)[0] for process in processes]
    except subprocess.TimeoutExpired as error:
        raise RuntimeError(f"h2load did not finish within {H2LOAD_TIMEOUT:g} s: a server stopped answering") from error
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    for process, output in zip(processes, outputs, strict=True):
        if process.returncode != 0:
            raise RuntimeError(f"h2load failed ({process.returncode}): {output.strip()[-500:]}")
    return [call for log in logs for call in parse_h2load_log(log.read_text())]


def sidecar_figures(replicas: Sequence[Any]) -> dict[str, float]:
    """Failure-mode decisions by reason, and full-window refusals, summed over ``replicas``."""
    totals: dict[str, float] = {}
    for replica in replicas:
        for name, value in scrape(replica.metrics_url).items():
            if name.startswith(FAILURES) or name == FULL_WINDOW:
                key = name.split('reason="', 1)[1].split('"', 1)[0] if name.startswith(FAILURES) else name
                totals[key] = totals.get(key, 0.0) + value
    return totals


@dataclass
class RoundResult:
    target: str
    round: int
    calls: int
    failed: int
    p50_ms: float
    p99_ms: float
    over_deadline: int
    redis_count: int | None = None
    failure_decisions: dict[str, float] | None = None
    full_window_refusals: float | None = None
    crossed_hour: bool = False
    """The burst ran across the top of an hour: its count spans two windows."""


def burst(context: Context, target: str, replicas: Sequence[Any], number: int) -> RoundResult:
    """Warm ``replicas`` on another value, let flushes land, fire the burst; its figures."""
    arguments, directory, sidecar = context.arguments, context.directory, target != "bare"
    ports = [replica.port for replica in replicas]
    fire(ports, [WARMUP_CALLS] * len(ports), arguments, directory / f"warm-{target}-{number}.bin", "warm")
    time.sleep(SETTLE_SECONDS)
    before = sidecar_figures(replicas) if sidecar else {}
    hour = int(time.time() // 3600)
    body = directory / f"burst-{target}-{number}.bin"
    calls = fire(ports, split_calls(arguments.calls, arguments.replicas), arguments, body, f"burst-{number}")
    crossed = int(time.time() // 3600) != hour
    latencies = [latency for status, latency in calls if status == 200]
    p50, p99, over = latency_figures(latencies, arguments.deadline_ms)
    result = RoundResult(target, number, len(calls), len(calls) - len(latencies), p50, p99, over, crossed_hour=crossed)
    if sidecar:
        time.sleep(SETTLE_SECONDS)
        counted = {name: value - before.get(name, 0.0) for name, value in sidecar_figures(replicas).items()}
        result.full_window_refusals = counted.pop(FULL_WINDOW, None)
        result.failure_decisions = {reason: count for reason, count in sorted(counted.items()) if count}
    return result


def measure(context: Context, target: str, number: int) -> RoundResult:
    """Fresh replicas of ``target`` (the sidecars on a flushed Redis), one burst, Redis read after."""
    if context.redis is not None and target in REDIS_TARGETS:
        redis_command(context.redis.port, "FLUSHALL")
    group = ProcessGroup()
    try:
        result = burst(context, target, start_replicas(group, context, target, number), number)
    finally:
        group.close()
    if context.redis is not None and target in REDIS_TARGETS:
        digest = CounterNames(context.directory / "config", DOMAIN).digest([(KEY, f"burst-{number}")])
        result.redis_count = redis_counts(context.redis.port, PREFIX).get(digest, 0)
    return result


def describe(reasons: Mapping[str, float]) -> str:
    return ", ".join(f"{count:g} {reason}" for reason, count in reasons.items()) or "none"


def round_line(result: RoundResult, arguments: argparse.Namespace) -> str:
    """One target's round, printed as the run goes on."""
    line = (
        f"round {result.round}/{arguments.rounds} {result.target:<6} {result.calls} calls: p50 {result.p50_ms:.2f} "
        f"ms, p99 {result.p99_ms:.2f} ms, {result.over_deadline} past {arguments.deadline_ms} ms"
    )
    if result.failed:
        line += f", {result.failed} FAILED streams"
    if result.redis_count is not None:
        refusals = "-" if result.full_window_refusals is None else f"{result.full_window_refusals:g}"
        line += (
            f"; Redis {result.redis_count} of {arguments.limit}; failure-mode decisions "
            f"{describe(result.failure_decisions or {})}; full-window refusals {refusals}"
        )
    return line + (" (crossed the top of the hour: the count spans two windows)" if result.crossed_hour else "")


def median_or_none(values: Sequence[float | None]) -> float | None:
    present = [value for value in values if value is not None]
    return statistics.median(present) if present else None


def summarize(results: Sequence[RoundResult]) -> dict[str, dict[str, Any]]:
    """Per target, medians over rounds; ``p99_x_bare`` is the median of p99 / bare's p99 in the
    same round (noise on this shared machine hits both alike)."""
    bare = {result.round: result.p99_ms for result in results if result.target == "bare"}
    rows: dict[str, dict[str, Any]] = {}
    for target, label in TARGETS.items():
        runs = [result for result in results if result.target == target]
        if not runs:
            continue
        decisions = [run.failure_decisions for run in runs]
        ratios = [run.p99_ms / bare[run.round] if bare.get(run.round) else None for run in runs]
        reasons: Counter[str] = Counter()
        for run in runs:
            reasons.update(run.failure_decisions or {})
        rows[target] = {
            "label": label,
            "p50_ms": statistics.median(run.p50_ms for run in runs),
            "p99_ms": statistics.median(run.p99_ms for run in runs),
            "over_deadline": statistics.median(run.over_deadline for run in runs),
            "failed": sum(run.failed for run in runs),
            "redis_count": median_or_none([run.redis_count for run in runs]),
            "failure_decisions": median_or_none([None if d is None else sum(d.values()) for d in decisions]),
            "failure_reasons_all_rounds": dict(sorted(reasons.items())),
            "full_window_refusals": median_or_none([run.full_window_refusals for run in runs]),
            "p99_x_bare": median_or_none(ratios),
        }
    return rows


def table(rows: dict[str, dict[str, Any]], arguments: argparse.Namespace) -> str:
    def cell(value: float | None, spec: str = "g") -> str:
        return "-" if value is None else format(value, spec)

    lines = [
        f"| target (median of {arguments.rounds} rounds) | p50 ms | p99 ms | calls past {arguments.deadline_ms} ms "
        f"| Redis count (admitted, limit {arguments.limit}) | failure-mode decisions (reasons, all rounds) "
        "| full-window refusals | p99 x bare |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows.values():
        reasons = f" ({describe(row['failure_reasons_all_rounds'])})" if row["failure_reasons_all_rounds"] else ""
        lines.append(
            f"| {row['label']} | {row['p50_ms']:.2f} | {row['p99_ms']:.2f} | {row['over_deadline']:g} "
            f"| {cell(row['redis_count'])} | {cell(row['failure_decisions'])}{reasons} "
            f"| {cell(row['full_window_refusals'])} | {cell(row['p99_x_bare'], '.2f')} |"
        )
    return "\n".join(lines)


def tool_version(argv: Sequence[str]) -> str:
    try:
        text = subprocess.run(argv, capture_output=True, text=True, timeout=10, check=False).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return text.splitlines()[0] if text else "unknown"


def command_line(arguments: argparse.Namespace) -> str:
    arguments = argparse.Namespace(**{**vars(arguments), "targets": ",".join(arguments.targets)})
    return reproduce_command(["python", "-m", "loadtest.deadline_burst"], arguments, skip={"json"})


def header(arguments: argparse.Namespace, facts: dict[str, Any]) -> None:
    print(f"command: {command_line(arguments)}", flush=True)
    print(
        f"machine: {facts['cores']} cores ({facts['cpu_model']}), load average {os.getloadavg()[0]:.2f}; "
        f"Python {facts['python']}, {tool_version([h2load_binary(), '--version'])}, "
        f"{tool_version([stack_redis.REDIS_SERVER, '--version'])}; nothing pinned",
        flush=True,
    )
    per_replica = "/".join(str(count) for count in split_calls(arguments.calls, arguments.replicas))
    print(
        f"burst: limit {arguments.limit}/hour, {arguments.replicas} replicas, {arguments.calls} calls ({per_replica} "
        f"per replica, one h2load each, all at once), {arguments.in_flight} in flight per replica, grpc-timeout "
        f"{arguments.deadline_ms}m; each round: fresh processes, {WARMUP_CALLS} warm-up calls per replica",
        flush=True,
    )


def rotated(targets: Sequence[str], number: int) -> list[str]:
    """``targets`` rotated by one per round, so no target always goes first."""
    shift = (number - 1) % len(targets)
    return [*targets[shift:], *targets[:shift]]


def write_json(path: Path, arguments: argparse.Namespace, facts: dict[str, Any], results: list[Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    document = {
        "command": command_line(arguments),
        "machine": {**facts, "load_average": os.getloadavg()[0]},
        "summary": summarize(results),
        "runs": [asdict(result) for result in results],
    }
    path.write_text(json.dumps(document, indent=2, sort_keys=True) + "\n")
    print(f"wrote {path}")


def run(arguments: argparse.Namespace) -> int:
    h2load_binary()
    needs_redis = any(target in REDIS_TARGETS for target in arguments.targets)
    if needs_redis and not stack_redis.available():
        raise RuntimeError("no redis-server: install redis-server (apt-get install redis-server)")
    facts = machine_facts()
    header(arguments, facts)
    results: list[RoundResult] = []
    with tempfile.TemporaryDirectory(prefix="deadline-burst-") as name:
        directory = Path(name)
        (directory / "config").mkdir()
        (directory / "config" / "burst.yaml").write_text(config_text(arguments.limit))
        group = ProcessGroup()
        try:
            redis = group.start_ready(lambda: RedisProcess(directory)) if needs_redis else None
            for number in range(1, arguments.rounds + 1):
                for target in rotated(arguments.targets, number):
                    results.append(measure(Context(arguments, directory, redis), target, number))
                    print(round_line(results[-1], arguments), flush=True)
        finally:
            group.close()
    print(f"\n{table(summarize(results), arguments)}\n")
    print(
        f"past {arguments.deadline_ms} ms: answered after the deadline (DEADLINE_EXCEEDED; Envoy's filter fails "
        "open on those); Redis count: hits Redis holds for the burst's value; failure-mode decisions and "
        "full-window refusals: during the burst, all replicas; p99 x bare: median of the same round's ratio"
    )
    print(f"Reproduce: `{command_line(arguments)}`")
    if arguments.json:
        write_json(Path(arguments.json), arguments, facts, results)
    return 0 if all(result.failed == 0 for result in results) else 2


def target_list(text: str) -> list[str]:
    """argparse type: a comma list of targets, each known, none twice."""
    targets = [part.strip() for part in text.split(",") if part.strip()]
    if not targets or not set(targets) <= set(TARGETS) or len(set(targets)) != len(targets):
        raise argparse.ArgumentTypeError(f"a comma list of {', '.join(TARGETS)}, each at most once")
    return targets


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.deadline_burst",
        description=(__doc__ or "").split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    add("--rounds", type=positive_int, default=3, help="rounds of every target (default 3)")
    targets = ",".join(TARGETS)
    add("--targets", type=target_list, default=list(TARGETS), help=f"comma list of {targets} (default all)")
    add("--limit", type=positive_int, default=20, help="requests per hour of the descriptor (default 20)")
    add("--calls", type=positive_int, default=300, help="calls of the burst, across replicas (default 300)")
    add("--in-flight", type=positive_int, default=32, help="calls in flight per replica (default 32)")
    add("--replicas", type=positive_int, default=3, help="replicas of each target (default 3)")
    add("--deadline-ms", type=positive_int, default=25, help="gRPC deadline of every call, ms (default 25)")
    add("--json", metavar="PATH", help="also write the figures as JSON")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    arguments = build_parser().parse_args(argv)
    if arguments.calls < arguments.replicas:
        raise SystemExit("deadline_burst: --calls must be at least --replicas")
    return run_cli("deadline_burst", functools.partial(run, arguments), (signal.SIGINT, signal.SIGTERM, signal.SIGHUP))


if __name__ == "__main__":
    sys.exit(main())
