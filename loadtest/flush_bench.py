"""Client CPU of one sync-mode flush: one ``flush_batch.lua`` call against one script per counter.

Starts its own redis-server on a free 127.0.0.1 port, then times
``RedisStore.flush`` with ``--counters`` counters, each flush a new sequence number
as a sync replica sends them, in alternating rounds of the two ways a flush can go:

- ``batch``: plain Redis, the whole flush as one ``flush_batch.lua`` call (the default);
- ``per-counter``: one ``flush_once.lua`` call per counter, pipelined, which is how a
  flush goes to Redis Cluster (forced here on plain Redis to compare like with like).

Prints the median client CPU (this process) and wall time per flush of each, and
their ratio. Bounded: ``--rounds`` x ``--flushes`` flushes, then Redis is stopped.

    python -m loadtest.flush_bench --counters 130 --flushes 50 --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time

from redis.asyncio import Redis

from loadtest.common import positive_int
from sidecar.limiter.redis.store import RedisStore
from stack import redis as stack_redis
from stack.processes import free_port, spawn

WAYS = ("batch", "per-counter")


async def time_flushes(store: RedisStore, counters: int, flushes: int, first_sequence: int) -> tuple[float, float]:
    """Client CPU and wall seconds per flush, over ``flushes`` flushes of ``counters`` counters."""
    expire_at = int(time.time()) + 60
    keys = [f"{store.prefix}:{{bench-{n}}}:0" for n in range(counters)]
    cpu, wall = time.process_time(), time.perf_counter()
    for sequence in range(first_sequence, first_sequence + flushes):
        await store.flush({key: (1, expire_at) for key in keys}, once=("bench", sequence))
    return (time.process_time() - cpu) / flushes, (time.perf_counter() - wall) / flushes


async def measure(port: int, arguments: argparse.Namespace) -> dict[str, list[tuple[float, float]]]:
    """Alternating rounds of both ways; per way, one (cpu, wall) per round."""
    client = Redis(host="127.0.0.1", port=port)
    store = RedisStore(client)
    await store.start()
    results: dict[str, list[tuple[float, float]]] = {way: [] for way in WAYS}
    sequence = 1
    try:
        await time_flushes(store, arguments.counters, 5, sequence)  # warm up connection and scripts
        sequence += 5
        for round_number in range(arguments.rounds):
            order = WAYS if round_number % 2 == 0 else WAYS[::-1]
            for way in order:
                store.cluster = way == "per-counter"  # the Cluster path: one script per counter
                results[way].append(await time_flushes(store, arguments.counters, arguments.flushes, sequence))
                sequence += arguments.flushes
    finally:
        store.cluster = False
        await store.close()
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--counters", type=positive_int, default=130, help="counters per flush (default 130)")
    parser.add_argument("--flushes", type=positive_int, default=50, help="flushes per round (default 50)")
    parser.add_argument("--rounds", type=positive_int, default=5, help="alternating rounds (default 5)")
    arguments = parser.parse_args()
    if not stack_redis.available():
        print("flush_bench: redis-server not found (scripts/test installs it when run as root)", file=sys.stderr)
        return 1
    port = free_port()
    redis = spawn(stack_redis.server_argv(port), stdout=subprocess.DEVNULL)
    try:
        time.sleep(0.3)
        results = asyncio.run(measure(port, arguments))
    finally:
        redis.terminate()
        redis.wait(timeout=10)
    print(
        f"command: python -m loadtest.flush_bench --counters {arguments.counters} "
        f"--flushes {arguments.flushes} --rounds {arguments.rounds}"
    )
    medians = {}
    for way in WAYS:
        cpu = statistics.median(cpu for cpu, _ in results[way]) * 1e3
        wall = statistics.median(wall for _, wall in results[way]) * 1e3
        medians[way] = cpu
        print(f"  {way:12s} client CPU {cpu:6.2f} ms per flush, wall {wall:6.2f} ms (median of {arguments.rounds})")
    print(f"  per-counter / batch client CPU: {medians['per-counter'] / medians['batch']:.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
