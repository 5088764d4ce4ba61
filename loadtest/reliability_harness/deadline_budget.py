"""Redis down, paused or slow, with the caller's deadline as the budget (issue 17).

One real sidecar per (mode, fault), at default settings (``--redis-timeout`` 100 ms, the
budget being each call's gRPC deadline less a margin), on its own redis-server, gets
steady open-loop gRPC load in which every call carries Envoy's deadline (25 ms, the
filter ``timeout`` of ``envoy/sidecar.yaml``). A fault lasts about a second mid-load:

``redis_down``
    redis-server SIGKILLed, started again on its port a second later.
``redis_sigstop``
    redis-server SIGSTOPped for a second, then SIGCONTed.
``redis_debug_sleep``
    ``DEBUG SLEEP 1``: Redis itself blocks for a second, connections open.
``redis_lua_busy``
    A Lua script spins for 0.8 s (within ``lua-time-limit``): every other client waits.

The load generator runs in a process of its own (the harness's own forks, restarting
redis-server, must not stall the clock that measures the answers); the row also gives
the sidecar's own decision time (``ratelimit_sidecar_decision_seconds``, p99 bucket).
The row holds when every call was answered before its deadline (no gRPC error, no
``DEADLINE_EXCEEDED``): during the fault the failure mode answers, either because the
budget ran out (``deadline``) or because Redis was declared down after its silence
(``redis_down``); the reasons come from ``ratelimit_sidecar_failure_decisions_total``.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path

import grpc
import uvloop

from loadtest.common import METHOD, overall_code, percentile
from loadtest.reliability_harness.support import (
    Context,
    ProcessGroup,
    RedisProcess,
    Row,
    bucket_quantile,
    decision_buckets,
    encode_request,
    failed_row,
    main,
    ms,
    pin,
    process_group,
    redis_available,
    redis_command,
    scrape,
    skipped_row,
    start_sidecar,
)

AREA = "deadline-budget"
DEADLINE = 0.025
"""Envoy's rate-limit filter ``timeout`` (``envoy/sidecar.yaml``), sent as every call's deadline."""
RATE = 200
"""Calls per second."""
FAULT_AT = 1.0
FAULT_FOR = 1.0
MODES = ("sync", "strict")
FAULTS = {
    "redis_down": "redis-server SIGKILLed, restarted on its port 1 s later",
    "redis_sigstop": "redis-server SIGSTOPped for 1 s",
    "redis_debug_sleep": "DEBUG SLEEP 1",
    "redis_lua_busy": "a Lua busy loop of 0.8 s",
}
BUSY_SCRIPT = (
    "local t = redis.call('TIME') local s = t[1] + t[2] / 1e6 "
    "while true do local n = redis.call('TIME') if n[1] + n[2] / 1e6 - s > 0.8 then break end end return 1"
)
DOMAIN = "budget"
CONFIG = f"domain: {DOMAIN}\ndescriptors:\n  - key: k\n    rate_limit: {{unit: second, requests_per_unit: 50}}\n"


def run(context: Context) -> list[Row]:
    if not redis_available():
        return [skipped_row(AREA, "every fault", "redis-server is not on PATH")]
    config = context.directory / "deadline-budget"
    config.mkdir(parents=True, exist_ok=True)
    (config / "budget.yaml").write_text(CONFIG)
    rows = []
    for mode in MODES:
        for fault in FAULTS:
            with process_group() as group:
                try:
                    rows.append(run_one(context, group, config, mode, fault))
                except Exception as error:
                    rows.append(failed_row(AREA, f"{mode} mode: {fault}", error, group.children))
    return rows


def run_one(context: Context, group: ProcessGroup, config: Path, mode: str, fault: str) -> Row:
    where = context.directory / f"deadline-{mode}-{fault}"
    where.mkdir(parents=True, exist_ok=True)
    redis = group.start_ready(
        lambda: pin(RedisProcess(where, extra=["--enable-debug-command", "yes"]), context.server_cpus)
    )
    args = ["--config", str(config), "--watch-config", "false", "--backend", "redis"]
    args += ["--redis-url", redis.url, "--mode", mode, "--redis-prefix", f"b{os.getpid()}"]
    sidecar = start_sidecar(group, context, f"sidecar-{mode}-{fault}", args, where)
    inject = fault_action(group, redis, where, context, fault)
    # The load generator runs in its own process: starting redis-server again (a fork of
    # this process) must not stall the clock that measures the sidecar's answers.
    spawn = multiprocessing.get_context("spawn")
    ours, theirs = spawn.Pipe()
    generator = spawn.Process(target=drive_in_process, args=(sidecar.address, theirs), daemon=True)
    generator.start()
    try:
        if not ours.poll(30):
            raise RuntimeError("the load generator did not start")
        ours.recv()  # "started": the load runs from now on
        time.sleep(FAULT_AT)
        inject()
        if not ours.poll(30):
            raise RuntimeError("the load generator sent no result")
        latencies, errors = ours.recv()
    finally:
        generator.join(5)
        if generator.is_alive():
            generator.kill()
    latencies.sort()
    figures = scrape(sidecar.metrics_url)
    server_p99 = bucket_quantile(decision_buckets(figures), 0.99)
    reasons = {
        name.split('reason="')[1].rstrip('"}'): value
        for name, value in figures.items()
        if name.startswith("ratelimit_sidecar_failure_decisions_total{") and value
    }
    p99 = percentile(latencies, 0.99) if latencies else 0.0
    top = max(latencies, default=0.0)
    load = (
        f"{RATE} req/s, p99 {ms(p99):.1f} ms, max {ms(top):.1f} ms (deadline {DEADLINE * 1000:g} ms); "
        f"sidecar decision p99 <= {ms(server_p99):g} ms"
    )
    held = not errors
    notes = f"{FAULTS[fault]}; failure-mode decisions by reason {reasons or 'none'}"
    if errors:
        notes += f"; errors {errors}"
    return Row(
        AREA,
        f"{mode} mode, default budget: {fault}",
        load=load,
        ok=held,
        notes=notes,
        figures={
            "p99_ms": ms(p99),
            "max_ms": ms(top),
            "server_p99_ms": ms(server_p99),
            "errors": float(sum(errors.values())),
            **reasons,
        },
    )


def fault_action(
    group: ProcessGroup, redis: RedisProcess, where: Path, context: Context, fault: str
) -> Callable[[], None]:
    """What happens at :data:`FAULT_AT` (it blocks for the fault's length)."""

    def act() -> None:
        if fault == "redis_down":
            redis.kill()
            time.sleep(FAULT_FOR)
            debug = ["--enable-debug-command", "yes"]
            group.start_ready(lambda: pin(RedisProcess(where, port=redis.port, extra=debug), context.server_cpus))
        elif fault == "redis_sigstop":
            assert redis.process is not None
            os.kill(redis.process.pid, signal.SIGSTOP)
            time.sleep(FAULT_FOR)
            os.kill(redis.process.pid, signal.SIGCONT)
        elif fault == "redis_debug_sleep":
            redis_command(redis.port, "DEBUG", "SLEEP", str(FAULT_FOR))
        else:
            redis_command(redis.port, "EVAL", BUSY_SCRIPT, 0)

    return act


def drive_in_process(address: str, conn: Connection) -> None:
    """:func:`drive` in a load-generator process of its own; the result goes back on ``conn``."""
    conn.send(uvloop.run(drive(address, lambda: conn.send("started"))))


async def drive(address: str, started: Callable[[], None]) -> tuple[list[float], dict[str, int]]:
    """Open loop at :data:`RATE` for ``FAULT_AT + FAULT_FOR + 1`` s (the harness injects the fault)."""
    payloads = [encode_request(DOMAIN, [[("k", f"v{index}")]], hits=1) for index in range(4)]
    latencies: list[float] = []
    errors: dict[str, int] = {}
    async with grpc.aio.insecure_channel(address) as channel:
        call = channel.unary_unary(METHOD)
        await call(payloads[0], timeout=5)
        loop = asyncio.get_running_loop()
        start = loop.time()
        total = FAULT_AT + FAULT_FOR + 1.0
        started()

        async def one(payload: bytes) -> None:
            began = loop.time()
            try:
                overall_code(await call(payload, timeout=DEADLINE))
            except grpc.aio.AioRpcError as error:
                errors[error.code().name] = errors.get(error.code().name, 0) + 1
            latencies.append(loop.time() - began)

        tasks = []
        for index in range(int(total * RATE)):
            await asyncio.sleep(max(0.0, start + index / RATE - loop.time()))
            tasks.append(asyncio.ensure_future(one(payloads[index % len(payloads)])))
        await asyncio.gather(*tasks)
    return latencies, errors


if __name__ == "__main__":
    raise SystemExit(main(run))
