"""The arithmetic of the three counting algorithms, shared by every backend and the Lua script.

Every algorithm is reduced to the same shape, so the all-or-nothing rule
(:func:`sidecar.limiter.protocol.decide`), the response and the headers stay one code
path: a check's *count* (what its counter would hold with this request's hits) is
compared with its *limit*.

* ``fixed_window``: count = hits in the current window; limit = ``requests_per_unit``.
* ``sliding_window``: the two-window weighted estimate HAProxy's ``http_req_rate``
  uses: count = current window + the previous window weighted by the part of it the
  sliding window still covers, rounded down; limit = ``requests_per_unit``. Only the
  current window's counter is written, so it is stored exactly like a fixed window
  (and flushes, reconciliation and give-backs stay plain ``INCRBY``); its key just
  lives one window longer, because the next window reads it.
* ``token_bucket``: GCRA, one value per counter, the *theoretical arrival time*
  (TAT, in integer microseconds): every hit moves it one emission interval
  ``T = window / requests_per_unit`` later, and a request fits while
  ``TAT - now <= burst * T``. Count = tokens in use after the request,
  ``ceil((TAT' - now) / T)``; limit = ``burst``. Charging hits without a decision
  (reconciliation) and giving them back are ``INCRBY`` of ``hits * T`` as well.

``lua/decide.lua`` implements the same formulas; the floating-point operations are
written in the same order on both sides so both round alike.
"""

from __future__ import annotations

import math
from enum import IntEnum
from typing import TYPE_CHECKING

from sidecar.limiter.windows import seconds_until_reset, window_start

if TYPE_CHECKING:
    from sidecar.limiter.protocol import Check

MICROSECONDS = 1_000_000


class Algorithm(IntEnum):
    """``algorithm:`` of a rate limit; the numbers are what ``decide.lua`` receives."""

    FIXED_WINDOW = 0
    SLIDING_WINDOW = 1
    TOKEN_BUCKET = 2

    @property
    def label(self) -> str:
        """The config spelling."""
        return self.name.lower()


ALGORITHM_NAMES = ", ".join(algorithm.label for algorithm in Algorithm)


def previous_weight(now: float, unit_seconds: int) -> float:
    """Share of the previous window the sliding window ``(now - unit, now]`` still covers."""
    start = window_start(now, unit_seconds)
    return (start + unit_seconds - now) / unit_seconds


def sliding_part(previous: int, weight: float) -> int:
    """What the previous window adds to a sliding estimate (rounded down, as HAProxy does)."""
    return math.floor(previous * weight)


def emission_interval_us(unit_seconds: int, rate: int) -> int:
    """GCRA's ``T``: microseconds one token takes to come back (at least 1)."""
    return max(1, round(unit_seconds * MICROSECONDS / rate))


def now_us(now: float) -> int:
    """A Unix time in whole microseconds, as token-bucket TATs are kept."""
    return math.floor(now * MICROSECONDS)


def tokens_in_use(tat_us: int, now_microseconds: int, interval_us: int) -> int:
    """Tokens a bucket whose TAT is ``tat_us`` has handed out and not yet got back."""
    ahead = tat_us - now_microseconds
    return -(-ahead // interval_us) if ahead > 0 else 0


def bucket_after(tat_us: int, now_microseconds: int, interval_us: int, hits: int) -> tuple[int, int]:
    """``(new TAT, tokens in use)`` once ``hits`` more are taken at ``now``."""
    tat = max(tat_us, now_microseconds) + hits * interval_us
    return tat, tokens_in_use(tat, now_microseconds, interval_us)


def reset_seconds(check: Check, count: int, limit: int, over: bool, now: float) -> int:
    """``duration_until_reset`` of one check whose count is ``count`` against ``limit``.

    Windows: until the current window ends (for a sliding window that is when the
    current window's hits start to weigh less). Token bucket: until the bucket is full
    again, or, for a refused request, until enough tokens are back for it.

    ``limit`` is the limit the backend enforced (``Decision.limits``): with
    ``--instances N`` a replica's bucket holds ``ceil(burst / N)`` tokens, each
    ``N`` times slower to come back, so its tokens are counted at the whole bucket's
    refill time divided by that share (exactly ``N`` times the interval when ``N``
    divides the burst). Comparing with the configured burst instead said "0 s" to
    every refused request of a shared bucket. Not part of the Lua script: resets are
    worked out by the service, whatever the backend.
    """
    if check.algorithm is not Algorithm.TOKEN_BUCKET:
        return seconds_until_reset(now, check.unit_seconds)
    tokens = count - limit if over else count
    if tokens <= 0 or limit <= 0:
        return 0
    return -(-tokens * check.interval_us * check.limit // (limit * MICROSECONDS))
