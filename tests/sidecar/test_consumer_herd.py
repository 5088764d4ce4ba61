"""sidecar.consumer under a herd, and its pace table, on a virtual clock.

A fake sidecar stands in for the RPC: one limit per wall second, asks answered one after
another (``SERVICE`` seconds each, so a burst of asks queues as at a real, busy sidecar),
and each ask's gRPC ``timeout`` honoured (``DEADLINE_EXCEEDED`` when the answer would come
later). The event loop's clock is virtual (:mod:`tests.support.virtual_time`): the times
asserted are the loop's, never the machine's. The same herd against a real sidecar is
measured by ``python -m loadtest.consumer_herd`` (docs/consumer.md).
"""

from __future__ import annotations

import asyncio
import math
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from google.protobuf.duration_pb2 import Duration

from sidecar.consumer import ANSWER_SLACK, Consumer, RateLimitExceeded, request_payload
from sidecar.consumer_pace import (
    MAX_PACES,
    Ask,
    AwaitAnswer,
    Fail,
    Hold,
    Pace,
    PaceTable,
    Queue,
    Reading,
    plan_turn,
)
from sidecar.protos.envoy.service.ratelimit.v3 import rls_pb2
from tests.support.virtual_time import run_virtual

Response = rls_pb2.RateLimitResponse
SERVICE = 0.0007
"""Seconds the fake sidecar spends on one ask (about what the real one does under a burst)."""
WALL_OFFSET = 1_000_000.3
"""The fake's Unix time is the loop's plus this: the herd starts 0.3 s into a second."""


class FakeSidecar:
    """``limit`` hits per wall second (``unit``), answering asks in turn; records each ask's deadline."""

    def __init__(self, limit: int, unit: int = Response.RateLimit.SECOND, window: float = 1.0) -> None:
        self.limit = limit
        self.unit = unit
        self.window = window
        self.counts: dict[int, int] = {}
        self.free_at = 0.0
        self.asks: list[tuple[float, float | None]] = []
        """(sent at, gRPC timeout) of every ask."""

    def wall(self) -> float:
        return asyncio.get_running_loop().time() + WALL_OFFSET

    async def __call__(self, payload: bytes, timeout: float | None = None) -> Any:
        now = asyncio.get_running_loop().time()
        self.asks.append((now, timeout))
        done = max(now, self.free_at) + SERVICE
        self.free_at = done
        if timeout is not None and done > now + timeout:
            await asyncio.sleep(timeout)
            raise grpc.aio.AioRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, details="Deadline Exceeded")
        await asyncio.sleep(done - now)
        wall = done + WALL_OFFSET
        window = math.floor(wall / self.window)
        used = self.counts.get(window, 0)
        admitted = used < self.limit
        self.counts[window] = used + int(admitted)
        code = Response.OK if admitted else Response.OVER_LIMIT
        status = Response.DescriptorStatus(
            code=code,
            current_limit=Response.RateLimit(requests_per_unit=self.limit, unit=self.unit),
            limit_remaining=self.limit - self.counts[window],
            duration_until_reset=Duration(seconds=max(1, math.ceil((window + 1) * self.window - wall))),
        )
        return Response(overall_code=code, statuses=[status])


def consumer_on(fake: FakeSidecar) -> Consumer:
    loop = asyncio.get_running_loop()
    consumer = Consumer("127.0.0.1:1", monotonic=loop.time, wall=fake.wall)
    consumer._method = lambda: fake  # type: ignore[method-assign]
    return consumer


async def herd(fake: FakeSidecar, callers: int, max_wait: float) -> tuple[Consumer, float, list[tuple[float, bool]]]:
    """``callers`` callers released together; (the consumer, the start, each one's (wait, admitted))."""
    consumer = consumer_on(fake)
    loop = asyncio.get_running_loop()
    started = loop.time()
    outcomes: list[tuple[float, bool]] = []

    async def caller() -> None:
        try:
            await consumer.acquire("herd", {"provider": "acme"}, max_wait=max_wait)
            outcomes.append((loop.time() - started, True))
        except RateLimitExceeded:
            outcomes.append((loop.time() - started, False))

    await asyncio.gather(*(caller() for _ in range(callers)))
    return consumer, started, outcomes


def test_no_caller_of_a_herd_is_answered_after_its_max_wait_and_slack() -> None:
    async def scenario() -> None:
        fake = FakeSidecar(limit=20)
        consumer, _, outcomes = await herd(fake, callers=600, max_wait=1.0)
        assert len(outcomes) == 600
        waits = [wait for wait, _ in outcomes]
        assert max(waits) <= 1.0 + ANSWER_SLACK, sorted(waits)[-5:]
        admitted = sum(1 for _, ok in outcomes if ok)
        assert admitted >= 20  # the herd is served what there is, not failed wholesale
        assert max(fake.counts.values()) <= 20
        # Callers that cannot be served in time are told so without an ask each.
        assert len(fake.asks) <= 3 * 20, len(fake.asks)
        assert consumer.stats.unanswered == 0

    run_virtual(scenario())


