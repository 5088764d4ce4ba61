"""The memory backend reports the event loop's lag too (issue 25).

Every mode answers on one event loop, and a stall past Envoy's timeout fails open in
every mode; the lag detector used to run only with Redis, so a memory-mode sidecar
could not show its stalls. These block a real loop and read the stall back.
"""

from __future__ import annotations

import asyncio
import time

from sidecar.limiter.memory import MemoryLimiter
from sidecar.metrics import limiter_families


async def test_a_blocked_loop_shows_in_the_memory_backends_loop_lag_metrics() -> None:
    limiter = MemoryLimiter()
    await limiter.start()
    try:
        await asyncio.sleep(0.05)
        time.sleep(0.03)  # the loop cannot run the 10 ms tick for at least 20 ms past its due time
        await asyncio.sleep(0.02)
        names = {family.name: family for family in limiter_families(limiter.snapshot())}
        assert names["ratelimit_sidecar_event_loop_lag_max_seconds"].samples[0].value >= 0.02
        assert "ratelimit_sidecar_event_loop_lag_seconds" in names
        assert "ratelimit_sidecar_redis_up" not in names
    finally:
        await limiter.close()


async def test_the_max_starts_over_at_each_scrape_and_close_stops_the_timer() -> None:
    limiter = MemoryLimiter()
    await limiter.start()
    await asyncio.sleep(0.03)
    time.sleep(0.03)
    await asyncio.sleep(0.02)
    assert (limiter.snapshot().loop_lag_max or 0.0) >= 0.02
    assert limiter.snapshot().loop_lag_max == 0.0  # taken by the previous scrape, no tick since
    await limiter.close()
    counted = ticks_seen(limiter)
    await asyncio.sleep(0.05)
    assert ticks_seen(limiter) == counted


def ticks_seen(limiter: MemoryLimiter) -> int:
    histogram = limiter.snapshot().loop_lag
    assert histogram is not None
    return sum(histogram.counts)
