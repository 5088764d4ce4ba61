"""sidecar.turns: bulk work rests between chunks as long as the chunk ran (bounded)."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Coroutine
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

from sidecar import server, turns
from sidecar.turns import MAX_REST, MIN_REST, GiveWay
from tests.support.settings import settings_from


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


def test_serve_hands_the_gil_over_at_the_short_switch_interval(tmp_path: Path) -> None:
    """The whole serve process runs at :data:`~sidecar.turns.SWITCH_INTERVAL`, not CPython's 5 ms."""
    (tmp_path / "api.yaml").write_text(
        "domain: api\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 1}\n"
    )
    seen: list[float] = []

    def run(main: Coroutine[Any, Any, None]) -> None:
        main.close()
        seen.append(sys.getswitchinterval())

    before = sys.getswitchinterval()
    try:
        with mock.patch.object(server.uvloop, "run", run):
            server.serve(settings_from(["--config", str(tmp_path), "--grpc-address", "127.0.0.1:0"]))
    finally:
        sys.setswitchinterval(before)
    assert seen == [turns.SWITCH_INTERVAL]
    assert turns.SWITCH_INTERVAL < 0.005  # shorter than CPython's default, or it changes nothing
