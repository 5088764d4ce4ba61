"""sidecar.consumer: wait for a slot, fail fast, spend nothing when cancelled.

The timing rules are tested on their own (deterministic clocks); the policies against
the shared sidecar process (memory backend, domain ``it``: ``per_second`` 3/s,
``per_minute`` 5/min, ``generous``); the in-flight cancellation with a slow ask put
in place of the RPC. The shared budget across replicas through Redis is proven in
``test_consumer_shared_budget.py``.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import random
import time
import uuid
from typing import Any

import pytest
from google.protobuf.duration_pb2 import Duration

from sidecar import consumer as consumer_module
from sidecar.consumer import (
    FAIL_FAST,
    WAIT,
    Consumer,
    RateLimitExceeded,
    Refused,
    SidecarError,
    SyncConsumer,
    refusal,
    request_payload,
    window_end,
)
from sidecar.consumer_pace import pace_interval
from sidecar.protos.envoy.service.ratelimit.v3 import rls_pb2
from tests.support.sidecars import Sidecar, free_port
from tests.support.virtual_time import run_virtual

pytestmark = pytest.mark.slow

MINUTE = rls_pb2.RateLimitResponse.RateLimit.MINUTE
SECOND = rls_pb2.RateLimitResponse.RateLimit.SECOND


WAITERS_MAX_WAIT = 30.0
"""Far more than the three windows seven waiters need: only a broken wait can run out of it."""


def fresh() -> str:
    return uuid.uuid4().hex


def status(code: int, unit: int, reset: int, remaining: int = 0) -> Any:
    return rls_pb2.RateLimitResponse.DescriptorStatus(
        code=code,
        current_limit=rls_pb2.RateLimitResponse.RateLimit(requests_per_unit=5, unit=unit),
        limit_remaining=remaining,
        duration_until_reset=Duration(seconds=reset),
    )


# ---------------------------------------------------------------------------- when to ask again


def test_refusal_takes_the_latest_reset_of_the_limits_that_refused():
    response = rls_pb2.RateLimitResponse(
        overall_code=rls_pb2.RateLimitResponse.OVER_LIMIT,
        statuses=[
            status(rls_pb2.RateLimitResponse.OK, SECOND, 1, remaining=3),
            status(rls_pb2.RateLimitResponse.OVER_LIMIT, MINUTE, 42),
        ],
    )
    assert refusal(response) == Refused(42.0, 60.0)


@pytest.mark.parametrize(
    ("now", "reset", "window", "end"),
    [
        (1000.25, 1, 1, 1001.0),  # the next second
        (1000.999, 1, 1, 1001.0),
        (1000.0001, 1, 1, 1001.0),
        (1030.5, 50, 60, 1080.0),  # the minute's end, not now + 50
        (1030.5, 170, 60, 1200.0),  # a 5-minute window ends on a minute too
        (1030.5, 50, 300, 1080.5),  # the unit disagrees with the reset (skewed clocks): now + reset
    ],
)
def test_window_end_is_snapped_to_the_unit_when_the_reset_allows(now, reset, window, end):
    assert window_end(now, Refused(reset, window)) == pytest.approx(end)


def test_retries_spread_uniformly_over_the_window_and_never_past_the_deadline():
    consumer = Consumer("127.0.0.1:1", wall=lambda: 1000.4, rng=random.Random(7))
    delays = [consumer._retry_delay(Refused(1, 1), time_left=10.0) for _ in range(2000)]
    assert all(delay is not None and 0.6 <= delay <= 1.6 for delay in delays)
    tenths = [
        sum(1 for delay in delays if delay is not None and 0.6 + k / 10 <= delay < 0.7 + k / 10) for k in range(10)
    ]
    assert min(tenths) > 150  # 200 expected in each tenth of the window
    capped = [consumer._retry_delay(Refused(1, 1), time_left=0.9) for _ in range(200)]
    assert all(delay is not None and delay <= 0.9 - 0.005 for delay in capped)
    assert consumer._retry_delay(Refused(1, 1), time_left=0.5) is None  # the boundary is past the deadline
    assert Consumer("x", wall=lambda: 1000.4, spread=False)._retry_delay(Refused(1, 1), 10.0) == pytest.approx(0.6)


def test_the_pace_spends_what_is_left_evenly_until_the_window_ends():
    ok, over = rls_pb2.RateLimitResponse.OK, rls_pb2.RateLimitResponse.OVER_LIMIT
    admitted = rls_pb2.RateLimitResponse(overall_code=ok, statuses=[status(ok, SECOND, 1, remaining=4)])
    assert pace_interval(admitted, 1, wall=1000.5) == (pytest.approx(0.1), False)  # 0.5 s for 4 + this one
    assert pace_interval(admitted, 2, wall=1000.5) == (pytest.approx(0.5 * 2 / 6), False)
    two = rls_pb2.RateLimitResponse(
        overall_code=ok, statuses=[status(ok, SECOND, 1, remaining=4), status(ok, MINUTE, 30, remaining=2)]
    )
    assert pace_interval(two, 1, wall=1030.0) == (pytest.approx(10.0), False)  # the minute's 2 left bind
    spent = rls_pb2.RateLimitResponse(overall_code=ok, statuses=[status(ok, SECOND, 1, remaining=0)])
    assert pace_interval(spent, 1, wall=1000.75) == (pytest.approx(0.25), True)  # the next window
    refused = rls_pb2.RateLimitResponse(overall_code=over, statuses=[status(over, MINUTE, 42)])
    assert pace_interval(refused, 1, wall=1038.5) == (pytest.approx(41.5), True)  # the minute ends at 1080
    unlimited = rls_pb2.RateLimitResponse(overall_code=ok, statuses=[rls_pb2.RateLimitResponse.DescriptorStatus()])
    assert pace_interval(unlimited, 1, wall=1000.0) == (0.0, False)


def test_fresh_asks_wait_their_turn_unless_their_deadline_comes_first() -> None:
    """On virtual time (the consumer's clock is the loop's): the gaps are the pace's, whatever the load."""

    async def main() -> None:
        ok = rls_pb2.RateLimitResponse.OK
        wall = [1000.0]
        clock = asyncio.get_running_loop().time
        consumer = Consumer("127.0.0.1:1", wall=lambda: wall[0], monotonic=clock)
        # 1 s window: 9 left after the first ask, so one ask every 0.1 s.
        script = [
            (0.0, rls_pb2.RateLimitResponse(overall_code=ok, statuses=[status(ok, SECOND, 1, 9 - n)])) for n in range(5)
        ]
        asks = scripted_asks(consumer, script)
        await asyncio.gather(*(consumer.acquire("it", {"k": "v"}, max_wait=WAIT) for _ in range(3)))
        gaps = [later - earlier for earlier, later in itertools.pairwise(asks)]
        assert len(asks) == 3 and all(gap > 0.08 for gap in gaps), gaps
        assert consumer.stats.paced == 2
        # The next turn is 0.1 s away: a caller with 0.02 s to wait asks at once, out of turn.
        before, now = len(asks), clock()
        await consumer.acquire("it", {"k": "v"}, max_wait=0.02)
        assert asks[before:] == [now], "one ask, at once: no time passed before it"
        assert consumer.stats.out_of_turn == 1
        assert Consumer("127.0.0.1:1", pace=False).pace is False
        await consumer.close()

    run_virtual(main())


