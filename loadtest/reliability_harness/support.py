"""Pieces the reliability scenarios share: children, metrics, memory, requests, rows.

It re-exports what the scenarios use from ``stack`` and ``loadtest.common``; each scenario
also runs alone as ``python -m loadtest.reliability_harness.<name>`` from the checkout.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
import traceback
from array import array
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from loadtest.accuracy_harness.redis_watch import parse_key
from loadtest.common import METHOD, cpu_seconds, overall_code, percentile, proc_status
from loadtest.common import scrape_metrics as scrape
from loadtest.reliability_harness import Context, Row
from sidecar.service.wire import length_delimited, varint
from stack import redis as stack_redis
from stack.processes import Child, ChildT, ProcessGroup, StartError, free_port, process_group, spawn
from stack.redis import REDIS_SERVER, RedisProcess
from stack.sidecar import SidecarProcess

HERE = Path(__file__).resolve().parent
LOADTEST = HERE.parent
REPO = LOADTEST.parent

__all__ = [
    "CHANNEL_OPTIONS",
    "METHOD",
    "REDIS_SERVER",
    "Child",
    "Context",
    "ProcessGroup",
    "RedisProcess",
    "Row",
    "SidecarProcess",
    "StartError",
    "cpu_seconds",
    "encode_request",
    "failed_row",
    "free_port",
    "overall_code",
    "percentile",
    "proc_status",
    "process_group",
    "scrape",
]

OK = 1
OVER_LIMIT = 2
CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 20),
    ("grpc.min_reconnect_backoff_ms", 20),
    ("grpc.max_reconnect_backoff_ms", 100),
]
MIB = 1024 * 1024
CONNECT_TIMEOUT = 5.0
"""Seconds :func:`drive` waits for its channels to connect, whatever the calls' deadline."""


