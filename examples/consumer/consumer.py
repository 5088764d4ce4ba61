"""A consumer service: N replica processes calling a provider through one shared budget.

    python examples/consumer/consumer.py --sidecars 127.0.0.1:8081,127.0.0.1:8091 \
        --provider 127.0.0.1:9000 --replicas 4 --workers 10 --seconds 5 --max-wait 1.0

Each replica is a process of its own (as a Deployment's pods would be), with one
:class:`sidecar.consumer.Consumer` talking to "its" sidecar (replica i to sidecar i mod n)
and ``--workers`` tasks that each, in a loop, wait for a slot of the ``partner`` budget
(``max_wait`` seconds at most) and then call the provider. A task refused within
``max_wait`` counts a failure and tries again. At the end every replica prints one JSON
line and this process prints their sum: calls, failures, the longest wait, and the hits
the sidecars admitted (``stats.granted``, what Redis must hold).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import subprocess
import sys
import time
from typing import Any

from sidecar.consumer import Consumer, RateLimitExceeded

DOMAIN = "partner"
DESCRIPTOR = {"provider": "acme"}
STARTUP = 3.0
"""Seconds the replicas get to start and warm up before they all begin calling."""


async def call_provider(streams: dict[str, Any], provider: str, granted_at: float) -> None:
    """One ``POST /charge`` on a kept-alive connection, stamped with the Unix time its slot was granted."""
    if "writer" not in streams:
        host, port = provider.rsplit(":", 1)
        streams["reader"], streams["writer"] = await asyncio.open_connection(host, int(port))
    streams["writer"].write(
        b"POST /charge HTTP/1.1\r\nhost: provider\r\nx-granted-at: %.6f\r\ncontent-length: 0\r\n\r\n" % granted_at
    )
    head = await streams["reader"].readuntil(b"\r\n\r\n")
    length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
    await streams["reader"].readexactly(length)


async def replica(
    sidecar: str, provider: str, *, workers: int, seconds: float, max_wait: float, start_at: float
) -> dict[str, Any]:
    """``workers`` callers from ``start_at`` (Unix time, shared by every replica) for ``seconds``."""
    waits: list[float] = []
    failures: list[float] = []

    async def worker(consumer: Consumer, streams: dict[str, Any]) -> None:
        while time.monotonic() < stop_at:
            started = time.monotonic()
            try:
                async with consumer.slot(DOMAIN, DESCRIPTOR, max_wait=max_wait):
                    waits.append(time.monotonic() - started)
                    await call_provider(streams, provider, time.time())
            except RateLimitExceeded:
                failures.append(time.monotonic() - started)
        if "writer" in streams:
            streams["writer"].close()

    async with Consumer(sidecar) as consumer:
        # Warm up as a running service is: the sidecar's channel and the provider's connections
        # open, so that a call follows its admission by a millisecond, not by a connection setup.
        await consumer.acquire("warm-up", {"nothing": "limited"})  # no such domain: admitted, nothing counted
        warm_up = consumer.stats.granted
        streams = [{} for _ in range(workers)]
        for one in streams:
            host, port = provider.rsplit(":", 1)
            one["reader"], one["writer"] = await asyncio.open_connection(host, int(port))
        await asyncio.sleep(max(0.0, start_at - time.time()))
        stop_at = time.monotonic() + seconds
        await asyncio.gather(*(worker(consumer, one) for one in streams))
    stats = consumer.stats  # after close: asks still in flight have been counted
    return {
        "calls": len(waits),
        "failures": len(failures),
        "longest_wait": max(waits, default=0.0),
        "longest_failure": max(failures, default=0.0),
        "granted": stats.granted - warm_up,
        "orphaned": stats.orphaned,
        "paced": stats.paced,
        "out_of_turn": stats.out_of_turn,
        "timed_out": stats.timed_out,
        "unanswered": stats.unanswered,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sidecars", required=True, help="comma-separated gRPC addresses, one per sidecar replica")
    parser.add_argument("--provider", required=True, help="HOST:PORT of the provider")
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--workers", type=int, default=10, help="concurrent callers per replica")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--max-wait", type=float, default=1.0)
    parser.add_argument("--replica-index", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--start-at", type=float, help=argparse.SUPPRESS)
    arguments = parser.parse_args(argv)
    sidecars = arguments.sidecars.split(",")
    if arguments.replica_index is not None:  # one replica process
        sidecar = sidecars[arguments.replica_index % len(sidecars)]
        result = asyncio.run(
            replica(
                sidecar,
                arguments.provider,
                workers=arguments.workers,
                seconds=arguments.seconds,
                max_wait=arguments.max_wait,
                start_at=arguments.start_at or time.time(),
            )
        )
        print(json.dumps(result), flush=True)
        return 0
    forwarded = list(argv if argv is not None else sys.argv[1:])
    # Every replica starts calling at once, warmed up, in the middle of a clock second: the
    # first window's grants are stamped when each caller resumes, which a machine busy with
    # the replicas' start can delay by tens of ms, past a boundary that came right after.
    start_at = f"{math.floor(time.time() + STARTUP) + 0.5:.3f}"
    processes = [
        subprocess.Popen(
            [sys.executable, __file__, *forwarded, "--replica-index", str(index), "--start-at", start_at],
            stdout=subprocess.PIPE,
            text=True,
        )
        for index in range(arguments.replicas)
    ]
    results = []
    for process in processes:
        out, _ = process.communicate(timeout=arguments.seconds + arguments.max_wait + 60)
        if process.returncode != 0:
            raise SystemExit(f"a replica exited with {process.returncode}")
        results.append(json.loads(out.strip().splitlines()[-1]))
    total = {
        "replicas": len(results),
        "calls": sum(r["calls"] for r in results),
        "failures": sum(r["failures"] for r in results),
        "longest_wait": max(r["longest_wait"] for r in results),
        "longest_failure": max(r["longest_failure"] for r in results),
        "granted": sum(r["granted"] for r in results),
        "orphaned": sum(r["orphaned"] for r in results),
        "paced": sum(r["paced"] for r in results),
        "out_of_turn": sum(r["out_of_turn"] for r in results),
        "timed_out": sum(r["timed_out"] for r in results),
        "unanswered": sum(r["unanswered"] for r in results),
    }
    print(json.dumps(total), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
