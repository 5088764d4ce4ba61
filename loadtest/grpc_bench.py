"""gRPC load benchmark for the sidecar's ``ShouldRateLimit``.

Three subcommands, each bounded in time and request count and stopping by itself:

``run``
    Drive a running server (``--target HOST:PORT``, loopback only) with
    ``--concurrency`` calls in flight for ``--duration`` seconds (and at most
    ``--max-requests``), from one or more load-generator processes, and print
    requests/s, latency percentiles, errors by gRPC status and OK / OVER_LIMIT counts.
    ``--server-pid`` adds the server's CPU use; ``--rate`` offers a fixed load instead
    of running flat out, to compare latencies at equal load.
``compare``
    Start a bare servicer (``loadtest/bare_servicer.py``: same stack, does nothing)
    and the real sidecar with the example config (memory backend), each on a free
    127.0.0.1 port; pin both servers to one core and the load generator to the
    others (on 2 cores: servers on cpu 0, generator on cpu 1; ``--no-pin`` to
    disable); run the same request mix against each alternately for ``--rounds``
    rounds and print medians, the sidecar/bare ratios and the goal verdict
    (throughput ratio >= 0.85). ``--calibrate-us`` and ``--partial`` add bare
    servicers that burn a known CPU time or do part of the sidecar's work, to split
    its cost under real load. Every child process is stopped at the end, also on
    Ctrl-C, SIGTERM or error.
``inproc``
    CPU cost per call of ``RateLimitService.answer`` and of the other steps of the
    request path, in this process, without gRPC; ``--profile N`` adds a cProfile table,
    ``--response-headers`` prices the sidecar's ``--response-headers``.

Examples::

    python -m loadtest.grpc_bench compare --duration 5 --concurrency 32 --rounds 3
    python -m loadtest.grpc_bench run --target 127.0.0.1:8081 --duration 10 --pattern mixed
    python -m loadtest.grpc_bench inproc --pattern mixed --calls 100000

Reading the figures. Each run reports the server's CPU per call ("srv us/call"),
the generator's CPU ("gen cpu", in cores) and what everything else on the machine
used meanwhile ("other cpu"). When "srv cpu" is near 1.0 and "gen cpu" well below
its cores, the server is the bottleneck, as it should be. On a shared, small
machine other load comes and goes: ``compare`` waits for a quiet second before
each run and redoes runs disturbed by other load (``--quiet-*``,
``--redo-disturbed``), flags what remains, and also gives the throughput ratio
implied by server CPU per call, which other load disturbs least. Compare ratios
from one ``compare`` run, not absolute figures from different runs. Every report
starts with the exact command line that reproduces it, the core count and the
Python / grpcio / protobuf / uvloop versions.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import importlib.metadata
import json
import multiprocessing.connection
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc
from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from envoy.service.ratelimit.v3 import rls_pb2

from loadtest.common import (
    METHOD,
    Worker,
    cpu_seconds,
    free_port,
    health_serving,
    machine_facts,
    overall_code,
    parse_cpus,
    percentile,
    positive_int,
    reproduce_command,
    run_cli,
    run_worker,
    start_child,
    start_worker,
    stop_workers,
    worker_answer,
)

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
DEFAULT_CONFIG = REPO / "examples" / "config"
DOMAIN = "demo"
PATTERNS = ("under", "over", "mixed")
CODE_NAMES = {0: "UNKNOWN", 1: "OK", 2: "OVER_LIMIT"}
SATURATED_CPU = 0.9
"""A load-generator core busier than this may be the bottleneck: the report says so."""
GOAL_RATIO = 0.85

# ---------------------------------------------------------------------------------
# Request mix: Envoy-like requests for the "demo" domain of examples/config/demo.yaml
# ---------------------------------------------------------------------------------

Descriptor = list[tuple[str, str]]
Kind = Callable[[random.Random, str], list[Descriptor]]


def _ip(rng: random.Random) -> str:
    """One of ~16M client addresses: each is seen rarely, so it stays under 20/s."""
    return f"10.{rng.randrange(256)}.{rng.randrange(256)}.{rng.randrange(1, 255)}"


def _key(rng: random.Random, salt: str) -> str:
    """An API key unique to this run (``salt``), so earlier runs' counters do not leak in."""
    return f"k{salt}-{rng.randrange(1_000_000_000)}"


def page(rng: random.Random, salt: str) -> list[Descriptor]:
    """Any route: the client address (20/s per address)."""
    return [[("remote_address", _ip(rng))]]


def hot_page(rng: random.Random, salt: str) -> list[Descriptor]:
    """A handful of noisy addresses: over 20/s each at any real load."""
    return [[("remote_address", f"192.0.2.{rng.randrange(1, 5)}")]]


def api(rng: random.Random, salt: str) -> list[Descriptor]:
    """/api with an ordinary key: address, route-wide cap (50/s shared), key (10/min)."""
    return [
        [("remote_address", _ip(rng))],
        [("generic_key", "api")],
        [("generic_key", "api"), ("api_key", _key(rng, salt))],
    ]


def api_premium(rng: random.Random, salt: str) -> list[Descriptor]:
    """/api with a premium key (100/min), which replaces the route-wide cap."""
    return [
        [("remote_address", _ip(rng))],
        [("generic_key", "api")],
        [("generic_key", "api"), ("api_key", "premium-" + _key(rng, salt))],
    ]


def api_monitoring(rng: random.Random, salt: str) -> list[Descriptor]:
    """/api with the unlimited monitoring key; the route-wide cap still applies."""
    return [
        [("generic_key", "api")],
        [("generic_key", "api"), ("api_key", "internal-monitoring")],
    ]


