"""Strict mode's sliding windows, token buckets and bans against real redis-server processes.

``MemoryLimiter`` is the reference: driven with the same requests at the same times,
strict mode must give the same verdicts and counts. The limiters here run the script
on the request's ``now`` (``redis_time=False``) so a test chooses its times; one test
keeps Redis ``TIME``, the production clock. The chosen times lie a couple of seconds
ahead of the real clock, because Redis expires keys on its own clock: every key the
test writes then outlives the test.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Callable, Sequence

import pytest

from sidecar.limiter.algorithms import MICROSECONDS, Algorithm, emission_interval_us
from sidecar.limiter.memory import MemoryLimiter
from sidecar.limiter.protocol import Check, Decision, Role
from sidecar.limiter.redis.keys import ban_key, check_window, counter_digest
from sidecar.limiter.redis.store import same_slot
from sidecar.limiter.strict import StrictLimiter
from sidecar.server import build_strict_limiter
from tests.support.redis_servers import RedisCluster, RedisServer, fresh_prefix, redis_settings

GENEROUS = 2.0
"""Budget: a slow answer on a busy machine must not switch to the failure mode."""
SLIDING = Algorithm.SLIDING_WINDOW
BUCKET = Algorithm.TOKEN_BUCKET
TENTH = emission_interval_us(1, 10)
"""10 per second: a token every 100 ms."""

Factory = Callable[..., StrictLimiter]


@pytest.fixture
async def limiters() -> AsyncIterator[Factory]:
    """Build StrictLimiters (a fresh prefix each unless one is given); all are closed at the end."""
    built: list[StrictLimiter] = []

    def build(url: str, *, redis_time: bool = False, **overrides: object) -> StrictLimiter:
        values: dict[str, object] = {"heartbeat_interval": 0.1, "redis_prefix": fresh_prefix(), **overrides}
        limiter = build_strict_limiter(redis_settings(url, "strict", GENEROUS, **values))
        limiter.redis_time = redis_time
        built.append(limiter)
        return limiter

    yield build
    await asyncio.gather(*(limiter.close() for limiter in built))


async def started(*limiters: StrictLimiter) -> None:
    for limiter in limiters:
        await limiter.start()
        assert limiter.store.available, limiter.store.last_error


def ahead() -> int:
    """A whole second ahead of the real clock (see the module docstring)."""
    return int(time.time()) + 2


def verdict(decision: Decision) -> tuple[bool, tuple[bool, ...], tuple[int, ...]]:
    return decision.admitted, decision.over, decision.counts


def bucket(name: str, burst: int, hits: int = 1, role: Role = Role.ENFORCED, interval: int = TENTH) -> Check:
    return Check((name,), 1, burst, hits, role, BUCKET, interval)


def sliding(name: str, limit: int, hits: int = 1, role: Role = Role.ENFORCED, unit: int = 1) -> Check:
    return Check((name,), unit, limit, hits, role, SLIDING)


def key_of(limiter: StrictLimiter, check: Check, now: float) -> str:
    return check_window(limiter.prefix, check, now)[0]


async def same_as_memory(
    limiter: StrictLimiter, memory: MemoryLimiter, checks: Sequence[Check], now: float
) -> Decision:
    decision = await limiter.check(checks, now)
    assert verdict(decision) == verdict(memory.check_now(checks, now)), (now, checks)
    return decision


# -- the same answers as the memory backend ------------------------------------------------------


async def test_sliding_windows_and_buckets_answer_like_the_memory_backend(
    redis_server: RedisServer, limiters: Factory
) -> None:
    """Random requests of 1 to 3 checks (repeats, roles, hits 0 to 2) over four seconds."""
    limiter = limiters(redis_server.url)
    await started(limiter)
    memory = MemoryLimiter()
    pool = [
        sliding("s10", 10),
        sliding("s4", 4, unit=2),
        Check(("f6",), 1, 6, 1),
        bucket("b3", 3),
        bucket("b2", 2, interval=emission_interval_us(1, 4)),
    ]
    roles = [Role.ENFORCED] * 6 + [Role.SHADOW, Role.QUOTA]
    rng = random.Random(11)
    start = ahead()
    moments = sorted(start + rng.uniform(0, 4) for _ in range(300))
    admitted = 0
    for now in moments:
        checks = [
            rng.choice(pool)._replace(hits=rng.choice([0, 1, 1, 1, 2]), role=rng.choice(roles))
            for _ in range(rng.choice([1, 1, 2, 3]))
        ]
        admitted += (await same_as_memory(limiter, memory, checks, now)).admitted
    assert 50 < admitted < 250, "both verdicts were exercised"
    assert limiter.policy.decisions == 0, "Redis decided every request"


async def test_sliding_window_weighs_the_previous_window(redis_server: RedisServer, limiters: Factory) -> None:
    limiter = limiters(redis_server.url)
    await started(limiter)
    memory = MemoryLimiter()
    item = sliding("weighted", 10)
    start = ahead()
    for _ in range(8):
        await same_as_memory(limiter, memory, [item], start + 0.5)
    # A quarter into the next window, 3/4 of the 8 previous hits still count: 6 + 1.
    decision = await same_as_memory(limiter, memory, [item], start + 1.25)
    assert decision.counts == (7,)
    assert [(await same_as_memory(limiter, memory, [item], start + 1.25)).admitted for _ in range(4)] == [
        True,
        True,
        True,
        False,
    ]
    # Half-way, 4 of the previous 8 count: 4 + the 4 of this window already, + 1.
    assert (await same_as_memory(limiter, memory, [item], start + 1.5)).counts == (9,)
    client = redis_server.client()
    assert client.get(key_of(limiter, item, start + 1.5)) == "5"
    assert client.expiretime(key_of(limiter, item, start + 1.5)) == start + 1 + 2 + 5, "read by the next window"


# -- token buckets ---------------------------------------------------------------------------------


async def test_token_bucket_admits_the_burst_then_one_per_interval(
    redis_server: RedisServer, limiters: Factory
) -> None:
    limiter = limiters(redis_server.url)
    await started(limiter)
    item = bucket("gcra", 3)
    start = ahead()
    burst = [await limiter.check([item], start) for _ in range(4)]
    assert [verdict(decision)[::2] for decision in burst] == [(True, (1,)), (True, (2,)), (True, (3,)), (False, (4,))]
    refill = [await limiter.check([item], start + 0.1) for _ in range(2)]
    assert [verdict(decision)[::2] for decision in refill] == [(True, (3,)), (False, (4,))]
    # 150 ms later one and a half tokens are back: 2.5 in use, reported rounded up.
    assert (await limiter.check([item], start + 0.25)).counts == (3,)
    tat = (start + 0.5) * MICROSECONDS
    client = redis_server.client()
    key = key_of(limiter, item, start)
    assert key.endswith(":tat")
    assert int(client.get(key) or 0) == tat
    assert client.pexpiretime(key) == tat // 1000 + 5000, "kept until the bucket is full again, plus grace"
    # Asking for nothing reports the tokens in use and takes none.
    assert (await limiter.check([item._replace(hits=0)], start + 0.45)).counts == (1,)
    assert int(client.get(key) or 0) == tat


async def test_token_bucket_on_the_redis_clock(redis_server: RedisServer, limiters: Factory) -> None:
    """Production: the script reads Redis TIME, whatever ``now`` the request carries."""
    limiter = limiters(redis_server.url, redis_time=True)
    await started(limiter)
    item = Check(("slow",), 60, 3, 1, Role.ENFORCED, BUCKET, emission_interval_us(60, 3))
    decisions = [await limiter.check([item], time.time()) for _ in range(4)]
    assert [verdict(decision)[::2] for decision in decisions] == [
        (True, (1,)),
        (True, (2,)),
        (True, (3,)),
        (False, (4,)),
    ]
    seconds, microseconds = redis_server.client().time()
    tat = int(redis_server.client().get(key_of(limiter, item, time.time())) or 0)
    lead = tat - (seconds * MICROSECONDS + microseconds)
    assert 59 * MICROSECONDS < lead <= 60 * MICROSECONDS, "three 20 s intervals ahead of Redis's clock"


# -- bans ------------------------------------------------------------------------------------------


async def test_a_ban_blocks_the_counter_on_every_replica_until_it_ends(
    redis_server: RedisServer, limiters: Factory
) -> None:
    first = limiters(redis_server.url)
    second = limiters(redis_server.url, redis_prefix=first.prefix)
    await started(first, second)
    item = Check(("banned",), 1, 2, 1, ban_seconds=2)
    start = ahead()
    assert [(await first.check([item], start + 0.1)).admitted for _ in range(3)] == [True, True, False]
    client = redis_server.client()
    ban = ban_key(first.prefix, counter_digest(item.key))
    ends = start + 3  # ceil(start + 0.1 + 2): ban keys hold whole seconds
    assert client.get(ban) == str(ends)
    assert client.expiretime(ban) == ends
    # A new window, a fresh counter, another replica: still banned; over whatever it holds.
    during = await second.check([item], start + 1.5)
    assert verdict(during) == (False, (True,), (3,))
    assert during.ban_ends == (ends,), "the script tells when the ban ends"
    assert during.reset(item, 0, start + 1.5) == 2, "so a banned client is told to wait for it"
    assert not (await first.check([item._replace(hits=0)], start + 2.9)).admitted
    assert client.get(ban) == str(ends), "requests during a ban do not extend it"
    assert client.expiretime(ban) == ends
    assert client.get(key_of(first, item, start + 1.5)) is None, "banned requests consume nothing"
    after = [(await second.check([item], start + 3.1)).admitted for _ in range(3)]
    assert after == [True, True, False], "the ban ended; going over bans again"
    assert client.get(ban) == str(start + 6)


async def test_a_banned_check_refuses_the_whole_request(redis_server: RedisServer, limiters: Factory) -> None:
    limiter = limiters(redis_server.url)
    await started(limiter)
    memory = MemoryLimiter()
    roomy = [Check(("roomy",), 1, 100, 1), sliding("roomy-sliding", 100), bucket("roomy-bucket", 100)]
    strict = Check(("strict",), 1, 1, 1, ban_seconds=60)
    start = ahead()
    request = [*roomy, strict]
    decisions = [await same_as_memory(limiter, memory, request, start + 0.1) for _ in range(2)]
    assert [decision.admitted for decision in decisions] == [True, False]
    # In the next window the strict counter is empty, but banned: nothing is consumed.
    later = await same_as_memory(limiter, memory, request, start + 1.5)
    assert verdict(later) == (False, (False, False, False, True), (1, 1, 1, 2))
    client = redis_server.client()
    assert client.get(key_of(limiter, roomy[0], start + 1.5)) is None
    assert client.get(key_of(limiter, roomy[1], start + 1.5)) is None
    assert int(client.get(key_of(limiter, roomy[2], start)) or 0) == (start + 0.1) * MICROSECONDS + TENTH
    # Shadow checks of a refused request consume nothing either; alone, a banned shadow passes.
    shadow = strict._replace(role=Role.SHADOW)
    assert (await same_as_memory(limiter, memory, [shadow], start + 1.6)).admitted


# -- the failure policy: hits owed to a bucket ------------------------------------------------------


async def wait_reconciled(limiter: StrictLimiter) -> None:
    while not (limiter.store.available and limiter.ledger.reconciled()):
        await asyncio.sleep(0.01)


async def test_hits_owed_to_a_bucket_land_as_tat_increments(own_redis: RedisServer, limiters: Factory) -> None:
    limiter = limiters(own_redis.url, heartbeat_interval=5)
    await started(limiter)
    item = bucket("owed", 5)
    start = ahead()
    key, expires = check_window(limiter.prefix, item, start)
    assert (await limiter.check([item], start)).counts == (1,)
    # Owed as a late answer's correction would be: 2 hits, 2 intervals on the TAT.
    assert limiter.ledger.owe(key, 2, expires, item.interval_us)
    assert limiter.ledger.owed_hits == 2
    await asyncio.wait_for(wait_reconciled(limiter), 10.0)
    client = own_redis.client()
    assert int(client.get(key) or 0) == start * MICROSECONDS + 3 * TENTH
    assert (await limiter.check([item], start)).counts == (4,)

    own_redis.kill()
    # Redis admitted 2 hits of this replica's; its local share (one live replica) is 5.
    during = [await limiter.check([item], start) for _ in range(4)]
    assert [decision.admitted for decision in during] == [True, True, True, False]
    assert limiter.ledger.owed_hits == 3, "reported in hits, owed as 3 intervals"
    await asyncio.to_thread(own_redis.start)
    await asyncio.wait_for(wait_reconciled(limiter), 10.0)
    # The restarted Redis is empty: INCRBY leaves a TAT far in the past, a full bucket.
    # Charging a bucket without max(TAT, now) forgives hits owed to a refilled one.
    assert int(own_redis.client().get(key) or 0) == 3 * TENTH
    assert (await limiter.check([item], start)).counts == (1,)


# -- Redis Cluster: checks on different slots ---------------------------------------------------------


async def give_backs_done(limiter: StrictLimiter) -> None:
    """Wait for the background give-backs of refused cross-slot requests."""
    tasks = set(limiter.store._tasks)
    if tasks:
        await asyncio.wait_for(asyncio.gather(*tasks), 5.0)


@pytest.mark.slow
async def test_cluster_cross_slot_sliding_window_and_bucket(redis_cluster: RedisCluster, limiters: Factory) -> None:
    limiter = limiters(redis_cluster.url)
    await started(limiter)
    memory = MemoryLimiter()
    start = ahead()
    window = sliding("cluster-sliding", 3)
    item = next(
        bucket(f"cluster-bucket-{index}", 2)
        for index in range(64)
        if not same_slot([key_of(limiter, window, start), key_of(limiter, bucket(f"cluster-bucket-{index}", 2), start)])
    )
    request = [window, item]
    moments = [0.1, 0.1, 0.1, 0.3, 0.3, 0.35, 1.2, 1.2, 1.25, 1.5, 1.9]
    decisions = []
    for offset in moments:
        decisions.append(await same_as_memory(limiter, memory, request, start + offset))
        await give_backs_done(limiter)
    assert [decision.admitted for decision in decisions] == [
        True, True, False,  # the bucket's burst of 2 (the window's hit is given back)
        True, False, False,  # tokens back at 0.3; then the window is full (the token is given back)
        True, False, False,  # 4/5 and 3/4 of the previous 3 still count: 2 + 1, then over
        True, True,  # half (1), then a tenth (0) of them
    ]  # fmt: skip
    assert limiter.store.give_back_failures == 0
    client = redis_cluster.client()
    # Refused requests gave back what one check's script had consumed: counters equal admitted hits.
    assert client.get(key_of(limiter, window, start)) == "3"
    assert client.get(key_of(limiter, window, start + 1)) == str(sum(d.admitted for d in decisions[6:]))
    probe = [window._replace(hits=0), item._replace(hits=0)]
    assert verdict(await limiter.check(probe, start + 1.95)) == verdict(memory.check_now(probe, start + 1.95))

    for node in redis_cluster.nodes:
        node.client().script_flush()  # as after a restart or failover: EVALSHA meets NOSCRIPT
    before = limiter.store.round_trips_request_path
    await same_as_memory(limiter, memory, request, start + 2.5)
    assert limiter.store.round_trips_request_path == before + 2, "EVALSHA, then EVAL of the body"
    assert limiter.policy.decisions == 0, "Redis decided every request"
