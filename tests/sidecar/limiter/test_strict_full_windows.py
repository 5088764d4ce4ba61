"""Strict mode refuses windows Redis reported full without a round trip (real redis-server).

The refusals must be the ones Redis would have given: exact across replicas, nothing
recorded, and a key whose count Redis may lower (a give-back) goes back to Redis.
"""

from __future__ import annotations

import time

from sidecar.limiter.redis.keys import check_window
from sidecar.limiter.strict import RedisCall
from sidecar.metrics import limiter_families
from tests.sidecar.limiter.conftest import Factory
from tests.sidecar.limiter.test_strict import key_of, one, started
from tests.support.redis_servers import RedisServer, fresh_prefix


async def test_a_window_another_replica_filled_is_refused_here_after_one_answer(
    redis_server: RedisServer, limiters: Factory
) -> None:
    prefix = fresh_prefix()
    first, second = (limiters(redis_server.url, redis_prefix=prefix) for _ in range(2))
    await started(first, second)
    item = one(3, name="filled-elsewhere")
    now = time.time()
    assert [(await first.check([item], now)).admitted for _ in range(3)] == [True] * 3
    trips = second.store.round_trips_request_path
    told = await second.check([item], now)  # Redis answers: the window is full
    assert (told.admitted, told.counts) == (False, (4,))
    assert second.store.round_trips_request_path == trips + 1
    again = [await second.check([item], now) for _ in range(20)]
    assert all(not decision.admitted and decision.counts == (4,) for decision in again)
    assert second.store.round_trips_request_path == trips + 1, "refused from what Redis said"
    assert second.full.refusals == 20
    assert second.policy.decisions == 0
    assert redis_server.client().get(key_of(prefix, item, now)) == "3"
    families = {family.name: family for family in limiter_families(second.snapshot())}
    assert families["ratelimit_sidecar_full_window_refusals"].samples[0].value == 20


async def test_the_next_window_and_a_raised_limit_go_to_redis(redis_server: RedisServer, limiters: Factory) -> None:
    limiter = limiters(redis_server.url, redis_prefix=fresh_prefix())
    await started(limiter)
    item = one(2, name="next-window", unit=1)
    now = float(int(time.time()))
    assert [(await limiter.check([item], now)).admitted for _ in range(3)] == [True, True, False]
    trips = limiter.store.round_trips_request_path
    assert (await limiter.check([item._replace(limit=5)], now)).admitted, "a reload raised the limit"
    assert (await limiter.check([item], now + 1)).admitted, "a new window, a new key"
    assert limiter.store.round_trips_request_path == trips + 2


async def test_a_give_back_sends_the_key_to_redis_again(redis_server: RedisServer, limiters: Factory) -> None:
    """A late answer consumed a hit the failure mode refused: Redis is given it back, so the
    count it reported before may no longer hold."""
    limiter = limiters(redis_server.url, redis_prefix=fresh_prefix())
    await started(limiter)
    item = one(2, name="given-back")
    now = time.time()
    assert [(await limiter.check([item], now)).admitted for _ in range(3)] == [True, True, False]
    key, expires = check_window(limiter.prefix, item, now)
    assert limiter.full.refusal([item], [key], False) is not None
    call = RedisCall([key], [item], [expires], spent=(0,), owed=[0])
    limiter._owe_for(call, [1])  # the script consumed the hit the failure mode refused
    assert limiter.full.refusal([item], [key], False) is None