def write(rng: random.Random, salt: str) -> list[Descriptor]:
    """A write: address plus the global write cap (5/s)."""
    return [[("remote_address", _ip(rng))], [("header_match", "write")]]


def login(rng: random.Random, salt: str) -> list[Descriptor]:
    """A login attempt: address, and the shadow-mode login limit (counted, never refused)."""
    address = _ip(rng)
    return [[("remote_address", address)], [("generic_key", "login"), ("remote_address", address)]]


def api_few_keys(rng: random.Random, salt: str) -> list[Descriptor]:
    """/api from four keys only: over 10/min per key and 50/s per route within a second."""
    return [
        [("remote_address", f"192.0.2.{rng.randrange(1, 5)}")],
        [("generic_key", "api")],
        [("generic_key", "api"), ("api_key", f"k{salt}-hot-{rng.randrange(4)}")],
    ]


MIXES: dict[str, list[tuple[Kind, int]]] = {
    # Every counter stays far below its limit: all OK.
    "under": [(page, 50), (api_premium, 35), (login, 15)],
    # Few distinct values: after the first hits of each window nearly all OVER_LIMIT.
    "over": [(hot_page, 30), (api_few_keys, 40), (write, 30)],
    # Realistic: most traffic under its limits, a few noisy sources and capped routes over.
    "mixed": [
        (page, 55),
        (hot_page, 3),
        (api_premium, 15),
        (api, 8),
        (login, 13),
        (write, 3),
        (api_monitoring, 3),
    ],
}


def build_request(descriptors: Sequence[Descriptor]) -> Any:
    """A ``RateLimitRequest`` for the demo domain, as Envoy's filter sends it."""
    entry = ratelimit_pb2.RateLimitDescriptor.Entry
    return rls_pb2.RateLimitRequest(
        domain=DOMAIN,
        descriptors=[
            ratelimit_pb2.RateLimitDescriptor(entries=[entry(key=k, value=v) for k, v in d]) for d in descriptors
        ],
    )


def request_pool(pattern: str, size: int, seed: int, salt: str) -> list[Any]:
    """``size`` requests of ``pattern``, in a random order fixed by ``seed``."""
    rng = random.Random(seed)
    kinds = [kind for kind, _ in MIXES[pattern]]
    weights = [weight for _, weight in MIXES[pattern]]
    return [build_request(kind(rng, salt)) for kind in rng.choices(kinds, weights=weights, k=size)]


# ---------------------------------------------------------------------------------
# Load-generator worker (one process each; started with the "spawn" method)
# ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerSpec:
    """Everything one load-generator process needs; picklable."""

    target: str
    lanes: int
    channels: int
    pattern: str
    pool_size: int
    seed: int
    salt: str
    timeout: float
    budget: int
    cpus: tuple[int, ...] | None
    interval: float
    """Seconds between two calls of one lane (concurrency / --rate); 0 for closed loop."""


@dataclass
class Tally:
    """What one worker saw in the measured window."""

    remaining: int
    latencies: list[float] = field(default_factory=list)
    codes: dict[int, int] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)
    last_end: float = 0.0


async def _lane(
    call: Any,
    pool: Sequence[bytes],
    index: int,
    tally: Tally,
    *,
    measure_start: float,
    end: float,
    timeout: float,
    interval: float,
    first_slot: float,
) -> None:
    """One in-flight call at a time until ``end`` or the budget is spent.

    Back to back when ``interval`` is 0 (closed loop: the server sets the pace);
    otherwise one call every ``interval`` seconds at most, starting at ``first_slot``
    (a slot missed because the previous call was slow is skipped, not made up).
    """
    perf = time.perf_counter
    size = len(pool)
    latencies = tally.latencies
    codes = tally.codes
    slot = first_slot
    while tally.remaining > 0:
        if interval:
            now = perf()
            if slot > now:
                await asyncio.sleep(slot - now)
            slot = max(slot + interval, now)
        started = perf()
        if started >= end:
            return
        measured = started >= measure_start
        if measured:
            tally.remaining -= 1
        request = pool[index]
        index = index + 1 if index + 1 < size else 0
        try:
            response = await call(request, timeout=timeout)
        except grpc.aio.AioRpcError as error:
            if measured:
                name = error.code().name
                tally.errors[name] = tally.errors.get(name, 0) + 1
                tally.last_end = perf()
            continue
        if measured:
            finished = perf()
            latencies.append(finished - started)
            code = overall_code(response)
            codes[code] = codes.get(code, 0) + 1
            tally.last_end = finished


