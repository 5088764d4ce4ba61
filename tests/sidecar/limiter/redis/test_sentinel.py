"""Redis Sentinel (``redis+sentinel://``) against a real master, replica and sentinel.

The sidecar finds the master through the sentinel, counts there in both modes, and
after a failover (the master killed, the replica promoted) it reconnects to the new
master: requests in between are decided by the failure mode, and the hits admitted
meanwhile reach the new master.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from sidecar.limiter.protocol import Check, Limiter
from sidecar.limiter.redis.keys import counter_window
from sidecar.server import build_redis_limiter
from tests.support.redis_servers import RedisSentinel, fresh_prefix, redis_settings
from tests.support.sidecars import OK, OVER_LIMIT, SidecarFactory, in_one_window, request

Build = Callable[..., Limiter]
FAILOVER_DEADLINE = 20.0


@pytest.fixture
async def limiters() -> AsyncIterator[Build]:
    """Build started limiters through ``serve``'s own factory; all are closed at the end."""
    built: list[Limiter] = []

    async def build(url: str, mode: str, **overrides: object) -> Limiter:
        settings = redis_settings(url, mode, 0.5, heartbeat_interval=0.1, sync_interval=0.05, **overrides)
        limiter = build_redis_limiter(settings)
        built.append(limiter)
        await limiter.start()
        return limiter

    yield build
    await asyncio.gather(*(limiter.close() for limiter in built))


def counter_key(prefix: str, check: Check) -> str:
    return counter_window(prefix, check.key, check.unit_seconds, time.time())[0]


@pytest.mark.parametrize("mode", ["strict", "sync"])
async def test_counts_land_on_the_master_the_sentinel_names(
    redis_sentinel: RedisSentinel, limiters: Build, mode: str
) -> None:
    prefix = fresh_prefix()
    limiter = await limiters(redis_sentinel.url, mode, redis_prefix=prefix)
    check = Check((uuid.uuid4().hex,), 60, 5, 1)

    async def attempt() -> list[bool]:
        return [(await limiter.check([check], time.time())).admitted for _ in range(7)]

    admitted = await async_in_one_window(60, attempt)
    assert admitted == [True] * 5 + [False] * 2
    await limiter.close()  # sync mode: the last hits go out with the closing flush
    assert redis_sentinel.master.client().get(counter_key(prefix, check)) == "5"


async def test_tls_to_the_sentinel_and_the_master(tls_sentinel: RedisSentinel, limiters: Build) -> None:
    prefix = fresh_prefix()
    limiter = await limiters(tls_sentinel.url, "strict", redis_prefix=prefix)
    check = Check((uuid.uuid4().hex,), 3600, 2, 1)
    admitted = [(await limiter.check([check], time.time())).admitted for _ in range(3)]
    assert admitted == [True, True, False]
    assert limiter.store.available
    assert tls_sentinel.master.client().get(counter_key(prefix, check)) == "2"
    plain = await limiters(tls_sentinel.url.replace("rediss+", "redis+").partition("?")[0], "strict")
    assert not plain.store.available, "a plain-text client must not get through TLS ports"


@pytest.mark.slow
async def test_after_a_failover_the_sidecar_counts_on_the_new_master(
    own_sentinel: RedisSentinel, limiters: Build
) -> None:
    prefix = fresh_prefix()
    limiter = await limiters(own_sentinel.url, "strict", redis_prefix=prefix)
    check = Check((uuid.uuid4().hex,), 3600, 1_000, 1)
    for _ in range(3):
        assert (await limiter.check([check], time.time())).admitted
    # Replication is asynchronous: a master killed before its replica had the third hit
    # leaves the new master one short for good (a loaded CI did). Failover starts once
    # the replica holds all three.
    replicated = await asyncio.to_thread(own_sentinel.master.client().execute_command, "WAIT", 1, 10_000)
    assert replicated == 1, "the replica did not acknowledge the three hits"
    new_master = await asyncio.to_thread(own_sentinel.fail_over)

    deadline = time.monotonic() + FAILOVER_DEADLINE
    admitted = 3
    while time.monotonic() < deadline:
        admitted += (await limiter.check([check], time.time())).admitted
        if limiter.store.available and new_master.client().get(counter_key(prefix, check)) == str(admitted):
            break
        await asyncio.sleep(0.05)
    else:
        pytest.fail(f"not back on the new master within {FAILOVER_DEADLINE}s: {limiter.store.last_error}")
    assert (await limiter.check([check], time.time())).admitted
    assert new_master.client().get(counter_key(prefix, check)) == str(admitted + 1), "decided on the new master"


@pytest.mark.slow
def test_serve_with_a_sentinel_url(
    redis_sentinel: RedisSentinel, start_sidecar: SidecarFactory, config_dir: Path
) -> None:
    prefix = fresh_prefix()
    flags = ["--backend", "redis", "--mode", "strict", "--redis-url", redis_sentinel.url, "--redis-prefix", prefix]
    sidecar = start_sidecar(*flags, "--redis-timeout", "0.5", config=config_dir)

    def attempt() -> list[int]:
        value = uuid.uuid4().hex
        return [sidecar.ask(request("it", [("per_minute", value)])).overall_code for _ in range(7)]

    assert in_one_window(60, attempt) == [OK] * 5 + [OVER_LIMIT] * 2
    client = redis_sentinel.master.client()
    counters = [client.get(key) for key in client.scan_iter(f"{prefix}:*") if not key.endswith(":replicas")]
    assert counters == ["5"]
    sidecar.kill()


async def async_in_one_window(unit_seconds: int, attempt: Callable[[], object], tries: int = 4) -> object:
    """``in_one_window`` for coroutines: retry when a window boundary fell inside the attempt."""
    for _ in range(tries):
        window = int(time.time()) // unit_seconds
        result = await attempt()  # type: ignore[misc]
        if int(time.time()) // unit_seconds == window:
            return result
    pytest.fail(f"no attempt fit in one {unit_seconds} s window")
