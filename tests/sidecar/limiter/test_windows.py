"""Wall-clock windows: epoch-aligned starts and whole seconds until reset."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.limiter.windows import (
    UNIT_NAMES,
    UNIT_SECONDS,
    Unit,
    seconds_until_reset,
    window_start,
)

DAY = 86_400
EXPECTED_SECONDS = {
    Unit.SECOND: 1,
    Unit.MINUTE: 60,
    Unit.HOUR: 3_600,
    Unit.DAY: DAY,
    Unit.WEEK: 7 * DAY,
    Unit.MONTH: 30 * DAY,
    Unit.YEAR: 365 * DAY,
}
NOW = 1_700_000_000  # 2023-11-14T22:13:20Z


def test_unit_lengths():
    assert {unit: unit.seconds for unit in Unit} == EXPECTED_SECONDS
    assert set(UNIT_SECONDS) == set(Unit)


def test_unit_numbers_follow_the_proto():
    from sidecar.protos.envoy.service.ratelimit.v3 import rls_pb2

    proto_unit = rls_pb2.RateLimitResponse.RateLimit.Unit
    for unit in Unit:
        assert proto_unit.Value(unit.name) == int(unit)


@pytest.mark.parametrize(
    ("unit", "start", "reset"),
    [
        (Unit.SECOND, NOW, 1),
        (Unit.MINUTE, NOW - 20, 40),
        (Unit.HOUR, NOW - 800, 2_800),
        (Unit.DAY, NOW - 80_000, 6_400),
        (Unit.WEEK, NOW - (NOW % (7 * DAY)), 7 * DAY - NOW % (7 * DAY)),
        (Unit.MONTH, NOW - (NOW % (30 * DAY)), 30 * DAY - NOW % (30 * DAY)),
        (Unit.YEAR, NOW - (NOW % (365 * DAY)), 365 * DAY - NOW % (365 * DAY)),
    ],
)
def test_window_of_every_unit(unit, start, reset):
    assert window_start(NOW, unit.seconds) == start
    assert seconds_until_reset(NOW, unit.seconds) == reset
    assert start % unit.seconds == 0


def test_epoch_aligned_examples():
    # Weeks count from the epoch (a Thursday), not from a calendar Monday.
    assert window_start(7 * DAY + 5, 7 * DAY) == 7 * DAY
    assert window_start(30 * DAY - 1, 30 * DAY) == 0
    assert window_start(365 * DAY, 365 * DAY) == 365 * DAY


@pytest.mark.parametrize("unit", list(Unit))
def test_exactly_at_a_window_start(unit):
    start = 1_000 * unit.seconds
    assert window_start(start, unit.seconds) == start
    assert window_start(float(start), unit.seconds) == start
    assert seconds_until_reset(start, unit.seconds) == unit.seconds
    # The last instant of the previous window still belongs to it.
    assert window_start(start - 0.001, unit.seconds) == start - unit.seconds
    assert seconds_until_reset(start - 0.001, unit.seconds) == 1


@pytest.mark.parametrize(
    ("now", "unit_seconds", "start", "reset"),
    [
        (100.25, 1, 100, 1),
        (100.999, 1, 100, 1),
        (119.5, 60, 60, 1),
        (120.5, 60, 120, 60),
        (150.0001, 60, 120, 30),
        (179.9999, 60, 120, 1),
        (3_599.5, 3_600, 0, 1),
    ],
)
def test_fractional_times(now, unit_seconds, start, reset):
    assert window_start(now, unit_seconds) == start
    assert isinstance(window_start(now, unit_seconds), int)
    assert seconds_until_reset(now, unit_seconds) == reset
    assert isinstance(seconds_until_reset(now, unit_seconds), int)


@settings(max_examples=500, deadline=None)
@given(
    now=st.floats(min_value=0, max_value=4e9, allow_nan=False, allow_infinity=False)
    | st.integers(min_value=0, max_value=4_000_000_000),
    unit=st.sampled_from(list(Unit)),
)
def test_window_properties(now, unit):
    seconds = unit.seconds
    start = window_start(now, seconds)
    assert start <= now < start + seconds
    assert start % seconds == 0
    reset = seconds_until_reset(now, seconds)
    assert 1 <= reset <= seconds
    # The reset lands on the next window start, give or take the rounding up.
    assert start + seconds <= now + reset < start + seconds + 1


@pytest.mark.parametrize(
    ("text", "unit"),
    [
        ("second", Unit.SECOND),
        ("SECOND", Unit.SECOND),
        ("Minute", Unit.MINUTE),
        ("hour", Unit.HOUR),
        ("DaY", Unit.DAY),
        ("week", Unit.WEEK),
        ("month", Unit.MONTH),
        ("YEAR", Unit.YEAR),
        (" minute ", Unit.MINUTE),
    ],
)
def test_unit_parse_is_case_insensitive(text, unit):
    assert Unit.parse(text) is unit


@pytest.mark.parametrize("text", ["", "seconds", "sec", "fortnight", "1", "UNKNOWN"])
def test_unit_parse_error(text):
    with pytest.raises(KeyError) as caught:
        Unit.parse(text)
    assert caught.value.args == (text,)


def test_unit_names_in_length_order():
    assert UNIT_NAMES == "second, minute, hour, day, week, month, year"
