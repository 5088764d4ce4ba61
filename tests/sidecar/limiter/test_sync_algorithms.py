"""Sync mode with sliding windows and bans, two in-process replicas on a real redis-server.

Sliding-window escalations are decided by ``decide.lua`` on Redis's clock, so these tests
run on the real clock with two-second windows and wait for the boundaries they need.
Token buckets are refused in sync mode: checked here through the real command line.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from sidecar.limiter.algorithms import Algorithm
from sidecar.limiter.protocol import Check
from sidecar.limiter.redis.keys import ban_key, counter_digest, window_key
from sidecar.limiter.sync import SyncLimiter
from sidecar.limiter.windows import window_start
from sidecar.server import build_redis_limiter
from tests.support.redis_servers import RedisServer, fresh_prefix, redis_settings
from tests.support.sidecars import run_cli, write_config

pytestmark = pytest.mark.slow

UNIT = 2
LIMIT = 20
BOUND = math.floor(0.05 * LIMIT)
"""(R - 1) x Q with R = 2 and the default max overshoot: what sync mode may admit beyond the limit."""


def sliding(name: str = "slide", limit: int = LIMIT) -> Check:
    return Check((name,), UNIT, limit, 1, algorithm=Algorithm.SLIDING_WINDOW)


def banned(name: str = "ban", limit: int = 3, seconds: int = 3) -> Check:
    return Check((name,), 1, limit, 1, ban_seconds=seconds)


@pytest.fixture
async def pair(redis_server: RedisServer) -> AsyncIterator[list[SyncLimiter]]:
    prefix = fresh_prefix("alg")
    settings = redis_settings(
        redis_server.url, "sync", 2.0, redis_prefix=prefix, heartbeat_interval=0.5, sync_interval=0.05
    )
    limiters = [build_redis_limiter(settings) for _ in range(2)]
    assert all(isinstance(limiter, SyncLimiter) for limiter in limiters)
    replicas = [limiter for limiter in limiters if isinstance(limiter, SyncLimiter)]
    for limiter in replicas:
        await limiter.start()
    for limiter in replicas:
        await limiter.replicas.beat()
    assert {limiter.replicas.live for limiter in replicas} == {2}
    yield replicas
    await asyncio.gather(*(limiter.close() for limiter in replicas))


async def at_offset(offset: float, unit: int = UNIT) -> float:
    """Sleep until ``offset`` seconds into a window (the next one if this one is past it)."""
    now = time.time()
    start = window_start(now, unit)
    target = start + offset if now - start < offset - 0.05 else start + unit + offset
    await asyncio.sleep(max(0.0, target - now))
    return time.time()


async def sleep_until(moment: float) -> float:
    await asyncio.sleep(max(0.0, moment - time.time()))
    return time.time()


async def admitted(replicas: list[SyncLimiter], check: Check, tries: int, at: float | None = None) -> int:
    """Send ``tries`` requests alternately through the replicas; count the admitted ones.

    ``at``: every request decided at that moment (a sliding window's weight then does not
    move while they go out, however slow a loaded machine sends them)."""
    count = 0
    for index in range(tries):
        decision = await replicas[index % 2].check([check], time.time() if at is None else at)
        count += decision.admitted
    return count


@pytest.mark.serial
@pytest.mark.parametrize("limit", [LIMIT, 400], ids=["exact-near-a-low-limit", "local-decisions"])
async def test_sliding_window_weighs_the_previous_window_across_replicas(
    pair: list[SyncLimiter], redis_server: RedisServer, limit: int
) -> None:
    check, bound, tries = sliding(limit=limit), math.floor(0.05 * limit), limit * 3 // 2
    start = await at_offset(0.1)
    first = await admitted(pair, check, tries, at=start)
    assert limit <= first <= limit + bound
    # A quarter into the next window the previous one still weighs 3/4 (each phase decides
    # at one moment; the one-hit slack is the estimate's rounding).
    now = await sleep_until(window_start(start, UNIT) + UNIT + 0.5)
    weighed = math.floor(first * 0.75)
    second = await admitted(pair, check, tries, at=now)
    assert limit - weighed - 1 <= second <= limit - weighed + bound + 1, (first, second)
    # Three quarters in, the previous window weighs 1/4: more fit again.
    later = await sleep_until(window_start(now, UNIT) + 1.5)
    third = await admitted(pair, check, tries, at=later)
    assert third >= math.floor(first * 0.5) - bound - 2, (first, second, third)
    if limit > LIMIT:
        assert all(limiter.local_decisions > limit // 2 for limiter in pair), "most decisions stay local"
    for limiter in pair:
        await limiter.sync_once()
    digest = counter_digest(check.key)
    client = redis_server.client()
    previous = int(client.get(window_key(pair[0].prefix, digest, window_start(start, UNIT))) or 0)
    current = int(client.get(window_key(pair[0].prefix, digest, window_start(now, UNIT))) or 0)
    assert (previous, current) == (first, second + third), "Redis holds exactly the admitted hits"
    ttl = client.ttl(window_key(pair[0].prefix, digest, window_start(now, UNIT)))
    assert ttl > UNIT, "a sliding window's key outlives the next window, which reads it"


async def test_a_ban_set_by_one_replica_refuses_on_the_other_until_it_ends(
    pair: list[SyncLimiter], redis_server: RedisServer
) -> None:
    check = banned()
    await at_offset(0.1, unit=1)
    first, second = pair
    verdicts = [(await first.check([check], time.time())).admitted for _ in range(4)]
    assert verdicts == [True, True, True, False]
    began = time.time()
    await first.sync_once()  # writes the ban; the other replica reads it with its next flush
    key = ban_key(first.prefix, counter_digest(check.key))
    until = int(redis_server.client().get(key) or 0)
    assert began + 2 <= until <= began + 4
    await second.check([check._replace(hits=0)], time.time())  # touches the counter: the flush reads its ban
    await second.sync_once()
    await at_offset(0.2, unit=1)  # a new one-second window: only the ban refuses
    decision = await second.check([check], time.time())
    assert not decision.admitted
    assert decision.ban_ends and decision.ban_ends[0] == until
    await asyncio.sleep(max(0.0, until - time.time()) + 0.05)
    assert [(await replica.check([check], time.time())).admitted for replica in pair] == [True, True]


async def test_a_banned_counter_makes_the_whole_request_consume_nothing(
    pair: list[SyncLimiter], redis_server: RedisServer
) -> None:
    check, other = banned("b2", limit=1), Check(("free",), 60, 100, 1)
    await at_offset(0.1, unit=1)
    first = pair[0]
    assert (await first.check([check, other], time.time())).admitted
    assert not (await first.check([check, other], time.time())).admitted
    await at_offset(0.3, unit=1)
    assert not (await first.check([check, other], time.time())).admitted
    await first.sync_once()
    now = time.time()
    total = redis_server.client().get(window_key(first.prefix, counter_digest(other.key), window_start(now, 60)))
    assert int(total or 0) == 1, "only the first request's hit reached the other counter"


def test_sync_mode_refuses_a_token_bucket_with_one_clear_line(tmp_path: Path, redis_server: RedisServer) -> None:
    config = write_config(
        tmp_path / "config",
        "domain: d\ndescriptors:\n  - key: k\n"
        "    rate_limit: {unit: second, requests_per_unit: 5, algorithm: token_bucket, burst: 10}\n",
    )
    argv = ["serve", "--config", str(config), "--backend", "redis", "--redis-url", redis_server.url]
    result = run_cli(*argv, "--mode", "sync", "--grpc-address", "127.0.0.1:0")
    assert result.returncode == 1
    assert "descriptors[0].rate_limit.algorithm: token_bucket is not supported in sync mode" in result.stderr
    assert "Traceback" not in result.stderr
    checked = run_cli("check-config", "--mode", "sync", str(config))
    assert checked.returncode == 1 and "token_bucket is not supported in sync mode" in checked.stderr
    assert run_cli("check-config", "--mode", "strict", str(config)).returncode == 0
