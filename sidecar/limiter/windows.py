"""Wall-clock window arithmetic shared by every backend.

Windows are aligned to the Unix epoch (``start = now - now % unit``) so that every
replica agrees on window boundaries without talking to the others; only NTP-synced
clocks are assumed. Week, month and year are fixed lengths (7, 30 and 365 days), as
in envoyproxy/ratelimit, because calendar months would make boundaries depend on
time zones and leap rules that replicas could disagree on.
"""

from __future__ import annotations

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


def window_start(now: float, unit_seconds: int) -> int:
    """Start of the window containing ``now``, in whole Unix seconds."""
    whole = int(now) if now >= 0 else math.floor(now)
    return whole - whole % unit_seconds


def seconds_until_reset(now: float, unit_seconds: int) -> int:
    """Whole seconds until the current window ends, rounded up (1..unit).

    Rounded up rather than truncated because Envoy turns this into the
    ``x-ratelimit-reset`` header with whole seconds: truncation would tell a
    client "0" while the window still has up to a second to run.
    """
    remaining = window_start(now, unit_seconds) + unit_seconds - now
    return max(1, math.ceil(remaining))
