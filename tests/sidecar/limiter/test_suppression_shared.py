"""``overload: suppress`` across replicas on a real redis-server: the attempted demand is
shared, so three replicas seeing a third of the traffic each apply the ``p`` one replica
seeing all of it applies (sync: flushed with the batch and read back; strict: added by
each request's own script call, which answers with the total)."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Callable

import pytest

from sidecar.limiter.protocol import Check
from sidecar.limiter.redis.keys import counter_digest
from sidecar.limiter.strict import StrictLimiter
from sidecar.limiter.suppression import slot_of
from sidecar.limiter.sync import SyncLimiter
from sidecar.server import build_redis_limiter
from tests.support.redis_servers import RedisServer, fresh_prefix, redis_settings

pytestmark = pytest.mark.slow

LIMIT = 50
"""Per second: 5 hits per 100 ms sub-interval."""
RATE = 3 * LIMIT
SECONDS = 1.5


def check(name: str) -> Check:
    return Check((name,), 1, LIMIT, 1, suppress=True)


Replica = SyncLimiter | StrictLimiter


@pytest.fixture(params=["sync", "strict"])
async def fleet(
    request: pytest.FixtureRequest, redis_server: RedisServer
) -> AsyncIterator[Callable[[int], asyncio.Future[list[Replica]]]]:
    made: list[Replica] = []
    mode = request.param

    async def build(count: int) -> list[Replica]:
        settings = redis_settings(
            redis_server.url, mode, 2.0, redis_prefix=fresh_prefix("sup"), heartbeat_interval=0.5, sync_interval=0.05
        )
        limiters = [build_redis_limiter(settings) for _ in range(count)]
        replicas = [limiter for limiter in limiters if isinstance(limiter, SyncLimiter | StrictLimiter)]
        for index, limiter in enumerate(replicas):
            limiter.suppression.random.seed(index)
            await limiter.start()
        for limiter in replicas:
            await limiter.replicas.beat()
        made.extend(replicas)
        return replicas

    yield build  # type: ignore[misc]
    await asyncio.gather(*(limiter.close() for limiter in made))


async def drive(alone: Replica, three: list[Replica]) -> float:
    """Send :data:`RATE` requests a second for about :data:`SECONDS`: each to the lone replica
    (counter ``alone``) and, round robin, to one of the three (counter ``three``): the same
    demand. Returns when it stopped: the end of a sub-interval."""
    started = time.time()
    stop = math.ceil((started + SECONDS) * 10) / 10  # on a sub-interval's end: the last one is whole
    sent = 0
    while (elapsed := time.time() - started) < stop - started:
        while sent < int(elapsed * RATE):
            now = time.time()
            await alone.check([check("alone")], now)
            await three[sent % len(three)].check([check("three")], now)
            sent += 1
        await asyncio.sleep(0.005)
    return stop


async def settled(replica: Replica, name: str) -> tuple[list[int], float]:
    """The counts of the last two complete sub-intervals and the ``p`` they give, once every
    replica's attempts in them are in (sync: a flush reads them back; strict: each script call
    answered with the total then)."""
    if isinstance(replica, SyncLimiter):
        await replica.sync_once()
    demand = replica.suppression.demands[(name,)]
    slot = slot_of(time.time(), demand.length_ms)
    return [demand.count(slot - 1), demand.count(slot - 2)], demand.probability(slot, LIMIT)


@pytest.mark.serial  # drives a request rate a starved loop cannot hold
async def test_three_replicas_apply_the_global_p_of_one_seeing_everything(fleet, redis_server: RedisServer) -> None:
    (alone,) = await fleet(1)
    three = await fleet(3)
    stop = await drive(alone, three)
    await asyncio.sleep(max(0.0, stop + 0.01 - time.time()))  # the last sub-interval complete, none in progress
    counts, p_alone = await settled(alone, "alone")
    assert min(counts) > LIMIT // 10, counts  # over the limit's rate: p < 1 (about 1/3 when on time)
    views = [await settled(replica, "three") for replica in three]
    for seen, p in views:
        # Each replica saw a third of these attempts itself; it knows every replica's.
        assert all(abs(mine - total) <= 3 for mine, total in zip(seen, counts, strict=True)), (counts, views)
        assert abs(p - p_alone) <= 0.1, (p_alone, views)
    # The attempted hits are in Redis, one key per counter and sub-interval.
    keys = redis_server.client().keys(f"{three[0].prefix}:{{{counter_digest(('three',))}}}:att:*")
    assert len(keys) >= 10


async def test_the_others_attempts_count_once_redis_told(fleet) -> None:
    """A replica's own attempts count at once, the others' once Redis told it (sync: its
    next flush reads them back; strict: its next script call answers with the total)."""
    first, second = await fleet(2)
    now = time.time()
    for _ in range(30):
        await first.check([check("view")], now)
    if isinstance(first, SyncLimiter) and isinstance(second, SyncLimiter):
        await first.sync_once()
        await second.check([check("view")], now)
        await second.sync_once()
    else:
        await second.check([check("view")], now)
    demand = second.suppression.demands[("view",)]
    assert demand.count(slot_of(now, demand.length_ms)) == 31


async def test_with_redis_away_strict_draws_once(limiters) -> None:
    """The failure policy decides with a memory backend of its own: the request was drawn
    already, so that backend must not draw again (p twice would be p squared)."""
    from tests.support.sidecars import free_port

    limiter = limiters(f"redis://127.0.0.1:{free_port()}", redis_failure_mode="local")
    limiter.suppression.random.seed(0)
    now = time.time()
    decisions = [await limiter.check([check("away")], now + index / 3000) for index in range(60)]
    assert any(decision.suppressed for decision in decisions)
    assert limiter.suppression.demands[("away",)].count(slot_of(now, 100)) > 0
    assert not limiter.policy._local.suppression.demands, "the fallback drew again"


async def test_sync_reads_a_sub_interval_again_once_it_is_complete(redis_server: RedisServer) -> None:
    """A replica that stops attempting still learns the final total of its last sub-interval:
    the first flush after that sub-interval ends reads it again."""
    settings = redis_settings(redis_server.url, "sync", 2.0, redis_prefix=fresh_prefix("sup"), sync_interval=60.0)
    first, second = (build_redis_limiter(settings) for _ in range(2))
    assert isinstance(first, SyncLimiter) and isinstance(second, SyncLimiter)
    await first.store.start()
    await second.store.start()
    try:
        now = time.time()
        first.clock = second.clock = lambda: now
        for _ in range(30):
            await first.check([check("late")], now)
        await first.sync_once()
        await second.check([check("late")], now)
        await second.sync_once()  # reads 31
        for _ in range(10):
            await first.check([check("late")], now)
        await first.sync_once()
        second.clock = lambda: now + 0.1  # the next sub-interval: no attempt of its own since
        await second.sync_once()
        demand = second.suppression.demands[("late",)]
        assert demand.count(slot_of(now, demand.length_ms)) == 41
    finally:
        await first.store.close()
        await second.store.close()