# ---------------------------------------------------------------------------------
# Requests, encoded by hand: building a million protobuf descriptors costs seconds
# ---------------------------------------------------------------------------------


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field (the sidecar's own varints: the same bytes protobuf writes)."""
    return length_delimited(varint(number << 3 | 2), payload)


def encode_descriptor(entries: Sequence[tuple[str, str]]) -> bytes:
    """A ``RateLimitDescriptor`` (field 1: entries of ``key`` = 1, ``value`` = 2)."""
    return b"".join(_field(1, _field(1, key.encode()) + _field(2, value.encode())) for key, value in entries)


def encode_request(domain: str, descriptors: Iterable[Sequence[tuple[str, str]]], hits: int = 0) -> bytes:
    """A serialized ``RateLimitRequest``: ``domain`` (1), ``descriptors`` (2), ``hits_addend`` (3)."""
    body = _field(1, domain.encode()) + b"".join(_field(2, encode_descriptor(entries)) for entries in descriptors)
    if hits:
        body += varint(3 << 3) + varint(hits)
    return body


def check_encoding() -> None:
    """The hand encoding parses to what protobuf would build (a guard against typos)."""
    from sidecar.protos.envoy.service.ratelimit.v3 import rls_pb2

    parsed = rls_pb2.RateLimitRequest.FromString(encode_request("d", [[("k", "v"), ("a", "b" * 300)], [("x", "")]], 7))
    assert parsed.domain == "d" and parsed.hits_addend == 7, parsed
    assert [[(e.key, e.value) for e in d.entries] for d in parsed.descriptors] == [
        [("k", "v"), ("a", "b" * 300)],
        [("x", "")],
    ], parsed


# ---------------------------------------------------------------------------------
# Children
# ---------------------------------------------------------------------------------


def pin(child: ChildT, cpus: tuple[int, ...] | None) -> ChildT:
    """Run ``child`` under ``taskset`` on ``cpus`` (no-op without cpus or taskset)."""
    taskset = shutil.which("taskset")
    if cpus and taskset:
        child.argv = [taskset, "-c", ",".join(map(str, cpus)), *child.argv]
    return child


def start_sidecar(
    group: ProcessGroup,
    context: Context,
    name: str,
    serve_args: Sequence[str],
    directory: Path | None = None,
) -> SidecarProcess:
    """A real ``python -m sidecar serve`` process, SERVING, with its metrics endpoint."""
    return group.start_ready(sidecar_build(context, name, serve_args, directory))


def sidecar_build(
    context: Context, name: str, serve_args: Sequence[str], directory: Path | None = None
) -> Callable[[], SidecarProcess]:
    """What :func:`start_sidecar` starts, as a build for ``ProcessGroup.start_all_ready``
    (several sidecars coming up at once)."""
    where = directory or context.directory

    def build() -> SidecarProcess:
        child = SidecarProcess(name, [*serve_args, "--log-format", "json"], where)
        pin(child, context.server_cpus)
        return child

    return build


@contextlib.contextmanager
def client_cpus(cpus: tuple[int, ...] | None) -> Any:
    """Pin this process (the load generator) to ``cpus`` meanwhile."""
    if not cpus or not hasattr(os, "sched_getaffinity"):
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


class ProxyProcess(Child):
    """``tcp_proxy.py`` in front of ``upstream_port``: commands on stdin, answers on stdout."""

    ready_sign = "ready"

    def __init__(self, directory: Path, upstream_port: int, port: int = 0) -> None:
        self.port = port or free_port()
        argv = [
            sys.executable,
            str(HERE / "tcp_proxy.py"),
            "--listen-port",
            str(self.port),
            "--upstream-port",
            str(upstream_port),
        ]
        super().__init__("proxy", argv, directory / "proxy.log")
        self.started = False

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.process = spawn(self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=self.env)

    def ready(self) -> bool:
        if not self.started:
            assert self.process is not None and self.process.stdout is not None
            line = self.process.stdout.readline().decode()
            self.started = line.startswith("ready")
        return self.started

    def command(self, line: str) -> None:
        """Send one command; returns once the proxy says it is in effect."""
        assert self.process is not None and self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(line.encode() + b"\n")
        self.process.stdin.flush()
        answer = self.process.stdout.readline().decode().strip()
        if answer != f"ok {line}":
            raise RuntimeError(f"proxy answered {answer!r} to {line!r}")

    def stop(self, timeout: float = 5.0) -> int | None:
        if self.process is not None and self.process.poll() is None and self.process.stdin is not None:
            with contextlib.suppress(OSError):
                self.process.stdin.close()  # EOF: the proxy stops by itself
        return super().stop(timeout)


def redis_available() -> bool:
    return stack_redis.available()


def redis_command(port: int, *words: str | bytes | int, timeout: float = 5.0) -> Any:
    """One command over a raw socket (RESP); returns the decoded reply (errors raised)."""
    import redis

    with redis.Redis(host="127.0.0.1", port=port, socket_timeout=timeout) as client:
        return client.execute_command(*words)


def redis_client(port: int, timeout: float = 10.0) -> Any:
    import redis

    return redis.Redis(host="127.0.0.1", port=port, socket_timeout=timeout, decode_responses=True)


class CounterNames:
    """Redis digests of descriptors, computed as the sidecar does: the rule's counter key
    from the match tree (``sidecar.config.match_descriptor``), hashed by ``sidecar.limiter.redis.keys``."""

    def __init__(self, config_dir: Path, domain: str) -> None:
        from sidecar.config import load_config
        from sidecar.protos.envoy.extensions.common.ratelimit.v3 import ratelimit_pb2

        self.domain = load_config(str(config_dir)).domains[domain]
        self.entry = ratelimit_pb2.RateLimitDescriptor.Entry

    def digest(self, entries: Sequence[tuple[str, str]]) -> str:
        from sidecar.config import match_descriptor
        from sidecar.limiter.redis.keys import counter_digest

        match = match_descriptor(self.domain, [self.entry(key=key, value=value) for key, value in entries])
        if match is None:
            raise ValueError(f"no rule matches {entries!r}")
        return counter_digest(tuple(match.key))


def redis_counts(port: int, prefix: str) -> dict[str, int]:
    """Counter digest -> hits Redis holds, summed over every window key under ``prefix``
    (flush markers ``...:flushed:<replica>`` and the replica set are skipped)."""
    client = redis_client(port)
    counts: dict[str, int] = {}
    batch: list[str] = []

    def read() -> None:
        if batch:
            for key, value in zip(batch, client.mget(batch), strict=True):
                parsed = parse_key(key)
                if parsed is not None and value is not None:
                    counts[parsed[0]] = counts.get(parsed[0], 0) + int(value)
            batch.clear()

    for key in client.scan_iter(match=f"{prefix}:{{*}}:*", count=5000):
        if parse_key(key) is not None:
            batch.append(key)
        if len(batch) >= 5000:
            read()
    read()
    return counts


def compare_counts(expected: dict[str, int], held: dict[str, int]) -> tuple[int, int, int]:
    """``(lost, extra, counters wrong)``: admitted hits Redis lacks, hits it holds beyond them."""
    lost = extra = wrong = 0
    for digest in expected.keys() | held.keys():
        difference = expected.get(digest, 0) - held.get(digest, 0)
        if difference:
            wrong += 1
            if difference > 0:
                lost += difference
            else:
                extra -= difference
    return lost, extra, wrong


# ---------------------------------------------------------------------------------
# Measurements
# ---------------------------------------------------------------------------------


def rss(pid: int) -> int:
    return proc_status(pid, "VmRSS") or 0


def tree_rss(pid: int) -> int:
    """RSS of ``pid`` and its children: a sidecar's whole footprint, its quota worker included."""
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        children = []
    return rss(pid) + sum(rss(int(child)) for child in children)


def core_busy_seconds() -> dict[int, float]:
    """Busy seconds of each core since boot (``grpc_bench``'s reading of /proc/stat)."""
    from loadtest.grpc_bench import drive

    return dict(drive.core_busy_seconds())


@dataclass
class CpuWatch:
    """CPU used by processes other than ``pids`` (and this one), sampled over time.

    On a 2-core machine another busy process turns any latency figure into noise; the
    scenarios say when that happened instead of blaming the sidecar for it.
    """

    pids: Sequence[int]
    samples: list[tuple[float, float, float]] = field(default_factory=list)
    """``(perf_counter, busy seconds of all cores, CPU seconds of ours)``."""

    def sample(self) -> None:
        ours = sum(cpu_seconds(pid) or 0.0 for pid in (*self.pids, os.getpid()))
        self.samples.append((time.perf_counter(), sum(core_busy_seconds().values()), ours))

    def other_cores(self, start: float, end: float) -> float:
        """Cores used by others between ``start`` and ``end`` (from the samples around them)."""
        before = [item for item in self.samples if item[0] <= start] or self.samples[:1]
        after = [item for item in self.samples if item[0] >= end] or self.samples[-1:]
        if not before or not after or after[-1][0] <= before[-1][0]:
            return 0.0
        first, last = before[-1], after[0]
        span = max(1e-3, last[0] - first[0])
        return max(0.0, (last[1] - first[1]) - (last[2] - first[2])) / span


DECISION = "ratelimit_sidecar_decision_seconds_bucket"


def decision_buckets(figures: dict[str, float]) -> dict[float, float]:
    """The sidecar's decision-time histogram (cumulative counts by upper bound, ``inf`` last)."""
    buckets = {}
    for name, value in figures.items():
        if name.startswith(DECISION + "{"):
            bound = name.split('le="', 1)[1].split('"', 1)[0]
            buckets[float(bound)] = value
    return buckets


def bucket_quantile(buckets: dict[float, float], fraction: float) -> float:
    """Upper bound of the bucket holding the ``fraction`` quantile (``inf`` when beyond the last bound)."""
    total = buckets.get(float("inf"), 0.0)
    for bound in sorted(buckets):
        if buckets[bound] >= fraction * total:
            return bound
    return float("inf")


def wait_for(predicate: Callable[[], bool], timeout: float, step: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(OSError):
            if predicate():
                return True
        if time.monotonic() > deadline:
            return False
        time.sleep(step)


def ms(seconds: float) -> float:
    return round(seconds * 1000, 2)


def latency_figures(latencies: Sequence[float], prefix: str = "") -> dict[str, float]:
    ordered = sorted(latencies)
    return {
        f"{prefix}p50_ms": ms(percentile(ordered, 0.50)),
        f"{prefix}p99_ms": ms(percentile(ordered, 0.99)),
        f"{prefix}max_ms": ms(ordered[-1] if ordered else 0.0),
    }


def seconds_left_in_window(unit_seconds: int, now: float | None = None) -> float:
    moment = time.time() if now is None else now
    return unit_seconds - moment % unit_seconds


def avoid_window_end(unit_seconds: int, needed: float) -> None:
    """Sleep past the next window boundary if fewer than ``needed`` seconds are left:
    the scenario's counters must live in one window (their Redis keys expire 5 s after it)."""
    left = seconds_left_in_window(unit_seconds)
    if left < needed:
        time.sleep(left + 0.05)


def tcp_refused(port: int) -> bool:
    with socket.socket() as probe:
        probe.settimeout(0.5)
        return probe.connect_ex(("127.0.0.1", port)) != 0


# ---------------------------------------------------------------------------------
# Rows
# ---------------------------------------------------------------------------------


def failed_row(area: str, scenario: str, error: BaseException, children: Sequence[Child] = ()) -> Row:
    """A row for a scenario that raised: the error, where, and the tail of each child's log."""
    where = traceback.extract_tb(error.__traceback__)[-1] if error.__traceback__ else None
    at = f" at {Path(where.filename).name}:{where.lineno}" if where else ""
    tails = "; ".join(f"{child.label}: {child.log_tail(3)!r}" for child in children if child.log_tail(3))
    notes = f"{type(error).__name__}: {error}{at}" + (f" | logs: {tails}" if tails else "")
    return Row(area, scenario, ok=False, notes=notes[:2000])


def skipped_row(area: str, scenario: str, why: str) -> Row:
    return Row(area, scenario, ok=None, notes=why)


def print_rows(rows: Sequence[Row]) -> None:
    """Standalone runs: one block per row."""
    for row in rows:
        verdict = {True: "ok", False: "FAILED", None: "not run"}[row.ok]
        print(f"[{verdict}] {row.area} / {row.scenario}")
        if row.load:
            print(f"    load: {row.load}")
        if row.hits_lost is not None:
            print(f"    hits_lost: {row.hits_lost}")
        if row.notes:
            print(f"    notes: {row.notes}")
        if row.figures:
            print("    figures: " + ", ".join(f"{key}={value:g}" for key, value in row.figures.items()))


def main(
    run: Callable[[Context], list[Row]], argv: Sequence[str] | None = None, flags: Mapping[str, str] | None = None
) -> int:
    """``python -m loadtest.reliability_harness.<module> [--full | --smoke] [--directory DIR]``,
    plus the area's own ``flags`` (name -> help), each a switch that lands in ``Context.flags``."""
    import argparse
    import tempfile

    parser = argparse.ArgumentParser()
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--full", action="store_true", help="full size (default: quick)")
    size.add_argument("--smoke", action="store_true", help="the tests' size: smaller than quick, same checks")
    parser.add_argument("--directory", type=Path, help="where logs go (default: a temporary directory)")
    for name, text in (flags or {}).items():
        parser.add_argument(f"--{name}", action="store_true", help=text)
    arguments = parser.parse_args(argv)
    chosen = frozenset(name for name in flags or {} if getattr(arguments, name.replace("-", "_")))
    with contextlib.ExitStack() as stack:
        directory = arguments.directory or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="reliab-")))
        directory.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        rows = run(Context(directory, quick=not arguments.full, smoke=arguments.smoke, flags=chosen))
        print_rows(rows)
        print(f"{len(rows)} rows in {time.monotonic() - started:.1f} s; logs in {directory}")
    return 0 if all(row.ok is not False for row in rows) else 1


