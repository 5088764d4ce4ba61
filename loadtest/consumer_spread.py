"""How evenly waiting consumers spend a window's budget: sidecar.consumer against plain retry-on-429.

Starts its own redis-server and two sync-mode sidecar replicas on free 127.0.0.1 ports (stack/)
(``--clock-source local``, so this host's clock cuts the same windows), with one limit of
``--limit`` per second, then runs ``--waiters`` callers for ``--seconds`` per strategy,
each calling again once served and done with its provider call (``--work``, 10 ms):

- ``retry-after``: refused, sleep the reported reset (whole seconds, as a client honouring
  ``Retry-After`` does) and ask again;
- ``boundary``: :class:`~sidecar.consumer.Consumer` with ``spread=False``: retry exactly at
  the window boundary, fresh asks at once;
- ``jitter``: :class:`~sidecar.consumer.Consumer` with ``pace=False``: retry at the boundary
  plus a uniform jitter over the window, fresh asks at once (what shipped first);
- ``consumer``: :class:`~sidecar.consumer.Consumer` as shipped: the jitter, and every ask
  paced at ``hits * T / (remaining + hits)`` after the previous one (time left in the
  window, hits left, from the sidecar's last answer).

For each, over the full windows of the run: admissions per window, the share of a window's
admissions in its busiest 100 ms and in its first 100 ms, and the coefficient of variation of
admissions over the window's ten 100 ms slices (0 for a perfectly even rate; 3 when all of
them land in one slice). Bounded: four runs of ``--seconds``, then everything is stopped.

    python -m loadtest.consumer_spread --waiters 40 --limit 20 --seconds 4
"""

from __future__ import annotations

import argparse
import asyncio
import math
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

from sidecar.consumer import Consumer, RateLimitExceeded, request_payload
from sidecar.consumer_pace import refusal
from stack import redis as stack_redis
from stack.processes import process_group
from stack.redis import RedisProcess
from stack.sidecar import SidecarProcess

STRATEGIES = ("retry-after", "boundary", "jitter", "consumer")
SLICES = 10


@contextmanager
def replicas(limit: int, directory: Path) -> Iterator[list[str]]:
    """redis-server and two sync-mode sidecars (stack/ launchers); yields their gRPC addresses; stops them all."""
    if not stack_redis.available():
        raise SystemExit("redis-server is not on PATH")
    config = directory / "config"
    config.mkdir()
    (config / "spread.yaml").write_text(
        f"domain: spread\ndescriptors:\n  - key: provider\n    rate_limit:\n      unit: second\n"
        f"      requests_per_unit: {limit}\n"
    )
    with process_group() as group:
        redis = group.start_ready(lambda: RedisProcess(directory))
        serve_args = [
            "--config", str(config), "--backend", "redis", "--mode", "sync", "--redis-url", redis.url,
            "--clock-source", "local", "--heartbeat-interval", "0.2", "--log-level", "warning",
        ]  # fmt: skip
        sidecars = [
            group.start_ready(partial(SidecarProcess, f"sidecar-{index}", serve_args, directory)) for index in range(2)
        ]
        time.sleep(1.0)  # heartbeats: each replica counts the other
        yield [sidecar.address for sidecar in sidecars]


async def run_strategy(strategy: str, addresses: list[str], waiters: int, seconds: float, work: float) -> list[float]:
    """Admission times (this host's Unix clock) of ``waiters`` callers for ``seconds``."""
    consumers = [
        Consumer(address, spread=strategy in ("jitter", "consumer"), pace=strategy == "consumer")
        for address in addresses
    ]
    admitted: list[float] = []
    stop_at = time.monotonic() + seconds
    payload = request_payload("spread", {"provider": "acme"}, 1)

    async def retry_after(consumer: Consumer) -> None:
        while time.monotonic() < stop_at:
            response = await consumer._ask(payload, timeout=consumer.rpc_timeout)
            if response.overall_code == 1:  # OK
                admitted.append(time.time())
                await asyncio.sleep(work)
            else:
                await asyncio.sleep(refusal(response).reset)

    async def waiting(consumer: Consumer) -> None:
        while time.monotonic() < stop_at:
            try:
                await consumer.acquire("spread", {"provider": "acme"}, max_wait=max(0.0, stop_at - time.monotonic()))
            except RateLimitExceeded:
                continue
            admitted.append(time.time())
            await asyncio.sleep(work)

    body: Callable[[Consumer], Any] = retry_after if strategy == "retry-after" else waiting
    await asyncio.gather(*(body(consumers[index % len(consumers)]) for index in range(waiters)))
    for consumer in consumers:
        await consumer.close()
    return admitted


def spread(admitted: list[float]) -> dict[str, float]:
    """The figures of one strategy, over the full windows (the first and last are partial)."""
    by_window: dict[int, list[float]] = {}
    for moment in admitted:
        by_window.setdefault(math.floor(moment), []).append(moment - math.floor(moment))
    full = sorted(by_window)[1:-1]
    counts, busiest, first, variation = [], [], [], []
    for start in full:
        offsets = by_window[start]
        slices = [0] * SLICES
        for offset in offsets:
            slices[min(SLICES - 1, int(offset * SLICES))] += 1
        counts.append(len(offsets))
        busiest.append(max(slices) / len(offsets))
        first.append(slices[0] / len(offsets))
        mean = statistics.fmean(slices)
        variation.append(statistics.pstdev(slices) / mean if mean else 0.0)
    return {
        "windows": float(len(full)),
        "per_window": statistics.fmean(counts) if counts else 0.0,
        "busiest_100ms": statistics.fmean(busiest) if busiest else 0.0,
        "first_100ms": statistics.fmean(first) if first else 0.0,
        "cv": statistics.fmean(variation) if variation else 0.0,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--waiters", type=int, default=40)
    parser.add_argument("--limit", type=int, default=20)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--work", type=float, default=0.01, help="seconds a served caller works before calling again")
    arguments = parser.parse_args(argv)
    with (
        tempfile.TemporaryDirectory(prefix="consumer-spread-") as temporary,
        replicas(arguments.limit, Path(temporary)) as addresses,
    ):
        print(
            f"{arguments.waiters} waiters on 2 sync-mode replicas, limit {arguments.limit}/s, "
            f"{arguments.seconds:g} s per strategy, {arguments.work:g} s of work per call"
        )
        print(
            "| strategy | full windows | admitted per window | busiest 100 ms | first 100 ms | CV over 100 ms slices |"
        )
        print("|---|---|---|---|---|---|")
        for strategy in STRATEGIES:
            figures = spread(
                asyncio.run(run_strategy(strategy, addresses, arguments.waiters, arguments.seconds, arguments.work))
            )
            print(
                f"| {strategy} | {figures['windows']:.0f} | {figures['per_window']:.1f} | "
                f"{figures['busiest_100ms']:.0%} | {figures['first_100ms']:.0%} | {figures['cv']:.2f} |"
            )
            time.sleep(1.0)  # the next strategy starts in a fresh window
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
