"""The load generator: keep-alive HTTP/1.1 on asyncio, no dependency beyond the standard library.

:func:`replay` sends a recording open loop: each request goes out at its scheduled time
whatever happened to the earlier ones (enough connections are opened beforehand, more
when all are busy), and every outcome keeps the wall-clock time just before the request
was written and just after its response was read. A limiter decides inside that interval,
on the same clock (``CLOCK_REALTIME``), which is what window attribution relies on.

:func:`closed_loop` keeps ``concurrency`` connections busy, one request in flight each, and
measures completed requests per second and their latency.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from loadtest.compare_harness.recording import Planned
from loadtest.http_load import Connection, HttpError, Pool

ERROR = 0
"""The status recorded when no response came (timeout, refused or broken connection)."""
PRECISE_UNTIL = 0.005
"""Requests scheduled in a replay's first 5 ms never go out early: the event loop's timers count whole
milliseconds and can fire up to one early, so the last part of the wait is spent spinning. Each client's
first request sets where HAProxy's sliding periods start (``recording.FIRST_OFFSET``)."""
HOST = "compare.test"


FAILURES = (TimeoutError, OSError, ValueError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, HttpError)


@dataclass(slots=True)
class Outcome:
    """What happened to one request of the recording (times: wall clock, seconds)."""

    index: int
    target: int
    sent: float = 0.0
    """Just before the request was written (0 when it never was)."""
    done: float = 0.0
    """Just after the response was read, or when the request failed."""
    status: int = ERROR
    error: str = ""


@dataclass
class Replay:
    """Every outcome of one replay and what the generator itself did."""

    start: int
    """The wall-clock second the recording's second 0 was put on."""
    outcomes: list[Outcome]
    connections: int = 0
    late: list[float] = field(default_factory=list)
    """Per request: seconds it went out after its scheduled time."""


async def replay(
    requests: Sequence[Planned],
    ports: Sequence[int],
    route: Callable[[int, Planned], int],
    *,
    start: int,
    connections: int,
    max_connections: int,
    timeout: float,
) -> Replay:
    """Send ``requests`` open loop, request ``i`` to ``ports[route(i, request)]`` at ``start + offset``."""
    pools = [Pool(port, max_connections) for port in ports]
    for pool in pools:
        await pool.fill(connections)
    heads = [item.head(HOST) for item in requests]
    outcomes = [Outcome(index, route(index, item)) for index, item in enumerate(requests)]
    late = [0.0] * len(requests)
    # Wall clock for the schedule's anchor, perf_counter for sleeping (it does not jump).
    anchor = time.perf_counter() + (start - time.time())

    async def one(index: int) -> None:
        outcome = outcomes[index]
        pool = pools[outcome.target]
        connection: Connection | None = None
        try:
            async with asyncio.timeout(timeout):
                connection = await pool.acquire()
                outcome.sent = time.time()
                late[index] = outcome.sent - (start + requests[index].offset)
                connection.send(heads[index])
                outcome.status = await connection.response()
                outcome.done = time.time()
        except FAILURES as error:
            outcome.done = time.time()
            outcome.status = ERROR
            outcome.error = type(error).__name__
            if connection is not None:
                connection.reusable = False
        await pool.release(connection)

    tasks: set[asyncio.Task[None]] = set()
    try:
        for index, item in enumerate(requests):
            due = anchor + item.offset
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if item.offset <= PRECISE_UNTIL:
                while time.perf_counter() < due:
                    pass
            task = asyncio.create_task(one(index))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.wait(set(tasks), timeout=timeout + 1)
    finally:
        for task in tasks:
            task.cancel()
        for pool in pools:
            pool.close()
    return Replay(start, outcomes, sum(pool.opened for pool in pools), late)


def throughput_address(number: int) -> str:
    """Address ``number`` of the closed-loop phase (10.0.0.0/8): 65,536 of them, far from the recording's."""
    return f"10.100.{number // 256 % 256}.{number % 256}"


@dataclass
class ClosedLoop:
    """Completed requests inside the measured span, their latencies and statuses."""

    seconds: float
    completed: int = 0
    """Answered inside the measured span."""
    total: int = 0
    """Answered at all, warm-up and the last in-flight ones included (what the servers' CPU time served)."""
    statuses: dict[int, int] = field(default_factory=dict)
    latencies: list[float] = field(default_factory=list)
    errors: int = 0


async def closed_loop(
    ports: Sequence[int],
    *,
    concurrency: int,
    warmup: float,
    duration: float,
    timeout: float,
    first_address: int = 0,
) -> ClosedLoop:
    """``concurrency`` connections (spread over ``ports``), each sending its next request as soon as
    the previous answers, every request from another address; measures the last ``duration`` s."""
    counter = iter(range(first_address, first_address + 10**9))
    connections = [await Connection.open(ports[index % len(ports)]) for index in range(concurrency)]
    perf = time.perf_counter
    begin = perf() + warmup
    end = begin + duration
    result = ClosedLoop(seconds=duration)

    async def worker(slot: int) -> None:
        connection: Connection | None = connections[slot]
        port = ports[slot % len(ports)]
        while perf() < end:
            address = throughput_address(next(counter))
            request = (
                f"GET /compare/throughput HTTP/1.1\r\nHost: {HOST}\r\nX-Forwarded-For: {address}\r\n\r\n"
            ).encode()
            sent = perf()
            try:
                async with asyncio.timeout(timeout):
                    if connection is None:
                        connection = await Connection.open(port)
                    connection.send(request)
                    status = await connection.response()
            except FAILURES:
                if connection is not None:
                    connection.close()
                connection = None
                if sent >= begin:
                    result.errors += 1
                continue
            done = perf()
            result.total += 1
            if not connection.reusable:
                connection.close()
                connection = None
            if sent >= begin and done <= end:
                result.completed += 1
                result.statuses[status] = result.statuses.get(status, 0) + 1
                result.latencies.append(done - sent)
        if connection is not None:
            connection.close()

    try:
        await asyncio.gather(*(worker(slot) for slot in range(concurrency)))
    finally:
        for connection in connections:
            connection.close()
    return result
