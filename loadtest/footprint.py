"""CPU and memory of a real sidecar process, idle and under a modest load: what to request
in Kubernetes (docs/deployment.md, per overlay).

    python -m loadtest.footprint                       # memory, sync, strict: ~2 minutes
    python -m loadtest.footprint --rate 500 --load-seconds 20 --backends memory

For each backend it starts ``ratelimit-sidecar serve`` on loopback with examples/config
(sync and strict on a redis-server it starts itself, as the overlays run; both through stack/), and reads
``/proc/<pid>``: resident memory (VmRSS, and VmHWM for the peak) and CPU time
(utime + stime, all threads) over an idle period and over ``--load-seconds`` of
``ShouldRateLimit`` calls at ``--rate`` per second (Envoy's descriptors for ``/api`` with an
API key, ``--clients`` distinct addresses and keys), from a client in this process. Bounded:
every child is stopped when it ends.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from loadtest.common import health_serving, proc_status
from stack import redis as stack_redis
from stack.processes import free_port, process_group, spawn
from stack.redis import RedisProcess
from stack.sidecar import serve_argv

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "examples" / "config"
TICKS = os.sysconf("SC_CLK_TCK")
MIB = 1024 * 1024


def cpu_seconds(pid: int) -> float:
    """utime + stime of the process (all its threads), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def memory_mib(pid: int) -> tuple[float, float]:
    """(VmRSS, VmHWM) in MiB."""
    return (proc_status(pid, "VmRSS") or 0) / MIB, (proc_status(pid, "VmHWM") or 0) / MIB


@contextmanager
def child(argv: Sequence[str], env: dict[str, str] | None = None) -> Iterator[subprocess.Popen[bytes]]:
    """``argv`` started through :func:`stack.processes.spawn` (it dies with this process), its
    output dropped; stopped on exit."""
    process = spawn(argv, stdout=subprocess.DEVNULL, env=env)
    try:
        yield process
    finally:
        process.terminate()
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextmanager
def redis_server() -> Iterator[str]:
    """A redis-server on a free loopback port (:class:`stack.redis.RedisProcess`); yields its URL."""
    if not stack_redis.available():
        raise SystemExit("redis-server not found (scripts/bootstrap installs it)")
    with tempfile.TemporaryDirectory() as directory, process_group() as group:
        yield group.start_ready(lambda: RedisProcess(Path(directory))).url


def requests(clients: int) -> list[Any]:
    from sidecar.protos.envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
    from sidecar.protos.envoy.service.ratelimit.v3 import rls_pb2

    def descriptor(*entries: tuple[str, str]) -> Any:
        return ratelimit_pb2.RateLimitDescriptor(
            entries=[ratelimit_pb2.RateLimitDescriptor.Entry(key=k, value=v) for k, v in entries]
        )

    return [
        rls_pb2.RateLimitRequest(
            domain="demo",
            descriptors=[
                descriptor(("remote_address", f"198.51.{i // 250}.{i % 250}")),
                descriptor(("generic_key", "api")),
                descriptor(("generic_key", "api"), ("api_key", f"key-{i}")),
            ],
        )
        for i in range(clients)
    ]


async def drive(address: str, rate: int, seconds: float, clients: int) -> int:
    """``rate`` calls per second for ``seconds``, paced in 10 ms ticks; the calls answered."""
    import grpc

    from sidecar.protos.envoy.service.ratelimit.v3 import rls_pb2_grpc

    pool = requests(clients)
    answered = 0
    async with grpc.aio.insecure_channel(address) as channel:
        stub = rls_pb2_grpc.RateLimitServiceStub(channel)

        async def one(request: Any) -> None:
            nonlocal answered
            await stub.ShouldRateLimit(request, timeout=5)
            answered += 1

        loop = asyncio.get_running_loop()
        started = loop.time()
        sent = 0
        tasks = set()
        while (elapsed := loop.time() - started) < seconds:
            due = int(elapsed * rate)
            while sent < due:
                task = asyncio.ensure_future(one(pool[sent % len(pool)]))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                sent += 1
            await asyncio.sleep(0.01)
        if tasks:
            await asyncio.wait(tasks, timeout=10)
    return answered


