"""``overload: suppress`` across replicas on a real redis-server: the attempted demand is
shared, so three replicas seeing a third of the traffic each apply the ``p`` one replica
seeing all of it applies (sync: flushed with the batch and read back; strict: added by
each request's own script call, which answers with the total)."""

from __future__ import annotations

import asyncio
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

LIMIT = 100
"""Per second: 10 hits per 100 ms sub-interval."""
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


async def drive(replicas: list[Replica], name: str) -> tuple[list[float], int]:
    """Send :data:`RATE` requests a second for :data:`SECONDS`, round robin over ``replicas``;
    return each replica's ``p`` at the end and how many were admitted in the last second."""
    started = time.time()
    sent = admitted_late = 0
    while (elapsed := time.time() - started) < SECONDS:
        due = int(elapsed * RATE)
        while sent < due:
            now = time.time()
            decision = await replicas[sent % len(replicas)].check([check(name)], now)
            admitted_late += decision.admitted and elapsed >= SECONDS - 1.0
            sent += 1
        await asyncio.sleep(0.005)
    now = time.time()
    ps = []
    for limiter in replicas:
        demand = limiter.suppression.demands[(name,)]
        ps.append(demand.probability(slot_of(now, demand.length_ms), LIMIT))
    return ps, admitted_late


async def test_three_replicas_apply_the_global_p_of_one_seeing_everything(fleet, redis_server: RedisServer) -> None:
    alone = await fleet(1)
    (p_alone,), _ = await drive(alone, "alone")
    three = await fleet(3)
    p_three, _ = await drive(three, "three")
    assert 0.2 <= p_alone <= 0.5, p_alone  # 1/3 at 3x the limit
    for p in p_three:
        assert abs(p - p_alone) <= 0.15, (p_alone, p_three)
    # Each replica alone sees the limit's own rate: without sharing, none would suppress.
    assert all(p < 0.7 for p in p_three)
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
