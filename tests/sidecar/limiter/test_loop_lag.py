"""The event-loop lag detector and "Redis down is a fact about Redis" (issue 17).

Unit tests on a controllable clock: what :class:`LoopLag` charges to our own loop, and
when :class:`Availability` declares Redis down (connection errors at once; timeouts
only after silence well beyond any budget while the loop was responsive). Then real
Redis: a busy event loop does not mark a healthy Redis down, a paused Redis is marked
down within the silence allowance, and the lag reaches ``/metrics``.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time

import pytest

from sidecar.limiter.loop_lag import LoopLag
from sidecar.limiter.redis.availability import SILENCE_BEFORE_DOWN, Availability, silence_before_down
from sidecar.limiter.redis.store import RedisStore
from sidecar.metrics import limiter_families
from tests.support.redis_servers import RedisServer, fresh_prefix


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def never() -> None:  # a probe that is never run by these unit tests
    raise AssertionError("not probed")


def test_lag_records_latest_max_and_histogram() -> None:
    lag = LoopLag(interval=0.01)
    lag.record(1.00, 1.001)
    lag.record(1.011, 1.041)  # 30 ms late
    lag.record(1.051, 1.051)
    assert lag.latest == 0.0
    assert lag.take_max() == pytest.approx(0.030)
    assert lag.take_max() == 0.0  # max since the last read (one scrape)
    assert sum(lag.buckets.counts) == 3
    assert lag.buckets.total == pytest.approx(0.031)


def test_busy_since_sums_lateness_clipped_to_the_period() -> None:
    lag = LoopLag(interval=0.01)
    lag.record(1.00, 1.00)
    lag.record(1.01, 1.05)  # the loop could not run from 1.01 to 1.05
    lag.record(1.06, 1.06)
    assert lag.busy_since(1.00, 1.06) == pytest.approx(0.04)
    assert lag.busy_since(1.03, 1.06) == pytest.approx(0.02)  # only the part after 1.03
    assert lag.busy_since(1.055, 1.06) == pytest.approx(0.0)
    # Right now the next tick (due 1.07) is overdue by 30 ms: that counts too.
    assert lag.busy_since(1.06, 1.10) == pytest.approx(0.03)


def test_ticks_older_than_the_horizon_are_forgotten() -> None:
    lag = LoopLag(interval=0.01, horizon=1.0)
    lag.record(1.0, 1.5)
    for step in range(300):
        lag.record(2.0 + step * 0.01, 2.0 + step * 0.01)
    assert lag.busy_since(0.0, 4.99) == pytest.approx(0.0)


def test_a_connection_error_marks_redis_down_at_once() -> None:
    async def scenario() -> None:
        availability = Availability(never, 0.02, clock=Clock())
        availability.mark_up()
        availability.failed(ConnectionRefusedError("refused"), request_path=True)
        assert not availability.available
        await availability.close()

    asyncio.run(scenario())


def test_timeouts_mark_redis_down_only_after_silence_beyond_any_budget() -> None:
    async def scenario() -> None:
        clock = Clock()
        lag = LoopLag()
        availability = Availability(never, 0.02, clock=clock, lag=lag)
        availability.mark_up()
        assert availability.down_after == silence_before_down(0.02) == SILENCE_BEFORE_DOWN
        availability.sent()
        for _ in range(4):  # 4 budgets of 20 ms without an answer: slow, not down
            clock.now += 0.02
            lag.record(clock.now - 0.01, clock.now - 0.01)
            availability.failed(TimeoutError(), request_path=True)
        assert availability.available
        clock.now += 0.03
        lag.record(clock.now, clock.now)  # the loop ticked on time: it was responsive
        availability.failed(TimeoutError(), request_path=True)
        assert not availability.available
        assert "event loop was responsive" in availability.last_error
        await availability.close()

    asyncio.run(scenario())


def test_silence_during_our_own_lag_is_not_charged_to_redis() -> None:
    async def scenario() -> None:
        clock = Clock()
        lag = LoopLag(interval=0.01)
        availability = Availability(never, 0.02, clock=clock, lag=lag)
        availability.mark_up()
        availability.sent()
        start = clock.now
        # The loop was blocked for 180 of the next 200 ms (a burst, a throttled container).
        lag.record(start, start + 0.09)
        lag.record(start + 0.10, start + 0.19)
        clock.now = start + 0.20
        assert availability.silence() == pytest.approx(0.02)
        availability.failed(TimeoutError(), request_path=True)
        assert availability.available, "an answer read late because we were busy is not Redis's silence"
        availability.answered()
        assert availability.silence() == 0.0
        await availability.close()

    asyncio.run(scenario())


def test_background_timeouts_follow_the_same_rule() -> None:
    async def scenario() -> None:
        clock = Clock()
        availability = Availability(never, 0.02, clock=clock)
        availability.mark_up()
        availability.sent()
        clock.now += 1.0
        availability.failed(TimeoutError(), request_path=False)
        assert not availability.available
        await availability.close()

    asyncio.run(scenario())


# -- against a real redis-server ----------------------------------------------------------


@pytest.mark.redis
async def test_a_busy_loop_does_not_mark_a_healthy_redis_down(redis_server: RedisServer) -> None:
    store = RedisStore.for_url(redis_server.url, prefix=fresh_prefix(), redis_timeout=0.005)
    await store.start()
    try:
        assert store.available
        for _ in range(5):
            call = asyncio.ensure_future(store.client.ping())
            store.availability.sent()
            await asyncio.sleep(0)
            time.sleep(0.15)  # the loop is blocked far past the budget and the silence allowance
            store.note_redis_timeout()
            assert store.available, store.last_error
            await call
            store.availability.answered()
        assert store.availability.lag.take_max() >= 0.1
    finally:
        await store.close()


@pytest.mark.redis
async def test_a_paused_redis_is_marked_down_once_silent_with_our_loop_responsive(own_redis: RedisServer) -> None:
    store = RedisStore.for_url(own_redis.url, prefix=fresh_prefix(), redis_timeout=0.005)
    await store.start()
    assert own_redis.process is not None
    pid = own_redis.process.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        call = asyncio.ensure_future(store.client.ping())
        store.availability.sent()
        # No wall-time figure: the store's own silence (loop lag subtracted; it only grows)
        # decides. Not before the threshold (the reason's figure), and at the first timeout
        # noted once past it (checked before each note). The deadline is only a guard.
        threshold = store.availability.down_after
        deadline = time.monotonic() + 10.0
        while store.available and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
            past = store.availability.silence() >= threshold
            store.note_redis_timeout()
            assert not (past and store.available), "silent past the threshold, still marked up"
        assert not store.available
        silent = re.search(r"no answer for (\d+) ms while this process's event loop was responsive", store.last_error)
        assert silent is not None, store.last_error
        assert int(silent[1]) >= SILENCE_BEFORE_DOWN * 1000
    finally:
        os.kill(pid, signal.SIGCONT)
        call.cancel()
        await asyncio.gather(call, return_exceptions=True)
        await store.close()


@pytest.mark.redis
async def test_loop_lag_and_failure_reasons_reach_the_metrics(redis_server: RedisServer) -> None:
    store = RedisStore.for_url(redis_server.url, prefix=fresh_prefix())
    await store.start()
    try:
        await asyncio.sleep(0.05)
        time.sleep(0.03)
        await asyncio.sleep(0.02)
        snapshot = store.snapshot(counters=0, evictions=0, replicas=1, pending_hits=0, failure_reasons={"deadline": 2})
        names = {family.name: family for family in limiter_families(snapshot)}
        assert names["ratelimit_sidecar_event_loop_lag_max_seconds"].samples[0].value >= 0.02
        assert "ratelimit_sidecar_event_loop_lag_seconds" in names
        reasons = names["ratelimit_sidecar_failure_decisions"]
        assert {sample.labels["reason"]: sample.value for sample in reasons.samples}["deadline"] == 2
    finally:
        await store.close()
