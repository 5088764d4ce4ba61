"""A late escalation while Redis is up is refused in ``local`` mode (issue 17), against real Redis.

An escalation means the request is near a limit. If its answer does not come within the
caller's deadline while Redis is not known to be down, the other replicas are still
admitting through Redis: a share on top of theirs would overshoot, so the request is
refused, and a late answer that admitted gives its hits back. Once Redis is marked down,
the share applies (``test_sync.py``'s outage tests).
"""

from __future__ import annotations

import asyncio
import time

from sidecar.limiter.protocol import Check
from sidecar.limiter.redis.keys import counter_window
from tests.sidecar.limiter.conftest import Fleet
from tests.support.redis_servers import RedisServer

PAUSE_MS = 400
"""Scripts wait this long (``CLIENT PAUSE ... WRITE``); Redis is marked down only after 1 s."""


async def test_a_late_escalation_while_redis_is_up_is_refused_and_its_hits_given_back(
    own_redis: RedisServer, fleet: Fleet
) -> None:
    # --sync-max-overshoot 0: every request near the limit escalates; a 0.2 s bound marks
    # Redis down only after 1 s of silence, well past the pause.
    pair = fleet.group(2, own_redis.url, sync_max_overshoot=0.0, redis_timeout=0.2)
    for limiter in pair:
        await limiter.start()
    for limiter in pair:
        await limiter.replicas.beat()
    limiter = pair[0]
    item = Check(("late-escalation",), 3600, 10, 1)
    now = time.time()
    assert all([(await limiter.check([item], now, budget=1.0)).admitted for _ in range(4)])

    own_redis.pause(PAUSE_MS, "WRITE")
    during = await asyncio.gather(*(limiter.check([item], now, budget=0.01) for _ in range(3)))
    assert limiter.store.available, "a pause shorter than the silence threshold is not an outage"
    assert not any(decision.admitted for decision in during), "no share on top of what Redis admits"
    assert limiter.reasons.counts["deadline"] == 3

    await asyncio.wait_for(limiter.batcher.drain(), 5.0)
    assert limiter.batcher.late_answers == 3, "the scripts ran after the pause and admitted"
    # Their hits are given back: Redis ends holding exactly what was admitted.
    await fleet.close(*pair)
    key = counter_window(limiter.prefix, item.key, item.unit_seconds, now)[0]
    assert own_redis.client().get(key) == "4"
