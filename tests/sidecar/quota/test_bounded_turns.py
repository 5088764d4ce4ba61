"""Quota mode does a bounded amount of work per event-loop turn (issue 25).

One loop answers every ``ShouldRateLimit`` of the pod, so a report, the TTL refresh, a
reload and a stream's close each handle at most ``CHUNK`` buckets between two yields.
Measured by counting loop turns (a task that bumps a counter each time it runs), never
by wall time.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from sidecar.quota.assignments import Action, Assignment, Kind
from sidecar.quota.buckets import BucketKey, bucket_of
from sidecar.quota.registry import CHUNK, SPREAD_SLOTS, QuotaRegistry, QuotaSettings
from sidecar.quota.stream import LiveBucket, Stream

RULES = """
domain: q
descriptors:
  - key: user
    rate_limit: {unit: second, requests_per_unit: 5}
"""
RELOADED = RULES.replace("requests_per_unit: 5", "requests_per_unit: 7")
NEWEST = RULES.replace("requests_per_unit: 5", "requests_per_unit: 9")


def user(name: str) -> dict[str, str]:
    return bucket_of("q", [("user", name)])


class Turns:
    """Counts event-loop turns: a task that adds one each time the loop runs it."""

    def __init__(self) -> None:
        self.count = 0
        self.task = asyncio.get_running_loop().create_task(self._spin())

    async def _spin(self) -> None:
        while True:
            self.count += 1
            await asyncio.sleep(0)

    def stop(self) -> None:
        self.task.cancel()


@pytest.fixture
async def turns() -> AsyncIterator[Turns]:
    counter = Turns()
    await asyncio.sleep(0)
    yield counter
    counter.stop()


def per_turn(marks: list[int]) -> int:
    """The most items handled in one loop turn."""
    return max(Counter(marks).values())


def counted_usages(
    turns: Turns, marks: list[int], count: int, allowed: int = 1
) -> Iterator[tuple[dict[str, str], int, int]]:
    for index in range(count):
        marks.append(turns.count)  # read lazily: when the registry takes the next usage
        yield user(f"u{index}"), allowed, 0


def counting_pushes(stream: Stream, turns: Turns, marks: list[int]) -> None:
    push = stream.push

    def counted(action: Action, key: BucketKey | None = None) -> None:
        marks.append(turns.count)
        push(action, key)

    stream.push = counted  # type: ignore[method-assign]


async def drain(stream: Stream) -> None:
    """A writer that reads everything queued, one message's worth per turn."""
    while True:
        stream.pending.take(256)
        await asyncio.sleep(0)


def registry_of(h: SimpleNamespace, **settings: Any) -> tuple[QuotaRegistry, SimpleNamespace]:
    clock = h.FakeClock(1000.0)
    return QuotaRegistry(h.config_of(RULES), QuotaSettings(**settings), clock=clock), clock


async def test_a_report_of_many_ids_is_handled_a_chunk_per_turn(h: SimpleNamespace, turns: Turns) -> None:
    registry, _ = registry_of(h, max_buckets_per_stream=2_000, max_buckets=2_000)
    stream = registry.open("envoy")
    writer = asyncio.get_running_loop().create_task(drain(stream))
    marks: list[int] = []
    await registry.report_in_chunks(stream, "q", counted_usages(turns, marks, 6_000))
    writer.cancel()
    assert len(marks) == 6_000
    assert per_turn(marks) <= CHUNK
    assert registry.live == 2_000 and registry.stats.overflow == {"stream": 4_000}


async def test_the_refresh_of_many_buckets_is_a_chunk_per_turn_and_spread(h: SimpleNamespace, turns: Turns) -> None:
    registry, clock = registry_of(h, ttl=60, max_buckets_per_stream=3_000, max_buckets=3_000)
    stream = registry.open("envoy")
    registry.report(stream, "q", iter([(user(f"u{index}"), 1, 0) for index in range(3_000)]))
    stream.pending.clear()
    marks: list[int] = []
    counting_pushes(stream, turns, marks)
    refreshed_at: list[float] = []
    for _ in range(20):  # the 20 s after adoption, a maintenance pass a second
        clock.advance(1)
        before = len(marks)
        await registry.maintain_in_chunks(stream)
        await asyncio.sleep(0)  # the writer waits for its tick between two passes
        refreshed_at += [clock.now] * (len(marks) - before)
    assert len(marks) == 3_000  # each refreshed once in its first third of the TTL
    assert per_turn(marks) <= CHUNK
    assert len(set(refreshed_at)) >= 4  # not all in the same pass
    assert max(Counter(refreshed_at).values()) <= 3_000 * 5 // SPREAD_SLOTS  # a few slots per second


