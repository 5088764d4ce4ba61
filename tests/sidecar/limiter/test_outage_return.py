"""Returning from a Redis outage (issue 31): the outage's hits are settled before a replica
decides from Redis alone, whatever order the replicas come back in, against real redis-server.

Two replicas share a limit of 40 (a share of 20 each). Each has Redis admit 10, then Redis
is killed; in the ``local`` failure mode each admits its share's 10 more. Redis comes back
(its data kept: append-only file) and replica A returns while B's probe is held down for a
while, as the probe backoff (up to 1 s) does. Before the fix, A decided from Redis, which
held 30 (B's outage hits were not in it), and admitted 10 more: 50 of 40 in strict mode,
against a bound of 40 (sync: 42, its ``(R - 1) * Q`` above 40). A also counted itself
alone once its first heartbeat or flush after the return no longer found B's beat (older
than three intervals), so its shares and blind cap were those of one replica.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from sidecar.limiter.protocol import Check, Role
from sidecar.limiter.redis.replicas import Replicas
from sidecar.limiter.sync import SyncLimiter
from sidecar.server import build_redis_store
from tests.sidecar.limiter.conftest import HOUR, steady_now, strict_settings
from tests.sidecar.limiter.test_sync_hardening import sum_counters
from tests.support import outages
from tests.support.redis_servers import RedisServer, fresh_prefix, running

pytestmark = [pytest.mark.slow, pytest.mark.serial]

LIMIT = 40
BEFORE = 10
"""Hits each replica has Redis admit before the outage."""
BOUNDS = {"strict": LIMIT, "sync": LIMIT + 2}
"""Two shares of 20 (strict); sync's bound with Redis up is ``L + (R - 1) * Q``, Q = floor(0.05 * 40)."""
HEARTBEAT = 1.0
"""Three missed beats (3 s) count a replica dead: the outage lasts longer, so the beats
before it are stale when Redis returns; B is held down for less."""
WAIT = 15.0
"""Generous bound on each wait for a state change (a loaded machine): never a measured time."""

Limiter = outages.Limiter


def build(mode: str, url: str, prefix: str) -> Limiter:
    options: dict[str, object] = {"redis_prefix": prefix, "heartbeat_interval": HEARTBEAT}
    return outages.build_limiter(mode, url, **options)


async def until(condition: Callable[[], object], what: str) -> None:
    await outages.until(condition, what, WAIT)


async def noticed_down(limiter: Limiter) -> None:
    """Beat until the limiter has marked Redis down (the killed server refuses connections)."""
    deadline = time.monotonic() + WAIT
    while limiter.store.available:
        assert time.monotonic() < deadline, "the limiter never noticed the outage"
        await limiter.replicas.beat()
        await asyncio.sleep(0.01)


async def settle(limiter: Limiter) -> None:
    """Every hit the limiter admitted is in Redis."""
    if isinstance(limiter, SyncLimiter):
        while limiter.table.has_unflushed():
            await limiter.sync_once()
            await asyncio.sleep(0.01)
    else:
        await until(limiter.ledger.reconciled, "strict reconciled")