def wait_serving(address: str, process: subprocess.Popen[bytes]) -> None:
    """Until the sidecar at ``address`` answers its health check SERVING (30 s at most)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the sidecar exited with {process.returncode}")
        if health_serving(address, timeout=1):
            return
        time.sleep(0.1)
    raise SystemExit("the sidecar did not report SERVING within 30 s")


def measure(backend: str, arguments: argparse.Namespace, redis_url: str) -> dict[str, float]:
    port = free_port()
    address = f"127.0.0.1:{port}"
    env = {key: value for key, value in os.environ.items() if not key.startswith(("RLS_", "OTEL_"))}
    env.update(RLS_LOG_LEVEL="warning", RLS_METRICS_ADDRESS="", RLS_CONFIG=str(CONFIG), RLS_GRPC_ADDRESS=address)
    if backend != "memory":
        env.update(RLS_BACKEND="redis", RLS_MODE=backend, RLS_REDIS_URL=redis_url)
    with child(serve_argv(()), env) as process:
        wait_serving(address, process)
        time.sleep(2)  # the config watcher and the first heartbeats settle
        rss_start, _ = memory_mib(process.pid)
        cpu, clock = cpu_seconds(process.pid), time.monotonic()
        time.sleep(arguments.idle_seconds)
        idle_cores = (cpu_seconds(process.pid) - cpu) / (time.monotonic() - clock)
        rss_idle, _ = memory_mib(process.pid)
        import uvloop

        cpu, clock = cpu_seconds(process.pid), time.monotonic()
        answered = uvloop.run(drive(address, arguments.rate, arguments.load_seconds, arguments.clients))
        wall = time.monotonic() - clock
        load_cpu = cpu_seconds(process.pid) - cpu
        rss_load, peak = memory_mib(process.pid)
    return {
        "rss_start": rss_start,
        "rss_idle": rss_idle,
        "idle_mcores": idle_cores * 1000,
        "calls_per_s": answered / wall,
        "load_mcores": load_cpu / wall * 1000,
        "us_per_call": load_cpu / max(answered, 1) * 1e6,
        "rss_load": rss_load,
        "rss_peak": peak,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--backends", nargs="+", default=["memory", "sync", "strict"], choices=["memory", "sync", "strict"]
    )
    parser.add_argument("--rate", type=int, default=500, help="calls per second during the load")
    parser.add_argument("--load-seconds", type=float, default=20.0)
    parser.add_argument("--idle-seconds", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=2000, help="distinct addresses and API keys")
    arguments = parser.parse_args(argv)
    print(
        f"python -m loadtest.footprint --backends {' '.join(arguments.backends)} --rate {arguments.rate} "
        f"--load-seconds {arguments.load_seconds:g} --idle-seconds {arguments.idle_seconds:g} "
        f"--clients {arguments.clients}\n{os.cpu_count()} cores, Python {sys.version.split()[0]}"
    )
    print(
        f"{'backend':8s} {'RSS start':>10s} {'RSS idle':>9s} {'idle CPU':>9s} {'calls/s':>8s} "
        f"{'load CPU':>9s} {'us/call':>8s} {'RSS load':>9s} {'RSS peak':>9s}"
    )
    with redis_server() as redis_url:
        for backend in arguments.backends:
            row = measure(backend, arguments, redis_url)
            print(
                f"{backend:8s} {row['rss_start']:7.1f} MiB {row['rss_idle']:5.1f} MiB {row['idle_mcores']:6.1f} m "
                f"{row['calls_per_s']:8.0f} {row['load_mcores']:6.0f} m {row['us_per_call']:8.0f} "
                f"{row['rss_load']:5.1f} MiB {row['rss_peak']:5.1f} MiB",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