async def test_a_reload_is_rematched_a_chunk_per_turn_and_the_newest_config_wins(
    h: SimpleNamespace, turns: Turns
) -> None:
    registry, _ = registry_of(h, max_buckets_per_stream=3_001, max_buckets=3_001)
    stream = registry.open("envoy")
    registry.report(stream, "q", iter([(user(f"u{index}"), 1, 0) for index in range(3_000)]))
    stream.pending.clear()
    marks: list[int] = []
    counting_pushes(stream, turns, marks)
    registry.reassign(h.config_of(RELOADED))
    await asyncio.sleep(0)
    await asyncio.sleep(0)  # the first reload is under way ...
    assert 0 < len(marks) < 3_000
    registry.reassign(h.config_of(NEWEST))  # ... when a newer one comes
    registry.report(stream, "q", iter([(user("late"), 1, 0)]))  # adopted meanwhile
    await registry.settled()
    assert per_turn(marks) <= CHUNK + 1
    tokens = {key: live.assignment.max_tokens for key, live in stream.buckets.items()}
    assert set(tokens.values()) == {9}
    assert len(tokens) == 3_001
    queued = {action.assignment.max_tokens for action in stream.pending if action.assignment is not None}
    assert queued == {9}  # the latest action per bucket replaced the first reload's


class FakeLeases:
    """Counts the per-bucket calls the registry makes (each O(1) in the real one)."""

    def __init__(self, turns: Turns) -> None:
        self.turns = turns
        self.released: list[int] = []

    def adopt(self, stream: Stream, key: BucketKey, live: LiveBucket, assignment: Assignment) -> Assignment:
        return assignment

    def usage(self, key: BucketKey, allowed: int, denied: int) -> None:
        pass

    def release(self, stream: Stream, key: BucketKey, give_back: bool) -> None:
        self.released.append(self.turns.count)

    def rebase(self, key: BucketKey, new: Assignment) -> Assignment | None:
        return None

    def by_rule(self) -> dict[tuple[str, str], tuple[int, int]]:
        return {}


async def test_closing_a_stream_of_many_buckets_releases_a_chunk_per_turn(h: SimpleNamespace, turns: Turns) -> None:
    registry, _ = registry_of(h, max_buckets_per_stream=3_000, max_buckets=3_000)
    leases = FakeLeases(turns)
    registry.leases = leases  # type: ignore[assignment]
    stream = registry.open("envoy")
    registry.report(stream, "q", iter([(user(f"u{index}"), 1, 0) for index in range(3_000)]))
    registry.close(stream)
    assert registry.live == 0 and registry.streams == {}  # gone at once for the caps
    await registry.settled()
    assert len(leases.released) == 3_000
    assert per_turn(leases.released) <= CHUNK


async def test_a_reader_waits_while_its_queue_is_over_the_bound(h: SimpleNamespace) -> None:
    """Stateless answers (bad ids) to a stream whose writer does not send: the report stops
    being read at the bound, and goes on once the writer drains."""
    registry, _ = registry_of(h, max_queued_bytes=20_000)
    stream = registry.open("envoy")
    bad = ((({"entry.0.user": f"{index:0100}"}), 1, 0) for index in range(5_000))
    reading = asyncio.get_running_loop().create_task(registry.report_in_chunks(stream, "q", bad))
    for _ in range(2_000):  # the reader rests between chunks (sidecar.turns): wait for the bound
        if stream.pending.full or reading.done():
            break
        await asyncio.sleep(0.001)
    await asyncio.sleep(0.05)  # time for more chunks, were the reader not waiting
    assert not reading.done()
    most = CHUNK * (40 + 6 + 12 + 100)  # one chunk of actions past the bound, at most
    assert 20_000 < stream.pending.bytes <= 20_000 + most
    assert len(stream.pending) <= (20_000 + most) // 150
    writer = asyncio.get_running_loop().create_task(drain(stream))
    await reading
    writer.cancel()
    assert registry.stats.defaults == {"bad_id:missing_domain": [5_000, 0]}


async def test_one_bucket_is_queued_once_however_often_it_is_answered(h: SimpleNamespace) -> None:
    registry, clock = registry_of(h, max_buckets_per_stream=1, max_buckets=1)
    stream = registry.open("envoy")
    bad = {"entry.0.user": "no domain"}
    for _ in range(100):  # a client that never reads, reporting the same ids again and again
        registry.report(stream, "q", iter([(bad, 1, 0), (user("kept"), 1, 0), (user("over"), 1, 0)]))
        clock.advance(30)
        registry.maintain(stream)
    assert len(stream.pending) == 3
    kinds = [action.assignment.kind for action in stream.pending if action.assignment is not None]
    assert kinds == [Kind.ALLOW_ALL, Kind.TOKEN_BUCKET, Kind.ALLOW_ALL]
