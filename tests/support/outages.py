"""Pieces the Redis outage and failover tests share: limiters built as ``serve`` builds them,
waits for a state change, and a probe held down to make one replica return late."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from sidecar.limiter.redis.availability import Availability
from sidecar.limiter.redis.store import RedisStore
from sidecar.limiter.strict import StrictLimiter
from sidecar.limiter.sync import SyncLimiter
from sidecar.server import build_redis_limiter, build_strict_limiter
from tests.sidecar.limiter.conftest import strict_settings, sync_settings

Limiter = StrictLimiter | SyncLimiter


def build_limiter(mode: str, url: str, **options: Any) -> Limiter:
    """A ``strict`` or ``sync`` limiter on Redis at ``url``, ``options`` as settings."""
    if mode == "strict":
        return build_strict_limiter(strict_settings(url, **options))
    limiter = build_redis_limiter(sync_settings(url, **options))
    assert isinstance(limiter, SyncLimiter)
    return limiter


async def until(condition: Callable[[], object], what: str, wait: float) -> None:
    """Return once ``condition()`` holds; fail naming ``what`` after ``wait`` seconds (a bound
    generous enough for a loaded machine, never a measured time)."""
    deadline = time.monotonic() + wait
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        await asyncio.sleep(0.01)


def hold_probe(store: RedisStore) -> list[bool]:
    """Keep ``store``'s probe failing while the returned flag holds True (its backoff, stretched)."""
    return hold_availability(store.availability)


def hold_availability(availability: Availability) -> list[bool]:
    """Keep ``availability``'s probe (a store's, or in Cluster one master's) failing while
    the returned flag holds True."""
    held = [True]
    probe = availability._probe_once

    async def held_probe() -> None:
        if held[0]:
            raise ConnectionRefusedError("held down by the test")
        await probe()

    availability._probe_once = held_probe  # type: ignore[method-assign]
    return held