def test_requests_outside_the_bounds_fail_before_asking():
    with pytest.raises(ValueError, match=r"descriptors\[0\].entries\[0\].key: must not be empty"):
        request_payload("it", {"": "v"}, 1)
    with pytest.raises(ValueError, match="hits"):
        request_payload("it", "k=v", 0)
    one = request_payload("it", "a=1,b=2", 1)
    assert (
        one == request_payload("it", [{"a": "1", "b": "2"}], 1) == request_payload("it", [[("a", "1"), ("b", "2")]], 1)
    )


# ---------------------------------------------------------------------------- against a sidecar


async def test_admitted_at_once(shared_sidecar: Sidecar) -> None:
    async with Consumer(shared_sidecar.address) as consumer:
        permit = await consumer.acquire("it", {"generous": fresh()})
        assert permit.attempts == 1  # at once: one ask, no retry or turn waited for
        assert permit.remaining == 999_999
        assert consumer.stats.paced == consumer.stats.failed_fast == 0


async def test_waiters_get_the_next_windows_and_no_window_admits_more_than_its_limit(shared_sidecar: Sidecar) -> None:
    value = fresh()
    admitted_at: list[float] = []
    async with Consumer(shared_sidecar.address) as consumer:

        async def one() -> None:
            await consumer.acquire("it", {"per_second": value}, max_wait=WAITERS_MAX_WAIT)
            admitted_at.append(time.time())

        await asyncio.gather(*(one() for _ in range(7)))  # 3 per second: three windows
        windows: dict[int, int] = {}
        for moment in admitted_at:
            windows[math.floor(moment)] = windows.get(math.floor(moment), 0) + 1
        assert max(windows.values()) <= 3
        assert len(windows) >= 3, f"7 at 3 a second need three windows: {windows}"
        assert consumer.stats.granted == consumer.stats.acquired == 7


