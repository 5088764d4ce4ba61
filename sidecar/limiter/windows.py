"""Wall-clock window arithmetic shared by every backend.

Windows are aligned to the Unix epoch (``start = now - now % unit``) so that every
replica agrees on window boundaries without talking to the others; only NTP-synced
clocks are assumed. Week, month and year are fixed lengths (7, 30 and 365 days), as
in envoyproxy/ratelimit, by default. Calendar months are opt-in (``--calendar-months``,
the reference's ``USE_CALENDAR_MONTH_RATE_LIMIT``): a month rule's window is then the UTC
calendar month, so every replica still cuts the same windows without talking. Such a
window is told apart by its length, :data:`CALENDAR_MONTH` (a length no epoch-aligned
rule can have: see the config parser), which :func:`window_start` and
:func:`seconds_until_reset` understand; ``start + unit_seconds`` then lies past the
month's end and only serves as an expiry, never as a boundary.
"""

from __future__ import annotations

import calendar
import math
import time
from collections.abc import Callable
from enum import IntEnum

Clock = Callable[[], float]
"""Returns the current Unix time in seconds; injectable so tests can control time."""

system_clock: Clock = time.time


class Unit(IntEnum):
    """Time units, numbered exactly as ``RateLimitResponse.RateLimit.Unit`` in the proto."""

    SECOND = 1
    MINUTE = 2
    HOUR = 3
    DAY = 4
    MONTH = 5
    YEAR = 6
    WEEK = 7

    @property
    def seconds(self) -> int:
        """Length of one window of this unit."""
        return UNIT_SECONDS[self]

    @classmethod
    def parse(cls, text: str) -> Unit:
        """Case-insensitive lookup by name; raises ``KeyError`` with the valid names."""
        try:
            return cls[text.strip().upper()]
        except KeyError:
            raise KeyError(text) from None


UNIT_SECONDS: dict[Unit, int] = {
    Unit.SECOND: 1,
    Unit.MINUTE: 60,
    Unit.HOUR: 3_600,
    Unit.DAY: 86_400,
    Unit.WEEK: 7 * 86_400,
    Unit.MONTH: 30 * 86_400,
    Unit.YEAR: 365 * 86_400,
}

UNIT_NAMES = ", ".join(unit.name.lower() for unit in sorted(Unit, key=lambda u: u.seconds))


CALENDAR_MONTH = 31 * 86_400 + 1
"""The window length standing for "the UTC calendar month": longer than any month (so
expiries computed as ``start + length`` outlive the month), and never the length of a
configured epoch-aligned window (the parser refuses it)."""


def month_start(now: float) -> int:
    """Unix second at which the UTC calendar month containing ``now`` began."""
    moment = time.gmtime(math.floor(now))
    return calendar.timegm((moment.tm_year, moment.tm_mon, 1, 0, 0, 0))


def month_end(start: int) -> int:
    """Unix second at which the UTC calendar month starting at ``start`` ends."""
    moment = time.gmtime(start)
    year, month = (moment.tm_year + 1, 1) if moment.tm_mon == 12 else (moment.tm_year, moment.tm_mon + 1)
    return calendar.timegm((year, month, 1, 0, 0, 0))


def window_start(now: float, unit_seconds: int) -> int:
    """Start of the window containing ``now``, in whole Unix seconds."""
    if unit_seconds == CALENDAR_MONTH:
        return month_start(now)
    whole = int(now) if now >= 0 else math.floor(now)
    return whole - whole % unit_seconds


def window_end(now: float, unit_seconds: int) -> int:
    """End of the window containing ``now`` (the next one's start)."""
    start = window_start(now, unit_seconds)
    return month_end(start) if unit_seconds == CALENDAR_MONTH else start + unit_seconds


def seconds_until_reset(now: float, unit_seconds: int) -> int:
    """Whole seconds until the current window ends, rounded up (1..unit).

    Rounded up rather than truncated because Envoy turns this into the
    ``x-ratelimit-reset`` header with whole seconds: truncation would tell a
    client "0" while the window still has up to a second to run.
    """
    if unit_seconds == CALENDAR_MONTH:
        remaining = month_end(month_start(now)) - now
    else:
        remaining = window_start(now, unit_seconds) + unit_seconds - now
    return max(1, math.ceil(remaining))
