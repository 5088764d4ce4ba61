"""sync mode returning from an outage, on the simulated Redis of the sync simulation.

Two replicas settle their outage hits one after the other: the first one's flush reads a
total without the second one's outage hits. Once both are settled, a counter read before
that is still held to the replica's share until a flush prepared since reads it again
(:class:`~sidecar.limiter.sync_counters.ReturnWatch`): before, the first replica admitted
its blind hits from the stale total (105 of 100 here, on top of a window already full).
"""

from __future__ import annotations

import asyncio

from sidecar.limiter.sync import SyncLimiter
from sidecar.limiter.sync_counters import ReturnWatch, WindowCounter
from tests.sidecar.limiter.test_sync_simulation import NOW, SimulatedStore, check, cluster, only_counter

LIMIT = 100
SHARE = 50


async def admitted(limiter: SyncLimiter, requests: int) -> int:
    return sum([(await limiter.check([check(LIMIT)], NOW)).admitted for _ in range(requests)])


def test_a_counter_read_before_the_peers_settled_is_held_to_the_share_until_read_again() -> None:
    store = SimulatedStore()
    first, second = cluster(2, store)

    async def scenario() -> tuple[int, int]:
        total = await admitted(first, 25) + await admitted(second, 25)
        for limiter in (first, second):
            await limiter.sync_once()
        store.available = False
        for limiter in (first, second):
            limiter._on_redis_state(False, "simulated outage")
            limiter.replicas.returning = True
        total += await admitted(first, 40) + await admitted(second, 40)
        assert total == LIMIT, "each replica's share of 50"
        store.available = True
        for limiter in (first, second):
            limiter._on_redis_state(True, "")
            await limiter.sync_once()  # settled: the first one read 75, without the second one's 25
        assert (first.table.all_counters()[0].known, second.table.all_counters()[0].known) == (75, 100)
        for limiter in (first, second):
            limiter.replicas.returning = False  # both beat since the other's return
        stale = await admitted(first, 10)
        await first.sync_once()  # reads 100: the first replica knows the window is full
        return total + stale, await admitted(first, 10)

    total, after = asyncio.run(scenario())
    assert total == LIMIT, total
    assert after == 0
    assert only_counter(store) == LIMIT


def test_the_watch_holds_everything_while_returning_then_only_counters_read_before() -> None:
    watch = ReturnWatch()
    counter = WindowCounter("rls:{d}:0", "d", 5, read=3)
    never_read = WindowCounter("rls:{e}:0", "e", 5)
    assert not watch.held(False, 3, [counter]), "no outage yet"
    watch.outage()
    assert watch.held(True, 4, [never_read]), "returning: every decision is held"
    assert watch.held(False, 5, [counter]), "read before the return ended"
    assert not watch.held(False, 9, [never_read]), "no flush read it: a first touch"
    counter.read = 6
    assert not watch.held(False, 9, [counter]), "read by a flush prepared after the return ended"
