"""Bounded work per loop turn and per tick for many shared buckets (issue 25, defect 3).

Thousands of shared buckets on a fake clock and a simulated Redis (``shares.step``): the
sync cuts its calls, replies and pushes into chunks that yield to the loop between them,
spreads renewals over ticks, and, while Redis is away, leaves a bucket alone once its
fallback is pushed until something changes for it. Everything is counted, not timed.
"""

from __future__ import annotations

import asyncio
import inspect
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace

from sidecar.quota.buckets import bucket_of
from sidecar.quota.leases import TICK, QuotaLeases
from sidecar.quota.redis_shares import SharesUnavailable
from sidecar.quota.registry import QuotaRegistry, QuotaSettings
from sidecar.quota.shares import Bucket, Call, Reply, step
from sidecar.quota.stream import Stream

RULES = """
domain: q
descriptors:
  - key: user
    rate_limit: {unit: second, requests_per_unit: 200}
"""
TTL = 6
PER_TURN = 300
"""What one loop turn may handle: a chunk of a few hundred buckets."""


async def settled(result: object) -> None:
    """Await what a registry call returned, if anything (its methods may be sync or chunked)."""
    if inspect.isawaitable(result):
        await result


@dataclass
class CountingRedis:
    """``shares.step`` on the fake clock; yields once per batch like a round trip, counts
    every call it is handed (also while ``down``: building them is the work being bounded)."""

    clock: object
    buckets: dict[str, Bucket] = field(default_factory=dict)
    down: bool = False
    calls: int = 0
    batch_sizes: list[int] = field(default_factory=list)

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def run(self, calls: Sequence[tuple[list[str], Call]]) -> list[Reply]:
        self.calls += len(calls)
        self.batch_sizes.append(len(calls))
        await asyncio.sleep(0)
        if self.down:
            raise SharesUnavailable("simulated outage")
        now = int(self.clock() * 1000)  # type: ignore[operator]
        return [step(self.buckets.setdefault(keys[0], Bucket()), call, now) for keys, call in calls]


@dataclass
class Pod:
    registry: QuotaRegistry
    leases: QuotaLeases
    stream: Stream
    redis: CountingRedis
    clock: object

    async def report(self, count: int, allowed: int = 5) -> None:
        usages = ((bucket_of("q", [("user", str(i))]), allowed, 0) for i in range(count))
        await settled(self.registry.report(self.stream, "q", usages))


def pod(h: SimpleNamespace) -> Pod:
    clock = h.FakeClock(1000.0)
    redis = CountingRedis(clock)
    leases = QuotaLeases(redis, "a", ttl=TTL, clock=clock, wall=clock)  # type: ignore[arg-type]
    registry = QuotaRegistry(h.config_of(RULES), QuotaSettings(ttl=TTL, max_buckets_per_stream=100_000), clock=clock)
    registry.leases = leases
    return Pod(registry, leases, registry.open("envoy"), redis, clock)


async def tick(p: Pod) -> tuple[int, int]:
    """One sync tick after TICK seconds: (calls handed to Redis, actions pushed)."""
    p.clock.advance(TICK)  # type: ignore[attr-defined]
    calls, pushed = p.redis.calls, p.leases.stats.pushes
    await p.leases.sync()
    return p.redis.calls - calls, p.leases.stats.pushes - pushed


async def per_turn(p: Pod) -> tuple[list[int], list[int]]:
    """Run one sync while a sampler counts, per loop turn, the calls handed to Redis and the
    actions pushed: the work done between two yields."""
    calls: list[int] = []
    pushes: list[int] = []
    task = asyncio.get_running_loop().create_task(p.leases.sync())
    last_calls, last_pushes = p.redis.calls, p.leases.stats.pushes
    while not task.done():
        await asyncio.sleep(0)
        calls.append(p.redis.calls - last_calls)
        pushes.append(p.leases.stats.pushes - last_pushes)
        last_calls, last_pushes = p.redis.calls, p.leases.stats.pushes
    await task
    return calls, pushes


async def test_a_report_of_many_buckets_is_synced_in_chunks_that_yield(h: SimpleNamespace) -> None:
    p = pod(h)
    await p.report(5_000)
    turns: list[tuple[list[int], list[int]]] = []
    for _ in range(int(4 / TICK)):
        p.clock.advance(TICK)  # type: ignore[attr-defined]
        turns.append(await per_turn(p))
    calls = [n for c, _ in turns for n in c]
    pushes = [n for _, pushed in turns for n in pushed]
    assert max(calls) <= PER_TURN, max(calls)
    assert max(pushes) <= PER_TURN, max(pushes)
    assert max(p.redis.batch_sizes) <= PER_TURN
    assert sum(calls) >= 5_000  # every bucket was called


async def test_renewals_of_buckets_adopted_together_are_spread_over_ticks(h: SimpleNamespace) -> None:
    p = pod(h)
    await p.report(4_000)
    for _ in range(int(5 / TICK)):
        await tick(p)
    # No report since: every lease is renewed by its timer, not all in one tick.
    per_tick = [(await tick(p))[0] for _ in range(int(15 / TICK))]
    assert sum(per_tick) >= 4_000  # each renewed at least once
    assert max(per_tick) <= 2_000, max(per_tick)
    assert sum(1 for n in per_tick if n) >= 4


async def test_during_an_outage_a_bucket_is_left_alone_once_its_fallback_is_pushed(h: SimpleNamespace) -> None:
    p = pod(h)
    await p.report(2_000)
    for _ in range(int(3 / TICK)):
        await tick(p)
    p.redis.down = True
    work = []
    for step_ in range(int(40 / TICK)):
        if step_ % int(5 / TICK) == 0:
            await p.report(2_000)  # Envoy keeps reporting every 5 s
        work.append(await tick(p))
    calls = [c for c, _ in work]
    pushes = [pushed for _, pushed in work]
    assert calls[0] <= PER_TURN  # the chunk that found Redis away
    assert max(calls[1:]) <= 1, calls  # then a probe, no more: calls are not built while Redis is away
    assert sum(pushes) == 0, pushes  # nothing changes within the lease and its hold
    assert not p.leases.redis_up


async def test_describe_is_bounded_whatever_the_bucket_count(h: SimpleNamespace) -> None:
    small, big = pod(h), pod(h)
    await small.report(10)
    await big.report(5_000)
    await tick(small)
    for _ in range(int(3 / TICK)):
        await tick(big)
    sizes = [len(json.dumps(p.leases.describe())) for p in (small, big)]
    assert sizes[1] <= sizes[0] + 64, sizes
