"""The shared clock: a deliberate offset, and a correction measured against a reference."""

from __future__ import annotations

import pytest

from sidecar.limiter.redis.clock import MAX_SAMPLE_ROUND_TRIP, SharedClock


def test_offset_and_correction_add_up() -> None:
    clock = SharedClock(offset=2.0, base=lambda: 100.0)
    assert (clock(), clock.local()) == (102.0, 102.0)
    clock.observe(reference=99.0, sent=101.99, received=102.01)  # the reference reads 3 s behind
    assert clock.correction == pytest.approx(-3.0)
    assert clock() == pytest.approx(99.0)
    assert clock.local() == 102.0


def test_the_correction_is_the_median_of_recent_samples() -> None:
    clock = SharedClock(base=lambda: 0.0)
    for offset in (0.010, 0.011, 0.500, 0.009, 0.010):  # one outlier
        clock.observe(reference=offset, sent=-0.001, received=0.001)
    assert clock.correction == pytest.approx(0.010)


def test_samples_from_slow_round_trips_are_ignored() -> None:
    clock = SharedClock(base=lambda: 0.0)
    clock.observe(reference=5.0, sent=0.0, received=MAX_SAMPLE_ROUND_TRIP * 2)
    assert clock.correction == 0.0