# ---------------------------------------------------------------------------------
# Load: lanes of gRPC calls over grpc.aio, open loop (paced) or closed loop
# ---------------------------------------------------------------------------------

CODE_ERROR = -1


@dataclass
class Calls:
    """Every call of a run, index-aligned arrays (times in ``perf_counter`` seconds)."""

    target: array[int] = field(default_factory=lambda: array("b"))
    payload: array[int] = field(default_factory=lambda: array("i"))
    sent: array[float] = field(default_factory=lambda: array("d"))
    latency: array[float] = field(default_factory=lambda: array("d"))
    code: array[int] = field(default_factory=lambda: array("b"))
    errors: dict[int, str] = field(default_factory=dict)
    missed_slots: int = 0
    """Open loop: send slots skipped because the lane's previous call was still running."""

    def add(self, target: int, payload: int, sent: float, latency: float, code: int) -> None:
        self.target.append(target)
        self.payload.append(payload)
        self.sent.append(sent)
        self.latency.append(latency)
        self.code.append(code)

    def __len__(self) -> int:
        return len(self.sent)

    def error_counts(self, indices: Iterable[int] | None = None) -> dict[str, int]:
        wanted = None if indices is None else set(indices)
        counts: dict[str, int] = {}
        for index, name in self.errors.items():
            if wanted is None or index in wanted:
                counts[name] = counts.get(name, 0) + 1
        return counts


