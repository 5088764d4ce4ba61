"""``count_past_limit``: hits counted past the limit, in every backend.

A response-phase cost (Envoy's ``apply_on_stream_done``, an LLM's tokens) arrives after
the work is done: it must count even when it takes the counter past the limit, and the
request-phase checks (0 hits) that follow must then be refused until the window ends.
Every other check keeps all-or-nothing: a refused request adds nothing to it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from sidecar.limiter.algorithms import Algorithm, emission_interval_us
from sidecar.limiter.failure import FailurePolicy
from sidecar.limiter.memory import MemoryLimiter
from sidecar.limiter.protocol import Check, Limiter, Role, decide
from sidecar.limiter.redis.keys import counter_window
from sidecar.limiter.strict import StrictLimiter
from sidecar.limiter.sync import SyncLimiter
from sidecar.limiter.windows import window_start
from sidecar.server import build_redis_limiter, build_strict_limiter
from tests.sidecar.limiter.conftest import steady_now
from tests.support.redis_servers import RedisCluster, RedisServer, fresh_prefix, redis_settings

UNIT = 3600
NOW = 1_700_000_100.0
"""A moment well inside its hour window (window start 1_699_999_200)."""


def cost(limit: int, hits: int, name: str = "tokens", **fields: Any) -> Check:
    return Check((name,), UNIT, limit, hits, count_past=True, **fields)


# -- the shared rule -----------------------------------------------------------------------------


def test_decide_consumes_count_past_checks_of_a_refused_request() -> None:
    checks = [cost(10, 12), Check(("plain",), UNIT, 100, 12)]
    admitted, over, consume = decide(checks, [12, 12], [10, 100], admit_all=False)
    assert (admitted, over, consume) == (False, (True, False), (True, False))
    # Refused by another check: the cost still counts, the plain check still does not.
    checks = [cost(100, 5), Check(("plain",), UNIT, 1, 5)]
    assert decide(checks, [5, 5], [100, 1], admit_all=False) == (False, (False, True), (True, False))


# -- memory --------------------------------------------------------------------------------------


async def test_memory_counts_past_the_limit_then_refuses_zero_hit_checks() -> None:
    limiter = MemoryLimiter()
    first = await limiter.check([cost(1000, 1200)], NOW)
    assert (first.admitted, first.counts, first.over) == (False, (1200,), (True,))
    probe = await limiter.check([cost(1000, 0)], NOW + 1)
    assert (probe.admitted, probe.counts) == (False, (1200,))
    assert limiter.count(("tokens",), UNIT, NOW) == 1200
    # The next window starts empty.
    later = window_start(NOW, UNIT) + UNIT + 1.0
    assert (await limiter.check([cost(1000, 0)], later)).admitted


async def test_memory_without_count_past_adds_nothing_when_refused() -> None:
    limiter = MemoryLimiter()
    plain = Check(("tokens",), UNIT, 1000, 1200)
    assert not (await limiter.check([plain], NOW)).admitted
    assert (await limiter.check([plain._replace(hits=0)], NOW)).admitted
    assert limiter.count(("tokens",), UNIT, NOW) == 0


async def test_memory_keeps_all_or_nothing_for_the_other_checks() -> None:
    limiter = MemoryLimiter()
    checks = [cost(1000, 5), Check(("per_ip",), UNIT, 1, 5)]
    decision = await limiter.check(checks, NOW)
    assert not decision.admitted
    assert limiter.count(("tokens",), UNIT, NOW) == 5
    assert limiter.count(("per_ip",), UNIT, NOW) == 0


@pytest.mark.parametrize("algorithm", [Algorithm.SLIDING_WINDOW, Algorithm.TOKEN_BUCKET])
async def test_memory_other_algorithms_count_past_the_limit(algorithm: Algorithm) -> None:
    limiter = MemoryLimiter()
    interval = emission_interval_us(UNIT, 10) if algorithm is Algorithm.TOKEN_BUCKET else 0
    check = cost(10, 15, algorithm=algorithm, interval_us=interval)
    assert not (await limiter.check([check], NOW)).admitted
    probe = await limiter.check([check._replace(hits=0)], NOW + 1)
    assert not probe.admitted
    assert probe.counts[0] >= 14  # a bucket refills a token while the window estimate holds


async def test_memory_ban_starts_when_a_cost_goes_over() -> None:
    limiter = MemoryLimiter()
    check = cost(10, 11, ban_seconds=600)
    assert not (await limiter.check([check], NOW)).admitted
    after = window_start(NOW, UNIT) + UNIT + 1.0  # a new window, still banned
    assert after - NOW < 600 + UNIT
    banned = await limiter.check([check._replace(hits=0)], min(after, NOW + 500))
    assert not banned.admitted


# -- failure modes (Redis away) ------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["local", "open", "closed"])
def test_failure_modes_owe_costs_of_refused_requests(mode: str) -> None:
    policy = FailurePolicy(mode)  # type: ignore[arg-type]
    checks = [cost(10, 15), Check(("per_ip",), UNIT, 100, 15, Role.ENFORCED)]
    decision = policy.check(checks, ["k:tokens", "k:ip"], [2_000_000_000] * 2, NOW)
    assert decision.admitted is (mode == "open")
    owed = policy.ledger.drain_admitted()
    assert owed["k:tokens"][0] == 15
    assert ("k:ip" in owed) is (mode == "open")


# -- Redis: strict and sync ----------------------------------------------------------------------


@pytest.fixture
async def redis_limiters() -> AsyncIterator[Callable[..., Limiter]]:
    built: list[StrictLimiter | SyncLimiter] = []

    def build(url: str, mode: str, **overrides: object) -> Limiter:
        settings = redis_settings(url, mode, 2.0, heartbeat_interval=0.5, **overrides)
        limiter = build_strict_limiter(settings) if mode == "strict" else build_redis_limiter(settings)
        assert isinstance(limiter, StrictLimiter | SyncLimiter)
        built.append(limiter)
        return limiter

    yield build
    await asyncio.gather(*(limiter.close() for limiter in built))


def stored(client: Any, prefix: str, check: Check, now: float) -> int:
    return int(client.get(counter_window(prefix, check.key, check.unit_seconds, now)[0]) or 0)


async def settle(limiter: Limiter) -> None:
    if isinstance(limiter, SyncLimiter):
        await limiter.sync_once()


@pytest.mark.redis
@pytest.mark.parametrize("mode", ["strict", "sync"])
async def test_redis_counts_a_cost_past_the_limit(
    redis_server: RedisServer, redis_limiters: Callable[..., Limiter], mode: str
) -> None:
    prefix = fresh_prefix()
    limiter = redis_limiters(redis_server.url, mode, redis_prefix=prefix)
    await limiter.start()
    now = await steady_now()
    assert (await limiter.check([cost(1000, 0)], now)).admitted  # the request phase
    report = await limiter.check([cost(1000, 1200)], now)  # the response phase
    assert (report.admitted, report.over) == (False, (True,))
    refused = await limiter.check([cost(1000, 0)], now)
    assert not refused.admitted
    await settle(limiter)
    client = redis_server.client()
    assert stored(client, prefix, cost(1000, 0), now) == 1200
    # All-or-nothing still holds for a check without the flag in the same request.
    plain = Check(("per_user",), UNIT, 5, 10)
    mixed = await limiter.check([cost(1000, 7), plain], now)
    assert not mixed.admitted
    await settle(limiter)
    assert stored(client, prefix, cost(1000, 0), now) == 1207
    assert stored(client, prefix, plain, now) == 0


@pytest.mark.redis
async def test_sync_a_second_replica_refuses_after_the_first_one_counted_past(
    redis_server: RedisServer, redis_limiters: Callable[..., Limiter]
) -> None:
    prefix = fresh_prefix()
    first, second = (redis_limiters(redis_server.url, "sync", redis_prefix=prefix) for _ in range(2))
    for limiter in (first, second):
        await limiter.start()
    now = await steady_now()
    assert (await second.check([cost(1000, 0)], now)).admitted  # marks the counter for reading back
    assert not (await first.check([cost(1000, 1500)], now)).admitted
    await settle(first)
    await settle(second)
    assert not (await second.check([cost(1000, 0)], now)).admitted


@pytest.mark.redis
@pytest.mark.slow
async def test_cluster_cross_slot_costs_are_not_given_back(
    redis_cluster: RedisCluster, redis_limiters: Callable[..., Limiter]
) -> None:
    limiter = redis_limiters(redis_cluster.url, "strict", redis_prefix="cp")
    await limiter.start()
    now = await steady_now()
    # Several names so at least one pair lands in different slots.
    tokens = [cost(100, 150, name=f"cluster-tokens-{index}") for index in range(4)]
    plain = Check(("cluster-plain",), UNIT, 1000, 150)
    for check in tokens:
        decision = await limiter.check([check, plain], now)
        assert not decision.admitted
    await asyncio.sleep(0.3)  # give-backs of the plain check run off the request path
    client = redis_cluster.client()
    assert [stored(client, "cp", check, now) for check in tokens] == [150] * 4
    assert stored(client, "cp", plain, now) == 0
    assert not (await limiter.check([tokens[0]._replace(hits=0)], now)).admitted