async def _drive(spec: WorkerSpec, conn: multiprocessing.connection.Connection) -> None:
    pool = [request.SerializeToString() for request in request_pool(spec.pattern, spec.pool_size, spec.seed, spec.salt)]
    options = [("grpc.use_local_subchannel_pool", 1)] if spec.channels > 1 else []
    channels = [grpc.aio.insecure_channel(spec.target, options=options) for _ in range(spec.channels)]
    try:
        calls = [channel.unary_unary(METHOD) for channel in channels]
        for channel, call in zip(channels, calls, strict=True):
            await asyncio.wait_for(channel.channel_ready(), timeout=10)
            response = await call(pool[0], timeout=5)
            parsed = rls_pb2.RateLimitResponse.FromString(response)
            if parsed.overall_code != overall_code(response):
                raise RuntimeError("response encoding not as expected: fix overall_code()")
        conn.send(("ready", os.getpid()))
        if not conn.poll(60):
            return
        message = conn.recv()
        if message[0] != "go":
            return
        _, go_wall, measure_wall, end_wall = message
        offset = time.time() - time.perf_counter()
        measure_start, end = measure_wall - offset, end_wall - offset
        await asyncio.sleep(max(0.0, go_wall - time.time()))
        tally = Tally(remaining=spec.budget)
        step = max(1, len(pool) // spec.lanes)
        start = time.perf_counter()
        await asyncio.gather(
            *(
                _lane(
                    calls[lane % len(calls)],
                    pool,
                    (lane * step) % len(pool),
                    tally,
                    measure_start=measure_start,
                    end=end,
                    timeout=spec.timeout,
                    interval=spec.interval,
                    first_slot=start + spec.interval * random.random(),
                )
                for lane in range(spec.lanes)
            )
        )
        conn.send(
            (
                "result",
                {
                    "latencies": array("d", tally.latencies).tobytes(),
                    "codes": tally.codes,
                    "errors": tally.errors,
                    "elapsed": max(0.0, tally.last_end - measure_start),
                },
            )
        )
    finally:
        for channel in channels:
            await channel.close()


def worker_main(spec: WorkerSpec, conn: multiprocessing.connection.Connection) -> None:
    """Entry point of a load-generator process."""
    run_worker(_drive, spec, conn)


# ---------------------------------------------------------------------------------
# Measuring a run
# ---------------------------------------------------------------------------------


@dataclass
class RunResult:
    """Figures of one measured run against one target."""

    label: str
    requests: int
    elapsed: float
    rps: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    max_ms: float
    ok: int
    over_limit: int
    other_codes: dict[str, int]
    errors: dict[str, int]
    client_cpu: float
    """Load-generator CPU, in cores (1.0 = one core fully busy), summed over processes."""
    server_cpu: float | None
    """Server CPU in cores, when its pid is known."""
    server_us_per_call: float | None
    """Server CPU time per call: the least noisy cost figure."""
    other_cpu: float
    """CPU used by anything else on the machine during the window, in cores."""
    server_cores_busy: float | None
    """Busy share of the server's pinned cores, whoever used them."""


@dataclass(frozen=True)
class LoadOptions:
    """The load shape shared by ``run`` and ``compare``."""

    concurrency: int
    duration: float
    warmup: float
    max_requests: int
    processes: int
    channels: int
    pattern: str
    pool_size: int
    timeout: float
    seed: int
    rate: float


def split(total: int, parts: int) -> list[int]:
    """``total`` spread over ``parts`` as evenly as possible."""
    return [total // parts + (1 if index < total % parts else 0) for index in range(parts)]


def run_load(
    label: str,
    target: str,
    load: LoadOptions,
    *,
    run_seed: int,
    client_cpus: tuple[int, ...] | None,
    server_pid: int | None,
    server_cpus: tuple[int, ...] | None = None,
) -> RunResult:
    """One measured run: start the workers, go, collect, and always stop them."""
    processes = min(load.processes, load.concurrency)
    workers: list[Worker] = []
    try:
        for index, (lanes, budget) in enumerate(
            zip(split(load.concurrency, processes), split(load.max_requests, processes), strict=True)
        ):
            spec = WorkerSpec(
                target=target,
                lanes=lanes,
                channels=min(load.channels, lanes),
                pattern=load.pattern,
                pool_size=load.pool_size,
                seed=run_seed * 1000 + index,
                salt=f"{run_seed}.{index}",
                timeout=load.timeout,
                budget=budget,
                cpus=client_cpus,
                interval=load.concurrency / load.rate if load.rate else 0.0,
            )
            workers.append(start_worker(worker_main, spec))
        for _, conn in workers:
            _expect(conn, "ready", 60.0)
        return _measure(label, load, workers, server_pid, server_cpus)
    finally:
        stop_workers(workers, timeout=2)


def _expect(conn: multiprocessing.connection.Connection, kind: str, timeout: float) -> Any:
    if not conn.poll(timeout):
        raise RuntimeError(f"load generator sent no {kind!r} within {timeout:.0f} s")
    return worker_answer(conn.recv(), kind)


def _sleep_until(wall: float) -> None:
    time.sleep(max(0.0, wall - time.time()))


@dataclass(frozen=True)
class CpuSample:
    """CPU seconds used so far by the load generator, the server and each core."""

    at: float
    client: float
    server: float | None
    cores: dict[int, float]


def core_busy_seconds() -> dict[int, float]:
    """Busy (not idle, not iowait) seconds of each core since boot, from /proc/stat."""
    tick = os.sysconf("SC_CLK_TCK")
    busy: dict[int, float] = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/stat").read_text().splitlines():
            name, *values = line.split()
            if name.startswith("cpu") and name[3:].isdigit():
                ticks = [int(value) for value in values]
                busy[int(name[3:])] = (sum(ticks[:8]) - ticks[3] - ticks[4]) / tick
    return busy


def cpu_sample(worker_pids: Sequence[int], server_pid: int | None) -> CpuSample:
    return CpuSample(
        at=time.time(),
        client=sum(cpu_seconds(pid) or 0.0 for pid in worker_pids),
        server=cpu_seconds(server_pid) if server_pid else None,
        cores=core_busy_seconds(),
    )


@dataclass(frozen=True)
class CpuUse:
    """CPU over the measured window, in cores (1.0 = one core busy all the time)."""

    client: float
    server: float | None
    server_seconds: float | None
    other: float
    """Everything else on the machine: other processes, loopback TCP in softirq, steal."""
    server_cores_busy: float | None
    """How busy the server's own cores were, whoever used them (pinned runs only)."""


def cpu_use(before: CpuSample, after: CpuSample, server_cpus: tuple[int, ...] | None) -> CpuUse:
    window = max(1e-9, after.at - before.at)
    client = (after.client - before.client) / window
    server_seconds = None if after.server is None or before.server is None else after.server - before.server
    server = None if server_seconds is None else server_seconds / window
    total = sum(after.cores.get(cpu, 0.0) - busy for cpu, busy in before.cores.items()) / window
    cores_busy = None
    if server_cpus is not None:
        cores_busy = sum(after.cores.get(cpu, 0.0) - before.cores.get(cpu, 0.0) for cpu in server_cpus) / window
    return CpuUse(
        client=client,
        server=server,
        server_seconds=server_seconds,
        other=max(0.0, total - client - (server or 0.0)),
        server_cores_busy=cores_busy,
    )


def _measure(
    label: str,
    load: LoadOptions,
    workers: Sequence[Worker],
    server_pid: int | None,
    server_cpus: tuple[int, ...] | None,
) -> RunResult:
    go = time.time() + 0.05
    measure_start = go + load.warmup
    end = measure_start + load.duration
    for _, conn in workers:
        conn.send(("go", go, measure_start, end))
    worker_pids = [process.pid for process, _ in workers]
    _sleep_until(measure_start)
    before = cpu_sample(worker_pids, server_pid)
    # Sample CPU at the end of the window, or earlier if every worker spent its budget.
    pending = [conn for _, conn in workers]
    results: list[dict[str, Any]] = []
    after: CpuSample | None = None
    deadline = end + load.timeout + 15
    while pending:
        now = time.time()
        if after is None and now >= end:
            after = cpu_sample(worker_pids, server_pid)
        if now >= deadline:
            raise RuntimeError("load generator did not report in time")
        wait_for = (end if after is None else deadline) - now
        for ready in multiprocessing.connection.wait(pending, timeout=max(0.0, wait_for)):
            done = pending[pending.index(ready)]  # type: ignore[arg-type]
            results.append(_expect(done, "result", 1.0))
            pending.remove(done)
    if after is None:
        after = cpu_sample(worker_pids, server_pid)
    return summarize(label, results, cpu_use(before, after, server_cpus))


def summarize(label: str, results: Sequence[dict[str, Any]], cpu: CpuUse) -> RunResult:
    """Merge the workers' tallies into one :class:`RunResult`."""
    latencies = array("d")
    codes: dict[int, int] = {}
    errors: dict[str, int] = {}
    elapsed = 0.0
    for result in results:
        latencies.frombytes(result["latencies"])
        for code, count in result["codes"].items():
            codes[code] = codes.get(code, 0) + count
        for name, count in result["errors"].items():
            errors[name] = errors.get(name, 0) + count
        elapsed = max(elapsed, result["elapsed"])
    ordered = sorted(latencies)
    requests = len(ordered) + sum(errors.values())
    rps = requests / elapsed if elapsed else 0.0
    return RunResult(
        label=label,
        requests=requests,
        elapsed=round(elapsed, 3),
        rps=round(rps, 1),
        p50_ms=round(percentile(ordered, 0.50) * 1e3, 3),
        p90_ms=round(percentile(ordered, 0.90) * 1e3, 3),
        p99_ms=round(percentile(ordered, 0.99) * 1e3, 3),
        max_ms=round(ordered[-1] * 1e3 if ordered else 0.0, 3),
        ok=codes.get(1, 0),
        over_limit=codes.get(2, 0),
        other_codes={CODE_NAMES.get(code, str(code)): n for code, n in codes.items() if code not in (1, 2)},
        errors=errors,
        client_cpu=round(cpu.client, 3),
        server_cpu=None if cpu.server is None else round(cpu.server, 3),
        server_us_per_call=(
            round(cpu.server_seconds / requests * 1e6, 1) if cpu.server_seconds is not None and requests else None
        ),
        other_cpu=round(cpu.other, 3),
        server_cores_busy=None if cpu.server_cores_busy is None else round(cpu.server_cores_busy, 3),
    )


# ---------------------------------------------------------------------------------
# Servers started by "compare"
# ---------------------------------------------------------------------------------


class ServerProcess:
    """A server child on a free loopback port, its log in a temporary file."""

    def __init__(
        self,
        label: str,
        argv: Sequence[str],
        cpus: tuple[int, ...] | None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.label = label
        self.env = {**os.environ, **(env or {})}
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.argv = [*argv, "--grpc-address", self.address]
        self.cpus = cpus
        self.log = tempfile.NamedTemporaryFile(  # noqa: SIM115 - closed in stop()
            prefix=f"grpc_bench-{label}-", suffix=".log", delete=False
        )
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        # Pinned to self.cpus, SIGTERM if we die; its own session: Ctrl-C reaches us only.
        self.process = start_child(self.argv, self.log, env=self.env, cpus=self.cpus)

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Until the health service says SERVING; fail with the log tail otherwise."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.label} exited at start:\n{self.log_tail()}")
            if health_serving(self.address):
                self.pin_threads()
                return
            time.sleep(0.1)
        raise RuntimeError(f"{self.label} not SERVING after {timeout:.0f} s:\n{self.log_tail()}")

    def pin_threads(self) -> None:
        """Re-apply the pinning to every thread (they inherit it; this is a check)."""
        if self.cpus is None:
            return
        for task in Path(f"/proc/{self.pid}/task").iterdir():
            with contextlib.suppress(OSError):
                os.sched_setaffinity(int(task.name), self.cpus)

    def log_tail(self, lines: int = 20) -> str:
        self.log.flush()
        text = Path(self.log.name).read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 5 s; always reaps the child."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=5)
        self.log.close()

    def discard_log(self) -> None:
        with contextlib.suppress(OSError):
            Path(self.log.name).unlink()


# ---------------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------------


def code_version() -> str:
    """Commit of the checkout, and whether sidecar/ has uncommitted changes: what was measured."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=5, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "sidecar"],
            check=False,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{commit} + uncommitted changes in sidecar/" if dirty else commit


def environment(client_cpus: Any = None, server_cpus: Any = None) -> dict[str, Any]:
    """What the figures depend on: cores, CPU model, versions, pinning, load average."""
    import google.protobuf
    from google.protobuf.internal import api_implementation

    return {
        **machine_facts(),
        "usable_cores": sorted(os.sched_getaffinity(0)),
        "loadavg_at_start": os.getloadavg()[0],
        "protobuf": f"{google.protobuf.__version__} ({api_implementation.Type()})",
        "uvloop": importlib.metadata.version("uvloop"),
        "server_cpus": server_cpus,
        "client_cpus": client_cpus,
        "code": code_version(),
    }


def command_line(arguments: argparse.Namespace) -> str:
    """The command that reproduces the figures, every option spelled out."""
    words = ["python", "-m", "loadtest.grpc_bench", arguments.command]
    return reproduce_command(words, arguments, skip={"command", "handler", "json"})


def print_header(arguments: argparse.Namespace, env: dict[str, Any]) -> None:
    print(f"command: {command_line(arguments)}")
    print(
        f"machine: {env['cores']} cores ({env['cpu_model']}), load average {env['loadavg_at_start']:.2f}; "
        f"Python {env['python']}, grpcio {env['grpcio']}, protobuf {env['protobuf']}, "
        f"uvloop {env['uvloop']}"
    )
    print(f"pinning: server cpus {env['server_cpus']}, load generator cpus {env['client_cpus']}; code {env['code']}")


COLUMNS = (
    ("target", 8, "label"),
    ("req/s", 8, "rps"),
    ("p50 ms", 7, "p50_ms"),
    ("p90 ms", 7, "p90_ms"),
    ("p99 ms", 7, "p99_ms"),
    ("max ms", 7, "max_ms"),
    ("OK", 8, "ok"),
    ("OVER", 7, "over_limit"),
    ("errors", 6, "errors"),
    ("srv cpu", 7, "server_cpu"),
    ("srv us/call", 11, "server_us_per_call"),
    ("gen cpu", 7, "client_cpu"),
    ("other cpu", 9, "other_cpu"),
)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, dict):
        return str(sum(value.values()))
    if isinstance(value, float):
        return f"{value:.0f}" if abs(value) >= 1000 else f"{value:.3g}"
    return str(value)


def table(rows: Sequence[dict[str, Any]]) -> str:
    """Fixed-width table of result dicts, one line each."""
    header = " ".join(name.rjust(width) for name, width, _ in COLUMNS)
    lines = [header]
    for row in rows:
        lines.append(" ".join(_cell(row.get(key)).rjust(width) for _, width, key in COLUMNS))
    return "\n".join(lines)


def describe_errors(result: RunResult) -> str:
    parts = [f"{name}={count}" for name, count in sorted(result.errors.items())]
    parts += [f"code {name}={count}" for name, count in sorted(result.other_codes.items())]
    return ", ".join(parts)


def saturation_note(result: RunResult, client_cores: int) -> str | None:
    """Warn when the load generator, not the server, was probably the limit."""
    if result.client_cpu >= SATURATED_CPU * client_cores:
        server = "" if result.server_cpu is None else f" (server at {result.server_cpu:.2f} cores)"
        return (
            f"warning: load generator used {result.client_cpu:.2f} of its {client_cores} core(s)"
            f"{server}: it may be the bottleneck; add --processes or cores"
        )
    return None


def write_json(path: str, document: dict[str, Any]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(document, indent=2, sort_keys=True) + "\n")
    print(f"wrote {path}")


# ---------------------------------------------------------------------------------
# Subcommands
# ---------------------------------------------------------------------------------


def load_options(arguments: argparse.Namespace) -> LoadOptions:
    return LoadOptions(
        concurrency=arguments.concurrency,
        duration=arguments.duration,
        warmup=arguments.warmup,
        max_requests=arguments.max_requests,
        processes=arguments.processes,
        channels=arguments.channels,
        pattern=arguments.pattern,
        pool_size=arguments.pool_size,
        timeout=arguments.timeout,
        seed=arguments.seed,
        rate=arguments.rate,
    )


def cmd_run(arguments: argparse.Namespace) -> int:
    client_cpus = parse_cpus(arguments.client_cpus)
    env = environment(client_cpus=client_cpus, server_cpus=None)
    print_header(arguments, env)
    result = run_load(
        "target",
        arguments.target,
        load_options(arguments),
        run_seed=arguments.seed,
        client_cpus=client_cpus,
        server_pid=arguments.server_pid,
    )
    print(table([asdict(result)]))
    print(f"requests {result.requests} in {result.elapsed:.2f} s; {describe_errors(result)}")
    note = saturation_note(result, len(client_cpus or os.sched_getaffinity(0)))
    if note:
        print(note)
    if arguments.json:
        write_json(
            arguments.json,
            {"command": command_line(arguments), "environment": env, "result": asdict(result)},
        )
    return 0 if not result.errors else 1


def medians(results: Sequence[RunResult]) -> dict[str, Any]:
    """Median of every numeric figure across rounds; counts summed."""
    keys = ("rps", "p50_ms", "p90_ms", "p99_ms", "max_ms", "client_cpu", "other_cpu")
    row: dict[str, Any] = {key: statistics.median(getattr(r, key) for r in results) for key in keys}
    for key in ("server_cpu", "server_us_per_call", "server_cores_busy"):
        values = [getattr(r, key) for r in results if getattr(r, key) is not None]
        row[key] = statistics.median(values) if values else None
    row["ok"] = sum(r.ok for r in results)
    row["over_limit"] = sum(r.over_limit for r in results)
    errors: dict[str, int] = {}
    for result in results:
        for name, count in result.errors.items():
            errors[name] = errors.get(name, 0) + count
    row["errors"] = errors
    return row


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return round(numerator / denominator, 3)


def default_pinning(arguments: argparse.Namespace) -> tuple[Any, Any]:
    """Server on the first usable core, load generator on the others (2+ cores only)."""
    if arguments.no_pin:
        return None, None
    usable = sorted(os.sched_getaffinity(0))
    server = parse_cpus(arguments.server_cpus) or (tuple(usable[:1]) if len(usable) > 1 else None)
    client = parse_cpus(arguments.client_cpus) or (
        tuple(cpu for cpu in usable if cpu not in (server or ())) if server else None
    )
    return server, client or None


def config_path(text: str) -> str:
    """Absolute path of ``--config``: as given if it exists, else relative to the repo."""
    path = Path(text)
    return str(path.resolve() if path.exists() else REPO / path)


def compare_servers(arguments: argparse.Namespace, server_cpus: tuple[int, ...] | None) -> list[ServerProcess]:
    """The bare servicer, the sidecar, and any calibration servicers (``--calibrate-us``)."""
    bare_argv = [sys.executable, str(HERE / "bare_servicer.py"), "--max-seconds", "3600"]
    servers = [ServerProcess("bare", bare_argv, server_cpus)]
    # Only the flags the sidecar has always had; log level, format and drain time go
    # through RLS_* variables, which a sidecar without those settings ignores.
    servers.append(
        ServerProcess(
            "sidecar",
            [sys.executable, "-m", "sidecar", "serve", "--config", config_path(arguments.config)],
            server_cpus,
            env={
                "RLS_LOG_LEVEL": "warning",
                "RLS_LOG_FORMAT": "json",
                "RLS_SHUTDOWN_GRACE": "1",
                "RLS_METRICS_ADDRESS": "",  # its port may be taken; metrics are still recorded
            },
        )
    )
    for spin in parse_numbers(arguments.calibrate_us):
        servers.append(ServerProcess(f"spin{spin:g}", [*bare_argv, "--spin-us", f"{spin:g}"], server_cpus))
    for work in arguments.partial.split(",") if arguments.partial else []:
        argv = [*bare_argv, "--work", work, "--config", config_path(arguments.config)]
        servers.append(ServerProcess(f"b-{work}", argv, server_cpus))
    return servers


def machine_busy(seconds: float) -> float:
    """Cores busy over the next ``seconds`` (all processes, softirq and steal included)."""
    before = core_busy_seconds()
    time.sleep(seconds)
    after = core_busy_seconds()
    return sum(after.get(cpu, 0.0) - busy for cpu, busy in before.items()) / seconds


def wait_for_quiet(threshold: float, patience: float) -> float:
    """Wait (at most ``patience`` s) for a second in which the machine uses < ``threshold`` cores.

    Other sessions on a shared machine come and go; starting runs in a quiet second
    removes much of the noise. Returns the last busy figure measured.
    """
    deadline = time.monotonic() + patience
    busy = machine_busy(1.0)
    while busy >= threshold and time.monotonic() < deadline:
        busy = machine_busy(1.0)
    return busy


def parse_numbers(text: str | None) -> list[float]:
    return [float(part) for part in text.split(",") if part.strip()] if text else []


def measured_run(
    arguments: argparse.Namespace,
    server: ServerProcess,
    run_index: int,
    pinning: tuple[tuple[int, ...] | None, tuple[int, ...] | None],
) -> RunResult:
    """One run, redone (up to ``--redo-disturbed`` times) if other load disturbed it.

    Keeps the least disturbed attempt. A run counts as disturbed when everything
    else on the machine used more than ``--quiet-threshold`` cores during it.
    """
    server_cpus, client_cpus = pinning
    best: RunResult | None = None
    for attempt in range(1 + arguments.redo_disturbed):
        if arguments.quiet_wait > 0:
            busy = wait_for_quiet(arguments.quiet_threshold, arguments.quiet_wait)
            if busy >= arguments.quiet_threshold:
                print(f"         machine not quiet ({busy:.2f} cores busy before the run); running anyway")
        result = run_load(
            server.label,
            server.address,
            load_options(arguments),
            run_seed=arguments.seed + run_index * 100 + attempt,
            client_cpus=client_cpus,
            server_pid=server.pid,
            server_cpus=server_cpus,
        )
        if best is None or result.other_cpu < best.other_cpu:
            best = result
        if result.other_cpu <= arguments.quiet_threshold:
            break
        if attempt < arguments.redo_disturbed:
            print(f"         {server.label}: other load used {result.other_cpu:.2f} cores during the run; redoing it")
    assert best is not None
    return best


def run_rounds(
    arguments: argparse.Namespace,
    servers: Sequence[ServerProcess],
    pinning: tuple[tuple[int, ...] | None, tuple[int, ...] | None],
) -> dict[str, list[RunResult]]:
    """Every server once per round, the order alternating so that drift hits all alike."""
    results: dict[str, list[RunResult]] = {server.label: [] for server in servers}
    run_index = 0
    for round_index in range(arguments.rounds):
        for server in servers if round_index % 2 == 0 else servers[::-1]:
            run_index += 1
            result = measured_run(arguments, server, run_index, pinning)
            results[server.label].append(result)
            print(table([asdict(result)]).splitlines()[1] + f"   round {round_index + 1}")
            if result.errors or result.other_codes:
                print(f"         {describe_errors(result)}")
    return results


def cmd_compare(arguments: argparse.Namespace) -> int:
    server_cpus, client_cpus = default_pinning(arguments)
    env = environment(client_cpus=client_cpus, server_cpus=server_cpus)
    print_header(arguments, env)
    if client_cpus is not None:
        os.sched_setaffinity(0, client_cpus)  # this process mostly waits; keep it off the server
    servers = compare_servers(arguments, server_cpus)
    failed = True
    try:
        for server in servers:
            server.start()
        for server in servers:
            server.wait_ready()
        for server in servers:
            print(f"server {server.label}: pid {server.pid} on {server.address}")
        print(f"sidecar config: {arguments.config}")
        print(table([]))
        results = run_rounds(arguments, servers, (server_cpus, client_cpus))
        failed = False
    except KeyboardInterrupt:
        failed = False  # nothing to debug: drop the logs
        raise
    finally:
        for server in servers:
            server.stop()
            if failed:
                print(f"{server.label} log kept: {server.log.name}", file=sys.stderr)
            else:
                server.discard_log()
    return report_compare(arguments, env, results, len(client_cpus or os.sched_getaffinity(0)))


def ratios_to_bare(runs: Sequence[RunResult], bare_runs: Sequence[RunResult]) -> dict[str, float | None]:
    """Ratios of medians, and the median of the per-round (paired) throughput ratios."""
    row, bare = medians(runs), medians(bare_runs)
    paired = [r.rps / b.rps for r, b in zip(runs, bare_runs, strict=True) if b.rps]
    return {
        "throughput": _ratio(row["rps"], bare["rps"]),
        "throughput_paired_median": round(statistics.median(paired), 3) if paired else None,
        "p50": _ratio(row["p50_ms"], bare["p50_ms"]),
        "p99": _ratio(row["p99_ms"], bare["p99_ms"]),
        "server_us_per_call": _ratio(row["server_us_per_call"], bare["server_us_per_call"]),
        # When the server's core is the bottleneck, throughput is 1 / (CPU per call):
        # this estimate holds up even when other load steals some of that core.
        "throughput_from_cpu": _ratio(bare["server_us_per_call"], row["server_us_per_call"]),
        "server_us_per_call_added": (
            round(row["server_us_per_call"] - bare["server_us_per_call"], 1)
            if row["server_us_per_call"] and bare["server_us_per_call"]
            else None
        ),
    }


def machine_notes(results: dict[str, list[RunResult]], client_cores: int, threshold: float) -> list[str]:
    """Warnings that make figures suspect: a saturated generator, other load during runs."""
    notes = []
    for runs in results.values():
        for result in runs:
            note = saturation_note(result, client_cores)
            if note:
                notes.append(f"{result.label}: {note}")
                break
    every = [run for runs in results.values() for run in runs]
    disturbed = [run for run in every if run.other_cpu > threshold]
    if disturbed:
        worst = max(disturbed, key=lambda run: run.other_cpu)
        notes.append(
            f"warning: {len(disturbed)} of {len(every)} runs were disturbed by other load (> {threshold:g} cores; "
            f"worst {worst.other_cpu:.2f}): their figures (throughput most) are less reliable; "
            "server CPU per call is the steadier figure. Rerun when the machine is quiet."
        )
    return notes


def describe_ratio(label: str, ratio: dict[str, Any], arguments: argparse.Namespace, *, unreliable: bool) -> str:
    """One line of ratios to the bare servicer, with the verdict on the goal for the sidecar."""
    verdict = ""
    if label == "sidecar" and arguments.rate:
        verdict = f" (offered {arguments.rate:g}/s to both: compare latencies, not throughput)"
    elif label == "sidecar" and unreliable:
        verdict = " (UNRELIABLE: most runs disturbed by other load; see the CPU-based estimate)"
    elif label == "sidecar":
        ok = ratio["throughput"] is not None and ratio["throughput"] >= GOAL_RATIO
        verdict = f" ({'meets' if ok else 'BELOW'} goal >= {GOAL_RATIO})"
    line = (
        f"{label}/bare: throughput {ratio['throughput']}{verdict}; per-round paired median "
        f"{ratio['throughput_paired_median']}; p50 {ratio['p50']}, p99 {ratio['p99']}"
    )
    if ratio["server_us_per_call_added"] is not None:
        line += (
            f"; server CPU per call {ratio['server_us_per_call']} ({ratio['server_us_per_call_added']:+} us), "
            f"so a server-bound throughput ratio of {ratio['throughput_from_cpu']}"
        )
    return line


def report_compare(
    arguments: argparse.Namespace,
    env: dict[str, Any],
    results: dict[str, list[RunResult]],
    client_cores: int,
) -> int:
    rows = {label: medians(runs) | {"label": label} for label, runs in results.items()}
    ratios = {label: ratios_to_bare(runs, results["bare"]) for label, runs in results.items() if label != "bare"}
    print()
    print(
        f"medians over {arguments.rounds} rounds ({arguments.duration:g} s each, "
        f"concurrency {arguments.concurrency}, pattern {arguments.pattern}; OK/OVER summed):"
    )
    print(table(list(rows.values())))
    every = [run for runs in results.values() for run in runs]
    disturbed = sum(1 for run in every if run.other_cpu > arguments.quiet_threshold)
    for label, ratio in ratios.items():
        print(describe_ratio(label, ratio, arguments, unreliable=disturbed * 2 > len(every)))
    for note in machine_notes(results, client_cores, arguments.quiet_threshold):
        print(note)
    print(f"reproduce: {command_line(arguments)}")
    if arguments.json:
        write_json(
            arguments.json,
            {
                "command": command_line(arguments),
                "environment": env,
                "runs": {label: [asdict(r) for r in runs] for label, runs in results.items()},
                "medians": rows,
                "ratios_to_bare": ratios,
            },
        )
    return 0


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
    service.stats.latency.observe = lambda _: None  # no latency histogram either
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


# ---------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------


def _duration(text: str) -> float:
    value = float(text)
    if not 0 < value <= 3600:
        raise argparse.ArgumentTypeError("must be in (0, 3600] seconds")
    return value


def _add_load_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--concurrency", type=positive_int, default=32, help="calls in flight")
    parser.add_argument(
        "--rate",
        type=float,
        default=0.0,
        help="offered load in calls/s over all lanes, for latency at a fixed load (default 0: as fast as possible)",
    )
    parser.add_argument("--duration", type=_duration, default=5.0, help="measured seconds per run (default 5)")
    parser.add_argument("--warmup", type=float, default=1.0, help="unmeasured seconds before each run (default 1)")
    parser.add_argument(
        "--max-requests",
        type=positive_int,
        default=5_000_000,
        help="stop a run after this many measured calls (default 5000000)",
    )
    parser.add_argument(
        "--processes",
        type=positive_int,
        default=1,
        help="load-generator processes; concurrency is split between them (default 1)",
    )
    parser.add_argument(
        "--channels",
        type=positive_int,
        default=1,
        help="gRPC channels (TCP connections) per process (default 1)",
    )
    parser.add_argument("--pattern", choices=PATTERNS, default="mixed", help="request mix")
    parser.add_argument(
        "--pool-size",
        type=positive_int,
        default=20_000,
        help="distinct prebuilt requests per process, cycled (default 20000)",
    )
    parser.add_argument("--timeout", type=float, default=1.0, help="deadline of each call in seconds (default 1)")
    parser.add_argument("--seed", type=int, default=1, help="seed of the request mix")
    parser.add_argument("--client-cpus", help="pin the load generator to these cpus, e.g. 1 or 0-1")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.grpc_bench",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser("run", help="drive a running server")
    run.add_argument("--target", required=True, help="HOST:PORT of the server (loopback)")
    run.add_argument("--server-pid", type=int, help="pid of the server, to report its CPU")
    _add_load_arguments(run)
    run.set_defaults(handler=cmd_run)

    compare = commands.add_parser("compare", help="bare servicer vs sidecar, alternating rounds")
    compare.add_argument("--rounds", type=positive_int, default=3, help="rounds (default 3)")
    compare.add_argument("--config", default=str(DEFAULT_CONFIG.relative_to(REPO)), help="sidecar config")
    compare.add_argument("--server-cpus", help="pin both servers to these cpus (default: the first usable cpu)")
    compare.add_argument("--no-pin", action="store_true", help="do not pin anything")
    compare.add_argument(
        "--calibrate-us",
        metavar="US[,US...]",
        help="also run bare servicers that burn this many us of CPU per call, e.g. 25,50",
    )
    compare.add_argument(
        "--quiet-wait",
        type=float,
        default=20.0,
        help="before each run, wait up to this many seconds for a quiet machine (0: don't; default 20)",
    )
    compare.add_argument(
        "--quiet-threshold",
        type=float,
        default=0.2,
        help="cores busy (idle servers included) below which the machine counts as quiet (default 0.2)",
    )
    compare.add_argument(
        "--redo-disturbed",
        type=int,
        default=2,
        help="redo a run up to this many times when other load exceeded --quiet-threshold (default 2)",
    )
    compare.add_argument(
        "--partial",
        metavar="WORK[,WORK...]",
        help="also run bare servicers doing part of the sidecar's work: validate, decide, handler, floor",
    )
    _add_load_arguments(compare)
    compare.set_defaults(handler=cmd_compare)

    inproc = commands.add_parser("inproc", help="cost per call of answer(), without gRPC")
    inproc.add_argument("--pattern", choices=PATTERNS, default="mixed", help="request mix")
    inproc.add_argument("--calls", type=positive_int, default=100_000, help="calls per pass")
    inproc.add_argument("--repeat", type=positive_int, default=3, help="timed passes (median)")
    inproc.add_argument("--pool-size", type=positive_int, default=20_000, help="distinct requests")
    inproc.add_argument("--seed", type=int, default=1, help="seed of the request mix")
    inproc.add_argument("--config", default=str(DEFAULT_CONFIG.relative_to(REPO)), help="sidecar config")
    inproc.add_argument("--profile", type=int, metavar="N", help="also print the N costliest functions (cProfile)")
    inproc.add_argument(
        "--response-headers", action="store_true", help="the service with --response-headers (RateLimit-* headers)"
    )
    inproc.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    inproc.set_defaults(handler=cmd_inproc)
    return parser


def _validate_target(target: str) -> None:
    host = target.rpartition(":")[0].strip("[]")
    if host not in {"127.0.0.1", "localhost", "::1"}:
        raise SystemExit(f"grpc_bench: --target must be on loopback (127.0.0.1), not {host!r}")


def main(argv: Sequence[str] | None = None) -> int:
    arguments = build_parser().parse_args(argv)
    if arguments.command == "run":
        _validate_target(arguments.target)
    # Explicit handlers, so that even a copy started with SIGINT ignored (a background
    # job of a non-interactive shell) stops its children on SIGINT, SIGTERM or SIGHUP.
    signals = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    return run_cli("grpc_bench", functools.partial(arguments.handler, arguments), signals)


if __name__ == "__main__":
    sys.exit(main())
