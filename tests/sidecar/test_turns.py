"""sidecar.turns: bulk work rests between chunks as long as the chunk ran (bounded)."""

from __future__ import annotations

import asyncio

import pytest

from sidecar import turns
from sidecar.turns import MAX_REST, MIN_REST, GiveWay


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def slept(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """What each rest asked ``asyncio.sleep`` for (none of them waits)."""
    asked: list[float] = []
    real_sleep = asyncio.sleep

    async def sleep(seconds: float) -> None:
        asked.append(seconds)
        await real_sleep(0)

    monkeypatch.setattr(turns.asyncio, "sleep", sleep)
    return asked


async def test_a_chunk_is_followed_by_a_rest_as_long_as_it_ran(slept: list[float]) -> None:
    clock = Clock()
    give_way = GiveWay(clock)
    for ran in (0.003, 0.006, 0.0001, 0.5):
        clock.now += ran
        await give_way()
    assert slept == [pytest.approx(0.003), pytest.approx(0.006), MIN_REST, MAX_REST]
    assert give_way.rested == pytest.approx(sum(slept))


async def test_the_next_chunk_is_timed_from_the_end_of_the_rest(slept: list[float]) -> None:
    clock = Clock()
    give_way = GiveWay(clock)
    clock.now += 0.004
    await give_way()
    clock.now += 0.002  # the next chunk alone, not the rest before it
    await give_way()
    assert slept == [pytest.approx(0.004), pytest.approx(0.002)]