def test_every_ask_carries_the_deadline_left_of_max_wait() -> None:
    async def scenario() -> None:
        fake = FakeSidecar(limit=20)
        _, started, _ = await herd(fake, callers=600, max_wait=1.0)
        assert fake.asks
        for sent_at, timeout in fake.asks:
            assert timeout is not None
            assert sent_at + timeout <= started + 1.0 + ANSWER_SLACK + 1e-9, (sent_at - started, timeout)

    run_virtual(scenario())


def test_the_first_ask_of_a_fail_fast_call_waits_only_the_slack() -> None:
    async def scenario() -> None:
        fake = FakeSidecar(limit=5)
        await herd(fake, callers=3, max_wait=0.0)
        assert [timeout for _, timeout in fake.asks] == [pytest.approx(ANSWER_SLACK)] * 3

    run_virtual(scenario())


def test_a_caller_that_cannot_be_served_in_time_fails_without_waiting() -> None:
    async def scenario() -> None:
        # A minute's budget of 5: the herd takes it, the others fail at once (the minute ends after 1 s).
        fake = FakeSidecar(limit=5, unit=Response.RateLimit.MINUTE, window=60.0)
        consumer, _, outcomes = await herd(fake, callers=50, max_wait=1.0)
        refused = [wait for wait, ok in outcomes if not ok]
        assert len(refused) == 45
        assert max(refused) < 0.05  # told at the first answer, not at its deadline
        assert len(fake.asks) <= 5 + 2
        assert consumer.stats.failed_fast == 45

    run_virtual(scenario())


# ---------------------------------------------------------------------------- the pace table


def test_the_pace_table_stays_within_its_cap_when_spent_windows_pin_it() -> None:
    async def scenario() -> None:
        fake = FakeSidecar(limit=0, unit=Response.RateLimit.DAY, window=86_400.0)  # a spent day
        consumer = consumer_on(fake)
        for n in range(6_001):
            with pytest.raises(RateLimitExceeded):
                await consumer.acquire("herd", {"provider": f"p{n}"}, max_wait=1.0)
        assert len(consumer._paces) == MAX_PACES
        assert request_payload("herd", {"provider": "p6000"}, 1) in consumer._paces  # the newest are kept
        assert request_payload("herd", {"provider": "p0"}, 1) not in consumer._paces

    run_virtual(scenario())


class CountingOrderedDict(OrderedDict[bytes, Any]):
    """An ordered dict that counts walks over it (an O(n) scan per new request would show here)."""

    walks = 0

    def __iter__(self) -> Iterator[bytes]:
        self.walks += 1
        return super().__iter__()

    def items(self) -> Any:
        self.walks += 1
        return super().items()

    def values(self) -> Any:
        self.walks += 1
        return super().values()


def test_a_new_request_never_scans_the_pace_table_and_the_least_recently_used_goes() -> None:
    table = PaceTable(cap=8)
    store = table._paces = CountingOrderedDict()
    for n in range(1, 20):
        table.get(f"k{n}".encode())
        table.get(b"k0")  # used every time: never the least recently used
    assert len(table) == 8
    assert store.walks == 0
    assert b"k0" in table and b"k19" in table and b"k11" not in table


# ---------------------------------------------------------------------------- the rule, state by state


def answered(now: float, *, remaining: float, interval: float = 0.1, renews_in: float = 0.5) -> Pace:
    pace = Pace()
    pace.learn(Reading(interval, remaining, renews_in, fresh_for=renews_in), now)
    return pace


def test_plan_before_the_first_answer_one_probe_and_the_others_wait_for_it() -> None:
    pace = Pace()
    assert plan_turn(pace, now=10.0, latest=11.0, hits=1) == Ask(probe=True)
    pace.probing = True
    assert plan_turn(pace, now=10.0, latest=11.0, hits=1) == AwaitAnswer()
    assert plan_turn(pace, now=10.0, latest=10.0, hits=1) == Ask(out_of_turn=True)  # no time to wait
    stale = answered(10.0, remaining=5)
    assert plan_turn(stale, now=10.6, latest=11.0, hits=1) == Ask(probe=True)  # its window has ended


def test_plan_with_a_fresh_answer_queues_holds_fails_or_asks_out_of_turn() -> None:
    pace = answered(10.0, remaining=3, interval=0.1, renews_in=0.5)
    assert plan_turn(pace, now=10.0, latest=11.0, hits=1) == Queue()
    pace.waiting, pace.in_flight = 1, 1
    assert plan_turn(pace, now=10.0, latest=11.0, hits=1) == Queue()  # the third of three
    assert plan_turn(pace, now=10.0, latest=10.15, hits=1) == Ask(out_of_turn=True)  # its turn is at 10.2
    assert plan_turn(pace, now=10.0, latest=11.0, hits=2) == Hold(10.5)  # 2 hits: not left after two claims
    pace.in_flight = 2
    assert plan_turn(pace, now=10.0, latest=11.0, hits=1) == Hold(10.5)  # all three claimed: the next window
    assert plan_turn(pace, now=10.0, latest=10.4, hits=1) == Fail(0.5)  # ... comes too late
    spent = answered(10.0, remaining=0, interval=0.5, renews_in=0.5)
    assert plan_turn(spent, now=10.0, latest=10.3, hits=1) == Fail(0.5)
    assert spent.spent_past(10.3, now=10.0) and not spent.spent_past(10.6, now=10.0)
