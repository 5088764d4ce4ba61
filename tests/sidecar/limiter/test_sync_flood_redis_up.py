"""Sync mode: a unique-key flood past ``--max-counters`` while Redis answers, against real redis-server.

The hard cap of issue 21 (defect 3) is for outages. With Redis up, a flood that passes the
cap before any flush (every counter then holds hits Redis lacks) must be admitted as below
the cap, and every admitted hit must reach Redis: a counter with unflushed hits is never
forgotten, and none is "used for one request only". Before the fix such counters were not
remembered, their requests escalated with the 5 ms budget and, timed out, were refused by
the ``local`` failure mode (the harness saw 50 of 64 calls refused), and the late answers
took hits off counters whose requests had been refused (Redis lacked 40 admitted hits).
"""

from __future__ import annotations

import asyncio

from sidecar.limiter.protocol import Check, Role
from sidecar.limiter.redis.keys import counter_window
from sidecar.limiter.sync import SyncLimiter
from tests.sidecar.limiter.conftest import Fleet, steady_now
from tests.sidecar.limiter.test_sync_hardening import UNIT, sum_counters
from tests.support.redis_servers import RedisServer, fresh_prefix

CAP = 1000
PER_CALL = 64
VALUES = 4096
"""Four times the cap, all in one flush interval: every counter holds unflushed hits."""
LANES = 8
LIMIT = 1000


def checks_of(tag: str, first: int) -> list[Check]:
    return [
        Check(("flood", f"{tag}-{index}"), UNIT, LIMIT, 1, Role.ENFORCED)
        for index in range(first, min(VALUES, first + PER_CALL))
    ]


async def flood(limiter: SyncLimiter, now: float, tag: str) -> tuple[int, int, int]:
    """``VALUES`` unique values in calls of ``PER_CALL``, ``LANES`` calls at a time:
    (calls, admitted calls, peak live counters)."""
    firsts = iter(range(0, VALUES, PER_CALL))
    calls = admitted = peak = 0

    async def lane() -> None:
        nonlocal calls, admitted, peak
        for first in firsts:
            decision = await limiter.check(checks_of(tag, first), now)
            calls += 1
            admitted += decision.admitted
            peak = max(peak, limiter.live_counters)

    await asyncio.gather(*(lane() for _ in range(LANES)))
    return calls, admitted, peak


def held(server: RedisServer, prefix: str, tag: str, now: float) -> dict[int, int]:
    """Per value index, what Redis holds (only values it holds are listed)."""
    names = [counter_window(prefix, ("flood", f"{tag}-{index}"), UNIT, now)[0] for index in range(VALUES)]
    return {index: int(value) for index, value in enumerate(server.client().mget(names)) if value is not None}


async def test_a_flood_past_the_cap_before_any_flush_is_admitted_and_loses_no_hit(
    redis_server: RedisServer, fleet: Fleet
) -> None:
    prefix = fresh_prefix("u")
    # No periodic flush during the flood (the harness: --sync-interval 2), the default 5 ms budget.
    limiter = fleet.build(
        redis_server.url, redis_prefix=prefix, max_counters=CAP, redis_timeout=0.005, sync_interval=60.0
    )
    await limiter.start()
    now = await steady_now()

    calls, admitted, peak = await flood(limiter, now, "a")
    assert admitted == calls, f"{calls - admitted} of {calls} calls refused with Redis up"
    assert peak <= CAP, f"{peak} live counters: --max-counters is a hard cap"
    assert limiter.evictions >= VALUES - CAP, "counters whose hits Redis holds make room"
    assert limiter.escalations == 0, "Redis up, one replica, far from the limit: decided locally"
    assert (limiter.dropped_hits, limiter.expired_hits) == (0, 0)

    await limiter.close()  # the last flush
    counts = held(redis_server, prefix, "a", now)
    wrong = {index: counts.get(index, 0) for index in range(VALUES) if counts.get(index, 0) != 1}
    assert not wrong, f"{len(wrong)} counters wrong in Redis (index: hits), e.g. {dict(list(wrong.items())[:5])}"
    assert sum_counters(redis_server, prefix) == VALUES, "every admitted hit, once"
