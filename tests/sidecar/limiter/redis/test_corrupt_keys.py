"""A counter key holding something that is not a counter does not turn its limit off.

Issue 21, defect 8: replace a counter's key with a hash, or set it to 2^63-1, and sync
mode admitted 40 of 40 at a limit of 10 (flushes refused the hits silently, counted in
a field nobody exported); strict mode admitted 40 of 40 for 2^63-1, because Lua read
the value as a float, its count came back as -2^63 and the Python side decided again
from the returned counts instead of using the script's own verdict.

Now a corrupt key (wrong type, not an integer, beyond what Lua counts exactly) is an
error of the request that met it: decided by the failure mode (``local`` here: the
limit over the live replicas), logged once per key, counted in
``ratelimit_sidecar_redis_corrupt_keys_total``; Redis stays up for everything else.
Real redis-server, in-process replicas built as ``serve`` builds them.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import redis
from structlog.testing import capture_logs

from sidecar.limiter.protocol import Check, Decision
from sidecar.limiter.redis.keys import counter_window
from sidecar.limiter.redis.store import Counts, verdict
from sidecar.limiter.sync import SyncLimiter
from sidecar.metrics import limiter_families
from sidecar.server import build_redis_limiter
from tests.sidecar.limiter.conftest import steady_now
from tests.support.redis_servers import RedisServer, fresh_prefix, redis_settings

UNIT = 3600
LIMIT = 10
REQUESTS = 40

CORRUPTIONS: dict[str, Callable[[redis.Redis, str], Any]] = {
    "hash": lambda client, key: client.hset(key, "field", "1"),
    "list": lambda client, key: client.rpush(key, "1"),
    "int64-max": lambda client, key: client.set(key, str(2**63 - 1)),
    "int64-min": lambda client, key: client.set(key, str(-(2**63))),
    "beyond-2^53": lambda client, key: client.set(key, str(2**53 + 2)),
    "not-a-number": lambda client, key: client.set(key, "many"),
    "fraction": lambda client, key: client.set(key, "1.5"),
}


class Replicas:
    """Limiters built as ``serve`` builds them; all closed when the test ends."""

    def __init__(self) -> None:
        self.built: list[Any] = []

    async def start(self, url: str, mode: str, count: int = 1, **overrides: object) -> list[Any]:
        prefix = fresh_prefix()
        settings = {"heartbeat_interval": 0.5, "sync_interval": 60.0, "redis_prefix": prefix, **overrides}
        group = [build_redis_limiter(redis_settings(url, mode, 2.0, **settings)) for _ in range(count)]
        self.built += group
        for limiter in group:
            await limiter.start()
        for limiter in group:
            await limiter.replicas.beat()
        assert {limiter.replicas.live for limiter in group} == {count}
        return group


@pytest.fixture
async def replicas() -> AsyncIterator[Replicas]:
    built = Replicas()
    yield built
    await asyncio.gather(*(limiter.close() for limiter in built.built))


def corrupt(server: RedisServer, limiter: Any, check: Check, now: float, corruption: str) -> str:
    key = counter_window(limiter.prefix, check.key, check.unit_seconds, now)[0]
    CORRUPTIONS[corruption](server.client(), key)
    return key


def corrupt_key_metric(limiter: Any) -> float:
    for family in limiter_families(limiter.snapshot()):
        if family.name == "ratelimit_sidecar_redis_corrupt_keys":
            return float(family.samples[0].value)
    raise AssertionError("ratelimit_sidecar_redis_corrupt_keys is not exported")


def corrupt_key_logs(logs: list[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    return [entry for entry in logs if entry["event"] == "redis_corrupt_key" and entry.get("key") == key]


async def send(limiters: list[Any], check: Check, now: float) -> int:
    """REQUESTS requests of one hit, spread over the replicas; sync replicas flush after each."""
    admitted = 0
    for index in range(REQUESTS):
        limiter = limiters[index % len(limiters)]
        decision: Decision = await limiter.check([check], now)
        admitted += decision.admitted
        if isinstance(limiter, SyncLimiter):
            await limiter.sync_once()
    return admitted


@pytest.mark.parametrize("corruption", CORRUPTIONS)
@pytest.mark.parametrize("mode", ["sync", "strict"])
async def test_a_corrupt_counter_is_decided_by_the_failure_mode_and_reported_once(
    redis_server: RedisServer, replicas: Replicas, mode: str, corruption: str
) -> None:
    (limiter,) = await replicas.start(redis_server.url, mode)
    check = Check(("corrupt", corruption), UNIT, LIMIT, 1)
    now = await steady_now()
    key = corrupt(redis_server, limiter, check, now, corruption)
    with capture_logs() as logs:
        admitted = await send([limiter], check, now)
    assert admitted == LIMIT, f"{mode}: {admitted} of {REQUESTS} admitted at a limit of {LIMIT}"
    assert limiter.store.available, "one bad key must not switch all of Redis to the failure mode"
    assert corrupt_key_metric(limiter) >= 1
    reported = corrupt_key_logs(logs, key)
    assert len(reported) == 1, logs
    assert reported[0]["log_level"] == "error"


@pytest.mark.parametrize("corruption", ["int64-max", "hash"])
async def test_sync_escalations_use_the_scripts_verdict(
    redis_server: RedisServer, replicas: Replicas, corruption: str
) -> None:
    """Two replicas and no overshoot allowed: every decision escalates to decide.lua."""
    group = await replicas.start(redis_server.url, "sync", count=2, sync_max_overshoot=0.0)
    check = Check(("escalated", corruption), UNIT, LIMIT, 1)
    now = await steady_now()
    corrupt(redis_server, group[0], check, now, corruption)
    admitted = 0
    for index in range(REQUESTS):
        admitted += (await group[index % 2].check([check], now)).admitted
    assert admitted <= LIMIT, f"{admitted} of {REQUESTS} admitted at a limit of {LIMIT}"
    assert all(limiter.store.available for limiter in group)


async def test_other_counters_still_go_to_redis(redis_server: RedisServer, replicas: Replicas) -> None:
    (limiter,) = await replicas.start(redis_server.url, "strict")
    now = await steady_now()
    bad, good = Check(("bad",), UNIT, LIMIT, 1), Check(("good",), UNIT, LIMIT, 1)
    corrupt(redis_server, limiter, bad, now, "hash")
    for _ in range(3):
        assert (await limiter.check([bad], now)).admitted
        assert (await limiter.check([good], now)).admitted
    good_key = counter_window(limiter.prefix, good.key, UNIT, now)[0]
    assert redis_server.client().get(good_key) == "3"
    assert limiter.redis_decisions == 3


async def test_sync_recovers_once_the_key_is_repaired(redis_server: RedisServer, replicas: Replicas) -> None:
    (limiter,) = await replicas.start(redis_server.url, "sync")
    check = Check(("repaired",), UNIT, LIMIT, 1)
    now = await steady_now()
    key = corrupt(redis_server, limiter, check, now, "hash")
    for _ in range(3):
        assert (await limiter.check([check], now)).admitted
        await limiter.sync_once()
    redis_server.client().delete(key)
    assert (await limiter.check([check], now)).admitted  # failure mode: pending, then flushed
    await limiter.sync_once()
    assert int(redis_server.client().get(key) or 0) >= 1, "the repaired key takes the pending hits"
    before = limiter.local_decisions
    assert (await limiter.check([check], now)).admitted
    assert limiter.local_decisions == before + 1, "decided locally again"


def test_the_scripts_verdict_wins_over_its_counts() -> None:
    """What the script wrote follows its own verdict; counts are only what it reports."""
    check = Check(("k",), UNIT, LIMIT, 1)
    refused = Counts([-(2**63)])  # what 2^63-1 came back as before the scripts checked keys
    refused.admitted = False
    assert verdict([check], refused, [LIMIT], False) == (False, (False,), (False,))
    admitted = Counts([LIMIT + 1])
    admitted.admitted = True
    assert verdict([check], admitted, [LIMIT], False) == (True, (True,), (False,))
    plain = Counts([3])  # no script verdict (Cluster, several slots): the shared rule
    assert verdict([check], plain, [LIMIT], False) == (True, (False,), (True,))
