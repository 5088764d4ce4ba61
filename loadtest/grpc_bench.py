"""gRPC load benchmark for the sidecar's ``ShouldRateLimit``.

Three subcommands, each bounded in time and request count and stopping by itself:

``run``
    Drive a running server (``--target HOST:PORT``) with ``--concurrency`` calls in
    flight for ``--duration`` seconds (and at most ``--max-requests``), from one or
    more load-generator processes, and print requests/s, latency percentiles, errors
    by gRPC status and OK / OVER_LIMIT counts.
``compare``
    Start a bare servicer (``loadtest/bare_servicer.py``: same stack, does nothing)
    and the real sidecar with the example config, each on a free 127.0.0.1 port,
    optionally pin servers and load generator to separate cores, run the same
    request mix against each alternately for ``--rounds`` rounds and print medians
    and the sidecar/bare ratios. Every child process is stopped at the end, also on
    Ctrl-C or error.
``inproc``
    Cost per call of ``RateLimitService.decide`` (and of the other steps of the
    request path) in this process, without gRPC; ``--profile`` adds a cProfile table.

Examples::

    python loadtest/grpc_bench.py compare --duration 5 --concurrency 32 --rounds 3
    python loadtest/grpc_bench.py run --target 127.0.0.1:8081 --duration 10 --pattern mixed
    python loadtest/grpc_bench.py inproc --pattern mixed --calls 200000

Throughput on a small machine is noisy; compare ratios from one ``compare`` run,
not absolute figures from different runs. Each report ends with the exact command
line that reproduces it, the core count and the Python / grpcio versions.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import json
import math
import multiprocessing
import multiprocessing.connection
import os
import platform
import random
import shlex
import signal
import socket
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

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
DEFAULT_CONFIG = REPO / "examples" / "config"
METHOD = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit"
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


@dataclass
class Tally:
    """What one worker saw in the measured window."""

    remaining: int
    latencies: list[float] = field(default_factory=list)
    codes: dict[int, int] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)
    last_end: float = 0.0


def overall_code(response: bytes) -> int:
    """``overall_code`` of a serialized ``RateLimitResponse`` without parsing it all.

    Field 1 (varint, tag byte 0x08) is written first; absent means 0 (UNKNOWN).
    The worker checks this against a full parse on its first call.
    """
    return response[1] if response[:1] == b"\x08" else 0


async def _lane(
    call: Any,
    pool: Sequence[bytes],
    index: int,
    tally: Tally,
    *,
    measure_start: float,
    end: float,
    timeout: float,
) -> None:
    """One in-flight call at a time, back to back, until ``end`` or the budget is spent."""
    perf = time.perf_counter
    size = len(pool)
    latencies = tally.latencies
    codes = tally.codes
    while tally.remaining > 0:
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
    import uvloop

    if spec.cpus is not None:
        os.sched_setaffinity(0, spec.cpus)  # before gRPC starts any thread
    try:
        uvloop.run(_drive(spec, conn))
    except KeyboardInterrupt:
        pass
    except Exception as error:
        with contextlib.suppress(OSError):
            conn.send(("error", f"{type(error).__name__}: {error}"))
    finally:
        conn.close()


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
    """Server CPU time per answered call: the least noisy cost figure."""


def percentile(ordered: Sequence[float], fraction: float) -> float:
    """Nearest-rank percentile of an ascending sequence (0 when empty)."""
    if not ordered:
        return 0.0
    rank = min(len(ordered), max(1, math.ceil(fraction * len(ordered))))
    return ordered[rank - 1]


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU of a process (all its threads), or None if it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _cpu_total(pids: Sequence[int]) -> float:
    return sum(cpu_seconds(pid) or 0.0 for pid in pids)


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
) -> RunResult:
    """One measured run: start the workers, go, collect, and always stop them."""
    context = multiprocessing.get_context("spawn")
    processes = min(load.processes, load.concurrency)
    workers: list[tuple[Any, multiprocessing.connection.Connection]] = []
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
            )
            parent_end, child_end = context.Pipe()
            process = context.Process(target=worker_main, args=(spec, child_end), daemon=True)
            process.start()
            child_end.close()
            workers.append((process, parent_end))
        for _, conn in workers:
            _expect(conn, "ready", 60.0)
        return _measure(label, load, workers, server_pid)
    finally:
        for process, conn in workers:
            with contextlib.suppress(OSError):
                conn.close()
            process.join(timeout=2)
            if process.is_alive():
                process.kill()
                process.join(timeout=2)


def _expect(conn: multiprocessing.connection.Connection, kind: str, timeout: float) -> Any:
    if not conn.poll(timeout):
        raise RuntimeError(f"load generator sent no {kind!r} within {timeout:.0f} s")
    message = conn.recv()
    if message[0] == "error":
        raise RuntimeError(f"load generator failed: {message[1]}")
    if message[0] != kind:
        raise RuntimeError(f"load generator sent {message[0]!r}, expected {kind!r}")
    return message[1]


def _sleep_until(wall: float) -> None:
    time.sleep(max(0.0, wall - time.time()))


def _measure(
    label: str,
    load: LoadOptions,
    workers: Sequence[tuple[Any, multiprocessing.connection.Connection]],
    server_pid: int | None,
) -> RunResult:
    go = time.time() + 0.05
    measure_start = go + load.warmup
    end = measure_start + load.duration
    for _, conn in workers:
        conn.send(("go", go, measure_start, end))
    worker_pids = [process.pid for process, _ in workers]
    _sleep_until(measure_start)
    client_before = _cpu_total(worker_pids)
    server_before = cpu_seconds(server_pid) if server_pid else None
    # Sample CPU at the end of the window, or earlier if every worker spent its budget.
    pending = [conn for _, conn in workers]
    results: list[dict[str, Any]] = []
    sampled_at: float | None = None
    client_after = server_after = None
    deadline = end + load.timeout + 15
    while pending:
        now = time.time()
        if sampled_at is None and now >= end:
            sampled_at, client_after = now, _cpu_total(worker_pids)
            server_after = cpu_seconds(server_pid) if server_pid else None
        if now >= deadline:
            raise RuntimeError("load generator did not report in time")
        wait_for = (end if sampled_at is None else deadline) - now
        for conn in multiprocessing.connection.wait(pending, timeout=max(0.0, wait_for)):
            results.append(_expect(conn, "result", 1.0))  # type: ignore[arg-type]
            pending.remove(conn)  # type: ignore[arg-type]
    if sampled_at is None:
        sampled_at, client_after = time.time(), _cpu_total(worker_pids)
        server_after = cpu_seconds(server_pid) if server_pid else None
    window = max(1e-9, min(sampled_at, end) - measure_start)
    return summarize(
        label,
        results,
        client_cpu=((client_after or 0.0) - client_before) / window,
        server_cpu=(
            (server_after - server_before) / window if server_after is not None and server_before is not None else None
        ),
    )


def summarize(label: str, results: Sequence[dict[str, Any]], client_cpu: float, server_cpu: float | None) -> RunResult:
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
    answered = len(ordered)
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
        client_cpu=round(client_cpu, 3),
        server_cpu=None if server_cpu is None else round(server_cpu, 3),
        server_us_per_call=(
            round(server_cpu * elapsed / answered * 1e6, 1) if server_cpu is not None and answered else None
        ),
    )


# ---------------------------------------------------------------------------------
# Servers started by "compare"
# ---------------------------------------------------------------------------------


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _child_setup(cpus: tuple[int, ...] | None) -> Callable[[], None]:
    """Runs in the child before exec: pin it, and have it killed if we die."""

    def setup() -> None:
        if cpus is not None:
            os.sched_setaffinity(0, cpus)
        with contextlib.suppress(Exception):
            pr_set_pdeathsig = 1
            ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)

    return setup


class ServerProcess:
    """A server child on a free loopback port, its log in a temporary file."""

    def __init__(self, label: str, argv: Sequence[str], cpus: tuple[int, ...] | None) -> None:
        self.label = label
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.argv = [*argv, "--grpc-address", self.address]
        self.cpus = cpus
        self.log = tempfile.NamedTemporaryFile(  # noqa: SIM115 - closed in stop()
            prefix=f"grpc_bench-{label}-", suffix=".log", delete=False
        )
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.process = subprocess.Popen(
            self.argv,
            stdin=subprocess.DEVNULL,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            start_new_session=True,  # Ctrl-C reaches us only; we stop the servers ourselves
            preexec_fn=_child_setup(self.cpus),  # noqa: PLW1509 - no threads exist yet
        )

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Until the health service says SERVING; fail with the log tail otherwise."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.label} exited at start:\n{self.log_tail()}")
            with grpc.insecure_channel(self.address) as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                with contextlib.suppress(grpc.RpcError):
                    reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=0.5)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
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


def environment(client_cpus: Any = None, server_cpus: Any = None) -> dict[str, Any]:
    """What the figures depend on: cores, CPU model, versions, pinning, load average."""
    import google.protobuf
    import uvloop
    from google.protobuf.internal import api_implementation

    model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return {
        "cores": os.cpu_count(),
        "cpu_model": model,
        "usable_cores": sorted(os.sched_getaffinity(0)),
        "loadavg_at_start": os.getloadavg()[0],
        "python": platform.python_version(),
        "grpcio": grpc.__version__,
        "protobuf": f"{google.protobuf.__version__} ({api_implementation.Type()})",
        "uvloop": uvloop.__version__,
        "server_cpus": server_cpus,
        "client_cpus": client_cpus,
    }


def command_line(arguments: argparse.Namespace) -> str:
    """The command that reproduces the figures, every option spelled out."""
    words = ["python", "loadtest/grpc_bench.py", arguments.command]
    for name, value in vars(arguments).items():
        if name in {"command", "handler", "json"} or value is None:
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            if value:
                words.append(flag)
        else:
            words += [flag, str(value)]
    return shlex.join(words)


def print_header(arguments: argparse.Namespace, env: dict[str, Any]) -> None:
    print(f"command: {command_line(arguments)}")
    print(
        f"machine: {env['cores']} cores ({env['cpu_model']}), load average {env['loadavg_at_start']:.2f}; "
        f"Python {env['python']}, grpcio {env['grpcio']}, protobuf {env['protobuf']}, "
        f"uvloop {env['uvloop']}"
    )
    print(f"pinning: server cpus {env['server_cpus']}, load generator cpus {env['client_cpus']}")


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


def parse_cpus(text: str | None) -> tuple[int, ...] | None:
    """``"0"``, ``"0,1"`` or ``"0-1"`` into a tuple of cpu numbers; None for none/empty."""
    if not text or text == "none":
        return None
    cpus: list[int] = []
    for part in text.split(","):
        low, _, high = part.partition("-")
        cpus.extend(range(int(low), int(high or low) + 1))
    return tuple(cpus)


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
    keys = ("rps", "p50_ms", "p90_ms", "p99_ms", "max_ms", "client_cpu")
    row: dict[str, Any] = {key: statistics.median(getattr(r, key) for r in results) for key in keys}
    for key in ("server_cpu", "server_us_per_call"):
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


def cmd_compare(arguments: argparse.Namespace) -> int:
    server_cpus, client_cpus = default_pinning(arguments)
    env = environment(client_cpus=client_cpus, server_cpus=server_cpus)
    print_header(arguments, env)
    if client_cpus is not None:
        os.sched_setaffinity(0, client_cpus)  # this process only waits, but keep it off the server
    load = load_options(arguments)
    bare = ServerProcess("bare", [sys.executable, str(HERE / "bare_servicer.py"), "--max-seconds", "3600"], server_cpus)
    sidecar = ServerProcess(
        "sidecar",
        [
            sys.executable,
            "-m",
            "sidecar",
            "serve",
            "--config",
            config_path(arguments.config),
            "--log-format",
            "json",
            "--log-level",
            "warning",
            "--shutdown-grace",
            "1",
        ],
        server_cpus,
    )
    servers = [bare, sidecar]
    results: dict[str, list[RunResult]] = {"bare": [], "sidecar": []}
    failed = True
    try:
        for server in servers:
            server.start()
        for server in servers:
            server.wait_ready()
        print(
            f"servers: bare pid {bare.pid} on {bare.address}, sidecar pid {sidecar.pid} on "
            f"{sidecar.address} (config {arguments.config})"
        )
        print(table([]))
        run_index = 0
        for round_index in range(arguments.rounds):
            order = servers if round_index % 2 == 0 else servers[::-1]
            for server in order:
                run_index += 1
                result = run_load(
                    server.label,
                    server.address,
                    load,
                    run_seed=arguments.seed + run_index,
                    client_cpus=client_cpus,
                    server_pid=server.pid,
                )
                results[server.label].append(result)
                print(table([asdict(result)]).splitlines()[1] + f"   round {round_index + 1}")
                if result.errors or result.other_codes:
                    print(f"         {describe_errors(result)}")
        failed = False
    finally:
        for server in servers:
            server.stop()
            if not failed:
                server.discard_log()
            else:
                print(f"{server.label} log kept: {server.log.name}", file=sys.stderr)
    return report_compare(arguments, env, results, len(client_cpus or os.sched_getaffinity(0)))


def report_compare(
    arguments: argparse.Namespace,
    env: dict[str, Any],
    results: dict[str, list[RunResult]],
    client_cores: int,
) -> int:
    rows = {label: medians(runs) | {"label": label} for label, runs in results.items()}
    bare, sidecar = rows["bare"], rows["sidecar"]
    ratios = {
        "throughput": _ratio(sidecar["rps"], bare["rps"]),
        "p50": _ratio(sidecar["p50_ms"], bare["p50_ms"]),
        "p99": _ratio(sidecar["p99_ms"], bare["p99_ms"]),
        "server_us_per_call": _ratio(sidecar["server_us_per_call"], bare["server_us_per_call"]),
    }
    print()
    print(
        f"medians over {arguments.rounds} rounds ({arguments.duration:g} s each, "
        f"concurrency {arguments.concurrency}, pattern {arguments.pattern}; OK/OVER summed):"
    )
    print(table([bare, sidecar]))
    extra = (
        f"{sidecar['server_us_per_call'] - bare['server_us_per_call']:.1f} us"
        if sidecar["server_us_per_call"] and bare["server_us_per_call"]
        else "-"
    )
    verdict = "meets" if ratios["throughput"] and ratios["throughput"] >= GOAL_RATIO else "BELOW"
    print(
        f"sidecar/bare: throughput {ratios['throughput']} ({verdict} goal >= {GOAL_RATIO}), "
        f"p50 {ratios['p50']}, p99 {ratios['p99']}, "
        f"server CPU per call {ratios['server_us_per_call']} (+{extra} per call)"
    )
    for runs in results.values():
        for result in runs:
            note = saturation_note(result, client_cores)
            if note:
                print(f"{result.label}: {note}")
                break
    print(f"reproduce: {command_line(arguments)}")
    if arguments.json:
        write_json(
            arguments.json,
            {
                "command": command_line(arguments),
                "environment": env,
                "runs": {label: [asdict(r) for r in runs] for label, runs in results.items()},
                "medians": rows,
                "ratios_sidecar_over_bare": ratios,
            },
        )
    return 0


def per_call(function: Callable[[Any], Any], items: Sequence[Any]) -> float:
    """Microseconds per call of ``function`` over ``items`` (loop overhead included)."""
    started = time.perf_counter()
    for item in items:
        function(item)
    return (time.perf_counter() - started) / len(items) * 1e6


def cmd_inproc(arguments: argparse.Namespace) -> int:
    """Per-call cost of each step of the request path, in this process, without gRPC."""
    import uvloop

    from sidecar.config import load_config
    from sidecar.limiter.memory import MemoryLimiter
    from sidecar.service import RateLimitService
    from sidecar.validate import request_problem

    env = environment()
    print_header(arguments, env)
    config = load_config(config_path(arguments.config))
    pool = request_pool(arguments.pattern, arguments.pool_size, arguments.seed, "inproc")
    wire = [request.SerializeToString() for request in pool]
    calls = arguments.calls
    requests = [pool[i % len(pool)] for i in range(calls)]
    payloads = [wire[i % len(wire)] for i in range(calls)]
    parse = rls_pb2.RateLimitRequest.FromString
    serialize = rls_pb2.RateLimitResponse.SerializeToString

    class Context:
        async def abort(self, code: Any, details: str) -> None:
            raise RuntimeError(f"abort {code}: {details}")

    async def measure() -> dict[str, float]:
        service = RateLimitService(config, MemoryLimiter())
        for request in requests[: min(calls, 2000)]:  # warm caches and windows
            await service.decide(request)
        service = RateLimitService(config, MemoryLimiter())
        figures: dict[str, float] = {}
        figures["parse request"] = per_call(parse, payloads)
        figures["validate (request_problem)"] = per_call(request_problem, requests)
        started = time.perf_counter()
        responses = [await service.decide(request) for request in requests]
        figures["decide (match + limiter + response)"] = (time.perf_counter() - started) / calls * 1e6
        figures["serialize response"] = per_call(serialize, responses)
        service = RateLimitService(config, MemoryLimiter())
        context = Context()
        started = time.perf_counter()
        for request in requests:
            await service.ShouldRateLimit(request, context)
        figures["ShouldRateLimit handler (validate + decide)"] = (time.perf_counter() - started) / calls * 1e6
        over = sum(1 for r in responses if r.overall_code == rls_pb2.RateLimitResponse.OVER_LIMIT)
        figures["share OVER_LIMIT"] = over / calls
        if arguments.profile:
            import cProfile
            import pstats

            service = RateLimitService(config, MemoryLimiter())
            profiler = cProfile.Profile()
            profiler.enable()
            for request in requests:
                await service.ShouldRateLimit(request, context)
            profiler.disable()
            pstats.Stats(profiler).sort_stats("tottime").print_stats(arguments.profile)
        return figures

    figures = uvloop.run(measure())
    print(f"{calls} calls, pattern {arguments.pattern}, pool of {len(pool)} distinct requests:")
    for name, value in figures.items():
        if name.startswith("share"):
            print(f"  {name:45} {value:.1%}")
        else:
            print(f"  {name:45} {value:7.2f} us/call")
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


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def _duration(text: str) -> float:
    value = float(text)
    if not 0 < value <= 3600:
        raise argparse.ArgumentTypeError("must be in (0, 3600] seconds")
    return value


def _add_load_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--concurrency", type=_positive_int, default=32, help="calls in flight")
    parser.add_argument("--duration", type=_duration, default=5.0, help="measured seconds per run (default 5)")
    parser.add_argument("--warmup", type=float, default=1.0, help="unmeasured seconds before each run (default 1)")
    parser.add_argument(
        "--max-requests",
        type=_positive_int,
        default=5_000_000,
        help="stop a run after this many measured calls (default 5000000)",
    )
    parser.add_argument(
        "--processes",
        type=_positive_int,
        default=1,
        help="load-generator processes; concurrency is split between them (default 1)",
    )
    parser.add_argument(
        "--channels",
        type=_positive_int,
        default=1,
        help="gRPC channels (TCP connections) per process (default 1)",
    )
    parser.add_argument("--pattern", choices=PATTERNS, default="mixed", help="request mix")
    parser.add_argument(
        "--pool-size",
        type=_positive_int,
        default=20_000,
        help="distinct prebuilt requests per process, cycled (default 20000)",
    )
    parser.add_argument("--timeout", type=float, default=1.0, help="deadline of each call in seconds (default 1)")
    parser.add_argument("--seed", type=int, default=1, help="seed of the request mix")
    parser.add_argument("--client-cpus", help="pin the load generator to these cpus, e.g. 1 or 0-1")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="grpc_bench.py",
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
    compare.add_argument("--rounds", type=_positive_int, default=3, help="rounds (default 3)")
    compare.add_argument("--config", default=str(DEFAULT_CONFIG.relative_to(REPO)), help="sidecar config")
    compare.add_argument("--server-cpus", help="pin both servers to these cpus (default: the first usable cpu)")
    compare.add_argument("--no-pin", action="store_true", help="do not pin anything")
    _add_load_arguments(compare)
    compare.set_defaults(handler=cmd_compare)

    inproc = commands.add_parser("inproc", help="cost per call of decide(), without gRPC")
    inproc.add_argument("--pattern", choices=PATTERNS, default="mixed", help="request mix")
    inproc.add_argument("--calls", type=_positive_int, default=200_000, help="calls to time")
    inproc.add_argument("--pool-size", type=_positive_int, default=20_000, help="distinct requests")
    inproc.add_argument("--seed", type=int, default=1, help="seed of the request mix")
    inproc.add_argument("--config", default=str(DEFAULT_CONFIG.relative_to(REPO)), help="sidecar config")
    inproc.add_argument("--profile", type=int, metavar="N", help="also print the N costliest functions (cProfile)")
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

    def on_sigterm(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        return int(arguments.handler(arguments))
    except KeyboardInterrupt:
        print("grpc_bench: interrupted; child processes stopped", file=sys.stderr)
        return 130
    except RuntimeError as error:
        print(f"grpc_bench: error: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
