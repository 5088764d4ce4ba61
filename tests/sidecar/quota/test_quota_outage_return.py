"""Quota heartbeats (``<prefix>:quota:replicas``) through a Redis outage (issue 31): a quota
replica back before its peer keeps the count from before the outage, as the limiters'
heartbeats do (docs/redis.md, "Returning from an outage"), instead of counting itself alone.

Before, :class:`RedisShares` did not follow outages: the first beat after Redis came back
without its data found this replica's beat only, and the live count dropped to 1 until the
peer beat again (up to an interval, or as long as the peer's probe took)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest

from sidecar.limiter.redis.keys import replicas_key
from sidecar.limiter.redis.replicas import Replicas
from sidecar.limiter.redis.store import RedisStore
from sidecar.quota.redis_shares import RedisShares
from tests.support import outages
from tests.support.redis_servers import RedisServer, fresh_prefix

pytestmark = [pytest.mark.slow, pytest.mark.serial]

INTERVAL = 1.0
"""Heartbeat interval: three of them (3 s) outlast the peer's held-down probe."""
HELD = 0.5
"""Seconds the peer's probe is kept failing after Redis is back."""
WAIT = 15.0
"""Bounds each wait for a state change (never a measured time)."""


async def until(condition: Callable[[], object], what: str) -> None:
    await outages.until(condition, what, WAIT)


async def test_a_quota_replica_back_first_keeps_the_count_from_before_the_outage(own_redis: RedisServer) -> None:
    prefix = fresh_prefix("qo")
    shares: list[RedisShares] = []
    for _ in range(2):
        store = RedisStore.for_url(own_redis.url, prefix=prefix, redis_timeout=0.2)
        store.replicas_key = replicas_key(prefix + ":quota")  # as build_quota_leases does
        shares.append(RedisShares(store, Replicas(store, INTERVAL)))
    first, second = shares
    try:
        for each in shares:
            await each.start()
        assert first.replicas is not None and second.replicas is not None
        assert await first.replicas.beat() == 2
        own_redis.kill()
        for each in shares:
            deadline = time.monotonic() + WAIT
            while each.store.available:  # a beat on the killed server marks it down
                assert time.monotonic() < deadline, "the outage never noticed"
                assert each.replicas is not None
                await each.replicas.beat()
                await asyncio.sleep(0.01)
        held = outages.hold_probe(second.store)
        await asyncio.to_thread(own_redis.start)  # its data lost: no beat at all in Redis
        await until(lambda: first.store.available, "the first replica back")
        seen = []
        ends = time.monotonic() + HELD
        while time.monotonic() < ends:
            seen.append(await first.replicas.beat())  # a beat finding only its own
            await asyncio.sleep(0.05)
        held[0] = False
        await until(lambda: second.store.available, "the second replica back")
        await until(lambda: not first.replicas.returning, "the first replica settled")
        assert set(seen) == {2}, f"live counts while the peer was away: {seen}"
        assert await first.replicas.beat() == 2
    finally:
        for each in shares:
            await each.close()
