"""Strict and sync limiters against real redis-server processes, shared by their test modules."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Sequence

import pytest

from sidecar.limiter.redis.store import RedisStore
from sidecar.limiter.strict import StrictLimiter
from sidecar.limiter.sync import SyncLimiter
from sidecar.limiter.windows import window_start
from sidecar.server import build_redis_limiter, build_strict_limiter
from sidecar.settings import Settings
from tests.support.redis_servers import fresh_prefix, redis_settings

HOUR = 3600
"""The window of the in-process Redis tests: long, so a test never straddles a boundary."""
GENEROUS = 2.0
"""Request budget of the exactness tests: a slow answer on a loaded machine must not switch a
decision to the failure mode (the tests assert it never does)."""

Factory = Callable[..., StrictLimiter]


def strict_settings(url: str, **overrides: object) -> Settings:
    return redis_settings(url, "strict", GENEROUS, **{"heartbeat_interval": 0.1, **overrides})


@pytest.fixture
async def limiters() -> AsyncIterator[Factory]:
    """Build StrictLimiters (replicas; start them in the test); every one is closed when the test ends."""
    built: list[StrictLimiter] = []

    def build(url: str, **overrides: object) -> StrictLimiter:
        limiter = build_strict_limiter(strict_settings(url, **overrides))
        built.append(limiter)
        return limiter

    yield build
    await asyncio.gather(*(limiter.close() for limiter in built))


def sync_settings(url: str, **overrides: object) -> Settings:
    # A replica is dead after 3 missed beats: 1.5 s, far beyond any stall of the shared
    # event loop, so no replica drops out (and enlarges its blind cap) mid-test.
    defaults: dict[str, object] = {"heartbeat_interval": 0.5, "sync_interval": 0.05}
    return redis_settings(url, "sync", GENEROUS, **{**defaults, **overrides})


class Fleet:
    """Builds SyncLimiters the way ``serve`` does; closes what the test did not."""

    def __init__(self) -> None:
        self.built: list[SyncLimiter] = []
        self.closed: set[int] = set()

    def build(self, url: str, **overrides: object) -> SyncLimiter:
        limiter = build_redis_limiter(sync_settings(url, **overrides))
        assert isinstance(limiter, SyncLimiter)
        self.built.append(limiter)
        return limiter

    def group(self, count: int, url: str, **overrides: object) -> list[SyncLimiter]:
        prefix = str(overrides.pop("redis_prefix", fresh_prefix()))
        return [self.build(url, redis_prefix=prefix, **overrides) for _ in range(count)]

    async def close(self, *limiters: SyncLimiter) -> None:
        todo = [limiter for limiter in limiters if id(limiter) not in self.closed]
        self.closed.update(id(limiter) for limiter in todo)
        await asyncio.gather(*(limiter.close() for limiter in todo))

    async def close_all(self) -> None:
        await self.close(*self.built)


@pytest.fixture
async def fleet() -> AsyncIterator[Fleet]:
    built = Fleet()
    yield built
    await built.close_all()


async def steady_now(unit: int = HOUR, margin: float = 60.0) -> float:
    """Now, or just after the next window if this one ends within ``margin`` seconds.

    Tests pass one ``now`` to every check so all hits land in one window; its Redis key
    expires 5 s after the window ends, so the window must outlive the test.
    """
    now = time.time()
    left = window_start(now, unit) + unit - now
    if left < margin:
        await asyncio.sleep(left + 0.05)
        now = time.time()
    return now


def none_waited_for_a_timeout(durations: Sequence[float], store: RedisStore) -> None:
    """No call waited for Redis's socket or background timeout (``store.background_timeout``,
    at least 1 s) while Redis was away or paused.

    A call decided by the failure mode returns at once, or after its own budget (5 ms);
    one that waited for a timeout took the whole timeout. Half of it tells the two apart
    with a hundredfold headroom for a loaded machine: this is not a latency figure (those
    are the reliability report's), only which of the two happened.
    """
    bound = store.background_timeout / 2
    assert max(durations) < bound, [round(took, 4) for took in durations]