@pytest.mark.parametrize("mode", ["strict", "sync"])
async def test_a_replica_back_before_its_peer_keeps_its_share_until_the_outage_is_settled(
    tmp_path: Path, mode: str
) -> None:
    server = RedisServer(tmp_path / "redis", extra=["--appendonly", "yes", "--appendfsync", "always"])
    with running(server):
        prefix = fresh_prefix("o")
        first, second = build(mode, server.url, prefix), build(mode, server.url, prefix)
        try:
            await first.start()
            await second.start()
            await first.replicas.beat()
            assert (first.replicas.live, second.replicas.live) == (2, 2)
            now = await steady_now(HOUR)
            item = Check(("outage-return", mode), HOUR, LIMIT, 1, Role.ENFORCED)
            admitted = {"before": 0, "outage": 0, "first back": 0, "second held": 0, "after": 0}

            async def ask(limiter: Limiter, phase: str) -> None:
                admitted[phase] += (await limiter.check([item], now)).admitted

            for _ in range(BEFORE):
                await ask(first, "before")
                await ask(second, "before")
            assert admitted["before"] == 2 * BEFORE
            await settle(first)
            await settle(second)

            server.kill()
            await noticed_down(first)
            await noticed_down(second)
            for _ in range(15):
                await ask(first, "outage")
                await ask(second, "outage")
            assert admitted["outage"] == LIMIT - 2 * BEFORE, "each replica's share of 20, less its 10 before"
            await asyncio.sleep(3 * HEARTBEAT + 0.2)  # every beat in Redis is now older than three intervals

            held = outages.hold_probe(second.store)
            await asyncio.to_thread(server.start)
            await until(lambda: first.store.available, "the first replica back")
            lives = []
            for _ in range(40):  # over more than one heartbeat interval of the first replica
                await ask(first, "first back")
                await ask(second, "second held")
                lives.append(first.replicas.live)
                await asyncio.sleep(0.03)
            assert not second.store.available, "the second replica was held down throughout"
            held[0] = False
            await until(lambda: second.store.available, "the second replica back")
            await ask(second, "after")
            lives.append(second.replicas.live)  # its first decision back: it does not count itself alone
            await until(
                lambda: (
                    not getattr(first.replicas, "returning", False) and not getattr(second.replicas, "returning", False)
                ),
                "both replicas settled",
            )
            for _ in range(BEFORE):
                await ask(first, "after")
                await ask(second, "after")
            await settle(first)
            await settle(second)
            total = sum(admitted.values())
            assert total <= BOUNDS[mode], admitted
            assert lives == [2] * len(lives), "the live count after the return: it was 2 before the outage"
            assert sum_counters(server, prefix) == total, "Redis holds exactly the admitted hits"
        finally:
            await first.close()
            await second.close()


async def test_a_peer_that_died_in_the_outage_counts_until_three_intervals_after_the_return(
    own_redis: RedisServer,
) -> None:
    """The count before the outage holds until the peers could have beaten since the return;
    and a returning replica sends no beat before its limiter has settled its outage hits."""
    settings = strict_settings(own_redis.url, redis_prefix=fresh_prefix("d"))
    stores = [build_redis_store(settings) for _ in range(2)]
    for store in stores:
        await store.start()
    settled = [True]
    survivor, dying = (Replicas(store, 0.2) for store in stores)
    survivor.follow_outages(lambda: settled[0])
    dying.follow_outages(lambda: True)
    try:
        await survivor.start()
        await dying.start()
        await survivor.beat()
        assert survivor.live == 2
        key = stores[0].replicas_key
        own_redis.kill()
        for replicas in (survivor, dying):
            while replicas.store.available:
                await replicas.beat()
                await asyncio.sleep(0.01)
        await dying.close()  # it dies during the outage: it will never beat again
        await stores[1].close()
        await asyncio.sleep(3 * 0.2 + 0.1)  # every beat in Redis is now stale
        settled[0] = False
        await asyncio.to_thread(own_redis.start)  # its data lost: no beat at all
        await until(lambda: stores[0].available, "Redis back")
        await asyncio.sleep(0.5)  # more than two intervals: an unheld replica would have beaten
        assert own_redis.client().zscore(key, survivor.replica_id) is None, "no beat before the hits are settled"
        assert survivor.returning and survivor.live == 2
        settled[0] = True
        seen = []
        while survivor.returning:
            seen.append(survivor.live)
            await asyncio.sleep(0.01)
        assert own_redis.client().zscore(key, survivor.replica_id) is not None
        assert seen and set(seen) == {2}, "the peer counts until three intervals after the return"
        assert survivor.live == 1, "then it is dead, as any replica silent that long"
    finally:
        await survivor.close()
        await stores[0].close()
