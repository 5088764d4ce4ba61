"""Consumers on two sidecar replicas share one budget through a real redis-server (sync mode).

Fifty callers (two :class:`~sidecar.consumer.Consumer` objects, one per replica) want
far more than a limit of 20 per second for five seconds; ten of them give up at random
moments (cancelled while sleeping or while their ask is in flight). Redis's own window
keys, read every 250 ms, are the authority on what was admitted. The test holds:

* every full window admitted exactly the limit, within sync mode's bound
  (``(R - 1) * Q`` with ``Q = floor(0.05 * 20 / 1) = 1``: at most 21; docs/redis.md);
* a call that failed had seen the next budget come too late for its ``max_wait``; with a
  minute's budget spent, a 3 s ``max_wait`` fails with the minute's end as its retry time;
* Redis's counters equal the hits the sidecars admitted (``stats.granted``): cancelled
  waits spent nothing, and asks admitted after their caller left are counted there; the
  one unknown is an ask cut by its gRPC deadline (``stats.unanswered``), which Redis may
  hold or not.

How long a call waits (never past ``max_wait`` plus the answer slack; failing without
waiting when the next budget comes too late) is asserted on a virtual clock in
``test_consumer_herd.py``: measured here in wall time it would say more about the
machine's load than about the consumer.
"""

from __future__ import annotations

import asyncio
import random
import re
import time
from pathlib import Path
from typing import Any

import pytest

from sidecar.consumer import WAIT, Consumer, RateLimitExceeded
from tests.support.redis_servers import RedisServer, fresh_prefix
from tests.support.sidecars import SidecarFactory, write_config
from tests.support.windows import ensure_left_async

pytestmark = [pytest.mark.slow, pytest.mark.redis]

LIMIT = 20
BOUND = 1
"""Sync mode's overshoot bound here: (R - 1) * floor(0.05 * LIMIT / (R - 1)) with R = 2."""
RUN_SECONDS = 5.0
MAX_WAIT = 1.5

CONFIG = f"""\
domain: consume
descriptors:
  - key: provider
    rate_limit:
      unit: second
      requests_per_unit: {LIMIT}
  - key: daily_provider
    rate_limit:
      unit: minute
      requests_per_unit: 5
"""


def start_replicas(start_sidecar: SidecarFactory, redis: RedisServer, config: Path, prefix: str) -> list[Any]:
    flags = [
        "--backend", "redis", "--mode", "sync", "--redis-url", redis.url, "--redis-prefix", prefix,
        "--clock-source", "local", "--heartbeat-interval", "0.2",
    ]  # fmt: skip
    replicas = [start_sidecar(*flags, config=config) for _ in range(2)]
    client = redis.client()
    deadline = time.monotonic() + 10
    while client.zcard(f"{prefix}:replicas") < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)  # a heartbeat or two: each has read the live count of 2
    return replicas


class WindowKeys:
    """The largest value seen of every window key under ``prefix`` (keys live 5 s past their window)."""

    def __init__(self, redis: RedisServer, prefix: str) -> None:
        self.client = redis.client()
        self.pattern = re.compile(re.escape(prefix) + r":\{[0-9a-f]+\}:(\d+)$")
        self.prefix = prefix
        self.seen: dict[str, int] = {}

    def read(self) -> None:
        for key in self.client.scan_iter(f"{self.prefix}:*", count=1000):
            if self.pattern.match(key):
                value = self.client.get(key)
                if value is not None:
                    self.seen[key] = max(self.seen.get(key, 0), int(value))

    def per_window(self, digest_of: str | None = None) -> dict[int, int]:
        windows: dict[int, int] = {}
        for key, value in self.seen.items():
            match = self.pattern.match(key)
            assert match is not None
            windows[int(match.group(1))] = windows.get(int(match.group(1)), 0) + value
        return windows


