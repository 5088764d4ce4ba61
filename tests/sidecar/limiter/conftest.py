"""Strict-mode limiters against real redis-server processes, shared by the strict test modules."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest

from sidecar.limiter.strict import StrictLimiter
from sidecar.server import build_strict_limiter
from sidecar.settings import Settings
from tests.support.redis_servers import redis_settings

GENEROUS = 2.0
"""Budget for exactness tests: a slow answer on a busy machine must not switch modes."""

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