class CountedWaits:
    """``asyncio`` as ``sidecar.consumer`` sees it, recording every sleep and bounded wait it starts."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(asyncio, name)

    def sleep(self, delay: float, *args: Any) -> Any:
        self.calls.append(("sleep", delay))
        return asyncio.sleep(delay, *args)

    def wait_for(self, awaitable: Any, timeout: float | None) -> Any:
        self.calls.append(("wait_for", timeout))
        return asyncio.wait_for(awaitable, timeout)

    def wait(self, tasks: Any, **options: Any) -> Any:
        self.calls.append(("wait", options.get("timeout")))
        return asyncio.wait(tasks, **options)

    def timeout(self, delay: float | None) -> Any:
        self.calls.append(("timeout", delay))
        return asyncio.timeout(delay)


async def test_fail_fast_and_no_waiting_in_vain(shared_sidecar: Sidecar, monkeypatch: pytest.MonkeyPatch) -> None:
    value = fresh()
    async with Consumer(shared_sidecar.address) as consumer:
        for _ in range(5):
            await consumer.acquire("it", {"per_minute": value})
        with pytest.raises(RateLimitExceeded) as failed:
            await consumer.acquire("it", {"per_minute": value}, max_wait=FAIL_FAST)
        assert failed.value.attempts == 1
        fails = 1
        seconds_left = 60 - time.time() % 60
        if seconds_left > 2.5:  # the minute's budget comes back after the deadline: fail now, not in 2 s
            waits = CountedWaits()
            monkeypatch.setattr(consumer_module, "asyncio", waits)
            with pytest.raises(RateLimitExceeded) as failed:
                await consumer.acquire("it", {"per_minute": value}, max_wait=2)
            monkeypatch.undo()
            assert failed.value.retry_after is not None and failed.value.retry_after > 2
            # Counted, not timed: the pace's known refusal; no ask, no sleep, no wait.
            assert failed.value.attempts == 0 and consumer.stats.asks == 6
            assert waits.calls == [], "waited before failing"
            fails = 2
        assert consumer.stats.failed_fast == fails and consumer.stats.timed_out == 0
        assert consumer.stats.granted == 5


async def test_cancelled_waits_spend_nothing(shared_sidecar: Sidecar) -> None:
    value = fresh()
    async with Consumer(shared_sidecar.address) as consumer:
        for _ in range(3):
            await consumer.acquire("it", {"per_second": value})
        waiters = [
            asyncio.ensure_future(consumer.acquire("it", {"per_second": value}, max_wait=WAIT)) for _ in range(5)
        ]
        await asyncio.sleep(0.02)  # each has been refused and sleeps until its retry
        for waiter in waiters:
            waiter.cancel()
        await asyncio.gather(*waiters, return_exceptions=True)
        assert consumer.stats.cancelled == 5
        assert consumer.stats.granted == 3
        await asyncio.sleep(1.05)  # the next second: its whole budget is there
        permit = await consumer.acquire("it", {"per_second": value}, max_wait=FAIL_FAST)
        assert permit.remaining == 2


async def test_context_manager_and_decorator(shared_sidecar: Sidecar) -> None:
    value = fresh()
    async with Consumer(shared_sidecar.address) as consumer:
        async with consumer.slot("it", {"pair_b": value}) as permit:
            assert permit.remaining == 1

        @consumer.limited("it", {"pair_b": value}, max_wait=FAIL_FAST)
        async def call_provider(x: int) -> int:
            return x * 2

        assert await call_provider(21) == 42
        with pytest.raises(RateLimitExceeded):
            await call_provider(1)
        assert call_provider.__name__ == "call_provider"


def test_sync_wrapper(shared_sidecar: Sidecar) -> None:
    value = fresh()
    with SyncConsumer(shared_sidecar.address) as consumer:
        with consumer.slot("it", {"pair_b": value}) as permit:
            assert permit.remaining == 1

        @consumer.limited("it", {"pair_b": value}, max_wait=FAIL_FAST)
        def call_provider() -> str:
            return "called"

        assert call_provider() == "called"
        with pytest.raises(RateLimitExceeded):
            call_provider()
        assert consumer.stats.granted == 2


async def test_sidecar_errors_are_raised_at_once() -> None:
    async with Consumer(f"127.0.0.1:{free_port()}", rpc_timeout=0.5) as consumer:
        with pytest.raises(SidecarError) as failed:
            await consumer.acquire("it", {"k": "v"})
        assert failed.value.code.name in {"UNAVAILABLE", "DEADLINE_EXCEEDED"}


# ---------------------------------------------------------------------------- an ask in flight when the caller leaves


def admitted_response() -> Any:
    return rls_pb2.RateLimitResponse(
        overall_code=rls_pb2.RateLimitResponse.OK, statuses=[status(rls_pb2.RateLimitResponse.OK, MINUTE, 30, 3)]
    )


def refused_response() -> Any:
    return rls_pb2.RateLimitResponse(
        overall_code=rls_pb2.RateLimitResponse.OVER_LIMIT,
        statuses=[status(rls_pb2.RateLimitResponse.OVER_LIMIT, SECOND, 1)],
    )


def scripted_asks(consumer: Consumer, script: list[tuple[float, Any]]) -> list[float]:
    """Put scripted asks (delay, response) in place of the RPC; returns when each ask started."""
    started: list[float] = []

    async def ask(payload: bytes, timeout: float) -> Any:
        started.append(consumer.monotonic())
        delay, response = script.pop(0)
        await asyncio.sleep(delay)
        consumer.stats.asks += 1
        if response.overall_code == rls_pb2.RateLimitResponse.OK:
            consumer.stats.granted += 1
        return response

    consumer._ask = ask  # type: ignore[method-assign]
    return started


def test_an_ask_admitted_after_its_caller_left_is_kept_for_the_next_caller() -> None:
    """On virtual time (the consumer's clock is the loop's)."""

    async def main() -> None:
        # Refused 10 ms before a second ends; the retry at the boundary is admitted, but answers
        # after the caller's deadline (within its gRPC deadline, 0.1 s later). Then a caller
        # cancelled while its ask is in flight (unpaced: paced, it would wait for the answer
        # of the ask still on its way instead of asking).
        clock = asyncio.get_running_loop().time
        consumer = Consumer(
            "127.0.0.1:1", wall=lambda: 1000.99 if len(asks) < 2 else 1001.0, spread=False, pace=False, monotonic=clock
        )
        asks = scripted_asks(
            consumer, [(0.0, refused_response()), (0.35, admitted_response()), (0.2, admitted_response())]
        )
        started = clock()
        with pytest.raises(RateLimitExceeded) as failed:
            await consumer.acquire("it", {"k": "v"}, max_wait=0.3)
        # Left at its deadline, not when the answer came (virtual time: exact, whatever the load).
        assert clock() - started == pytest.approx(0.3)
        assert clock() < asks[1] + 0.35
        assert failed.value.retry_after is None
        assert len(asks) == 2
        caller = asyncio.ensure_future(consumer.acquire("it", {"k": "v"}, max_wait=WAIT))
        await asyncio.sleep(0.05)
        caller.cancel()  # cancelled with its ask in flight
        with pytest.raises(asyncio.CancelledError):
            await caller
        await asyncio.sleep(0.5)
        stats = consumer.stats
        assert (stats.timed_out, stats.cancelled, stats.orphaned, stats.granted) == (1, 1, 2, 2)
        permit = await consumer.acquire("it", {"k": "v"})  # handed over: no ask
        assert permit.handed_over
        assert len(asks) == 3
        assert stats.granted == stats.acquired - stats.reused + stats.orphaned
        await consumer.close()

    run_virtual(main())