Chooser = Callable[[], tuple[int, int]]
"""Picks the next call: ``(target index, payload index)``."""


async def drive(
    addresses: Sequence[str],
    payloads: Sequence[bytes],
    choose: Chooser,
    calls: Calls,
    *,
    seconds: float,
    lanes: int,
    rate: float = 0.0,
    timeout: float = 5.0,
    stop: asyncio.Event | None = None,
) -> None:
    """``lanes`` coroutines calling ``ShouldRateLimit`` until ``seconds`` have passed (or ``stop``).

    ``rate`` 0: closed loop, each lane back to back. Otherwise open loop: each lane sends
    at most one call every ``lanes / rate`` seconds, so the offered load is ``rate``; a
    slot missed because the lane's previous call was still running is skipped and counted.
    One channel (one HTTP/2 connection) per address, as Envoy keeps per worker.
    """
    channels = [grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) for address in addresses]
    try:
        methods = [channel.unary_unary(METHOD) for channel in channels]
        # Connected before the first call: CHANNEL_OPTIONS' 20 ms minimum backoff is also gRPC's
        # minimum connect timeout, so on a busy machine a first attempt can fail and fail-fast calls
        # would get UNAVAILABLE; channel_ready retries until the connection is up. Connecting is
        # not a call: it gets CONNECT_TIMEOUT even when the calls' deadline is Envoy's 25 ms.
        connected = asyncio.gather(*(channel.channel_ready() for channel in channels))
        await asyncio.wait_for(connected, max(timeout, CONNECT_TIMEOUT))
        perf = time.perf_counter
        start = perf()
        end = start + seconds
        interval = lanes / rate if rate else 0.0

        async def lane(number: int) -> None:
            slot = start + interval * number / lanes
            while stop is None or not stop.is_set():
                if interval:
                    now = perf()
                    if slot > now:
                        await asyncio.sleep(slot - now)
                    elif now - slot > interval:
                        skipped = int((now - slot) / interval)
                        calls.missed_slots += skipped
                        slot += skipped * interval
                    slot += interval
                sent = perf()
                if sent >= end:
                    return
                target, index = choose()
                try:
                    answer = await methods[target](payloads[index], timeout=timeout)
                except grpc.aio.AioRpcError as error:
                    calls.errors[len(calls)] = error.code().name
                    calls.add(target, index, sent, perf() - sent, CODE_ERROR)
                    continue
                calls.add(target, index, sent, perf() - sent, overall_code(answer))

        await asyncio.gather(*(lane(number) for number in range(lanes)))
    finally:
        for channel in channels:
            await channel.close()
