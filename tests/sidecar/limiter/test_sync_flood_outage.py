"""Sync mode: a unique-key flood during a Redis outage (issue 21, defect 3), against real redis-server.

``--max-counters`` is a hard cap whatever the counters hold: during an outage every
counter holds hits Redis lacks and cannot be forgotten, and before the fix nothing
capped them (1,000 allowed, 28,864 kept) while every new counter scanned them all
(a call of 64 new values went from 0.2 to 80 ms). Now a call costs the same at the cap
as below it; in the ``local`` failure mode every hit admitted during the outage reaches
Redis when it comes back (a counter that cannot be remembered is refused, not admitted
and lost), and in ``open`` mode such hits are admitted and counted as dropped.
"""

from __future__ import annotations

import asyncio
import time

from sidecar.limiter.protocol import Check, Role
from sidecar.limiter.sync import SyncLimiter
from tests.sidecar.limiter.conftest import Fleet, steady_now
from tests.sidecar.limiter.test_sync_hardening import UNIT, sum_counters
from tests.support.redis_servers import RedisServer, fresh_prefix

CAP = 1000
PER_CALL = 64
CALLS = 300
"""19,200 unique counters against a cap of 1,000: before the fix every one was kept."""


async def flood(limiter: SyncLimiter, now: float, tag: str, calls: int = CALLS) -> tuple[int, int]:
    """``calls`` requests of ``PER_CALL`` unique values each; returns (hits admitted, counters
    the table's scans for room read meanwhile: the work, counted instead of timed)."""
    admitted = 0
    reads = [0]
    table = limiter.table
    evict = table._evict

    def counted(moment: float) -> int:
        read = evict(moment)
        reads[0] += read
        return read

    table._evict = counted  # type: ignore[method-assign]
    try:
        for call in range(calls):
            checks = [
                Check(("flood", f"{tag}-{call}-{index}"), UNIT, 10, 1, Role.ENFORCED) for index in range(PER_CALL)
            ]
            decision = await limiter.check(checks, now)
            admitted += PER_CALL if decision.admitted else 0
            assert limiter.live_counters <= CAP, f"{limiter.live_counters} live counters after call {call}"
    finally:
        del table._evict
    return admitted, reads[0]


async def down(server: RedisServer, limiter: SyncLimiter) -> None:
    """Stop Redis and wait until the limiter knows (a heartbeat fails)."""
    server.kill()
    deadline = time.monotonic() + 5
    while limiter.store.available:
        assert time.monotonic() < deadline, "the limiter never noticed the outage"
        await limiter.replicas.beat()
        await asyncio.sleep(0.01)


async def test_a_unique_key_flood_during_an_outage_keeps_the_cap_and_loses_no_admitted_hit(
    own_redis: RedisServer, fleet: Fleet
) -> None:
    prefix = fresh_prefix("f")
    limiter = fleet.build(own_redis.url, redis_prefix=prefix, max_counters=CAP, redis_timeout=0.005)
    await limiter.start()
    now = await steady_now()
    await down(own_redis, limiter)

    admitted, read = await flood(limiter, now, "a")
    assert limiter.live_counters <= CAP
    assert 0 < admitted <= CAP, "the local failure mode admits only counters it can remember"
    # Counted, not timed: O(1) scan work per new counter, amortised (before the fix each
    # new counter at the cap read every live one: ~18 million reads here).
    assert read <= 2 * CALLS * PER_CALL + CAP, f"{CALLS * PER_CALL} new counters read {read:,} counters"
    assert limiter.dropped_hits == 0

    await asyncio.to_thread(own_redis.start)
    deadline = time.monotonic() + 10
    while sum_counters(own_redis, prefix) < admitted:
        assert time.monotonic() < deadline, f"Redis holds {sum_counters(own_redis, prefix)} of {admitted}"
        await asyncio.sleep(0.05)
    await limiter.close()
    assert sum_counters(own_redis, prefix) == admitted, "every hit admitted during the outage reaches Redis"

    # Once Redis holds them, the counters can be forgotten again: new values are admitted.
    second = fleet.build(own_redis.url, redis_prefix=prefix, max_counters=CAP, redis_timeout=0.5)
    await second.start()
    more, _ = await flood(second, now, "b", calls=40)
    assert more == 40 * PER_CALL


async def test_open_mode_admits_what_it_cannot_remember_and_counts_the_drop(
    own_redis: RedisServer, fleet: Fleet
) -> None:
    prefix = fresh_prefix("o")
    limiter = fleet.build(
        own_redis.url, redis_prefix=prefix, max_counters=CAP, redis_timeout=0.005, redis_failure_mode="open"
    )
    await limiter.start()
    now = await steady_now()
    await down(own_redis, limiter)
    admitted, read = await flood(limiter, now, "o", calls=100)
    assert admitted == 100 * PER_CALL
    assert limiter.live_counters <= CAP
    assert limiter.dropped_hits == admitted - limiter.live_counters
    # O(1) per new counter, amortised: a scan that finds no room is not repeated for as
    # many new counters as it read. Before the fix each one read the whole table (~5 million).
    assert read <= 2 * admitted + CAP, f"{admitted} new counters read {read:,} counters"
