"""Driving a server: load-generator worker processes, one measured run, CPU use meanwhile."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing.connection
import os
import random
import time
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from loadtest.common import (
    METHOD,
    Worker,
    cpu_seconds,
    overall_code,
    percentile,
    run_worker,
    start_worker,
    stop_workers,
    worker_answer,
)
from loadtest.grpc_bench.mix import request_pool
from sidecar.protos.envoy.service.ratelimit.v3 import rls_pb2

CODE_NAMES = {0: "UNKNOWN", 1: "OK", 2: "OVER_LIMIT"}


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