async def test_consumers_share_the_limit_wait_within_max_wait_and_spend_only_what_was_admitted(
    start_sidecar: SidecarFactory, redis_server: RedisServer, tmp_path: Path
) -> None:
    prefix = fresh_prefix("c")
    replicas = start_replicas(start_sidecar, redis_server, write_config(tmp_path / "config", CONFIG), prefix)
    consumers = [Consumer(replica.address, rng=random.Random(index)) for index, replica in enumerate(replicas)]
    keys = WindowKeys(redis_server, prefix)
    calls: list[tuple[float, float, bool, float | None]] = []  # (max_wait, elapsed, admitted, retry_after)
    stop_at = time.monotonic() + RUN_SECONDS
    rng = random.Random(20)

    async def worker(consumer: Consumer) -> None:
        while time.monotonic() < stop_at:
            started = time.monotonic()
            try:
                await consumer.acquire("consume", {"provider": "acme"}, max_wait=MAX_WAIT)
            except RateLimitExceeded as failed:
                calls.append((MAX_WAIT, time.monotonic() - started, False, failed.retry_after))
            else:
                calls.append((MAX_WAIT, time.monotonic() - started, True, None))
                await asyncio.sleep(0.01)  # the provider call

    async def quitter(consumer: Consumer) -> None:
        while time.monotonic() < stop_at:
            try:
                async with asyncio.timeout(rng.uniform(0.001, 0.8)):
                    await consumer.acquire("consume", {"provider": "acme"}, max_wait=WAIT)
            except TimeoutError:
                pass

    async def sample() -> None:
        while time.monotonic() < stop_at + 0.5:
            await asyncio.to_thread(keys.read)
            await asyncio.sleep(0.25)

    tasks = [worker(consumers[index % 2]) for index in range(40)] + [
        quitter(consumers[index % 2]) for index in range(10)
    ]
    await asyncio.gather(sample(), *tasks)
    for consumer in consumers:
        await consumer.close()  # asks still in flight finish and are counted
    await asyncio.sleep(0.4)  # the replicas' last flushes (every 50 ms)
    keys.read()

    granted = sum(consumer.stats.granted for consumer in consumers)
    windows = keys.per_window()
    unanswered = sum(consumer.stats.unanswered for consumer in consumers)
    assert granted <= sum(windows.values()) <= granted + unanswered, (windows, [c.stats for c in consumers])
    full = sorted(windows)[1:-1]  # the first and last windows of the run are partial
    assert len(full) >= 3
    for start in full:
        assert LIMIT <= windows[start] <= LIMIT + BOUND, (start, windows)

    failures = [(elapsed, retry_after) for _, elapsed, admitted, retry_after in calls if not admitted]
    assert failures, "the demand was meant to exceed what 1.5 s of waiting can serve"
    for elapsed, retry_after in failures:
        if retry_after is not None:  # failed fast: the next budget came after the deadline, less the
            # time kept for an answer (twice the average round trip: tens of ms on a loaded machine)
            assert elapsed + retry_after > MAX_WAIT - 0.15
    stats = [consumer.stats for consumer in consumers]
    print(  # the figures docs/consumer.md quotes (pytest -s shows them)
        f"windows {[windows[start] for start in full]}; {len(calls)} calls, {len(failures)} failed, slowest "
        f"{max(elapsed for _, elapsed, _, _ in calls):.3f} s, failures after {min(f[0] for f in failures):.3f}"
        f"-{max(f[0] for f in failures):.3f} s; " + "; ".join(str(s) for s in stats)
    )
    assert sum(s.cancelled for s in stats) > 0
    for s in stats:
        assert s.granted == s.acquired - s.reused + s.orphaned

    # A spent minute: a 3 s max_wait cannot be served; the failure names the minute's end.
    await ensure_left_async(60, needed=15)  # the minute's five and the sixth, all in one minute
    # Unpaced: paced, the five are spread over what is left of the minute (with 15-20 s
    # left, four turns of 3-4 s each, within the default max_wait).
    async with Consumer(replicas[0].address, pace=False) as consumer:
        for _ in range(5):
            await consumer.acquire("consume", {"daily_provider": "x"})
        assert 60 - time.time() % 60 > 3.5, "the five took most of a minute"
        with pytest.raises(RateLimitExceeded) as spent:
            await consumer.acquire("consume", {"daily_provider": "x"}, max_wait=3)
        assert spent.value.retry_after is not None and spent.value.retry_after > 3
