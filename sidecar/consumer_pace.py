"""When a consumer's next ask may go: windows, refusals, and the pace of one request's asks.

The sidecar's answers say how much of a window's budget is left and when the window ends
(``limit_remaining``, ``duration_until_reset`` in whole seconds rounded up, and the limit's
unit). From them a :class:`~sidecar.consumer.Consumer` decides, without asking again, when
each caller's ask should go, or that it cannot be served before its deadline:

* **The pace.** Asks for one request go no sooner than ``hits * T / (remaining + hits)``
  apart (:func:`pace_interval`), the even rate at which what is left lasts until the window
  ends; a spent window holds them until it ends.
* **Claims.** Callers queued for their turn and asks on their way are *claims* on what
  the last answer said is left. A caller that finds every hit left claimed by callers
  ahead of it, and the next window starting after its deadline, is told at once that no
  slot comes in time (:class:`Fail`), without asking: a herd of callers then costs the
  sidecar about as many asks as there are hits to hand out, not one each.
* **Freshness.** An answer's numbers hold until the earliest of its windows ends (a spent
  window's until it ends). Before the first answer, or once they are stale, one ask (the
  *probe*) learns the pace again and the others wait for its answer (:class:`AwaitAnswer`)
  instead of treating every turn as "now".

:func:`plan_turn` is the whole rule, a pure function of the state and the time, so it is
tested on a fake clock. :class:`PaceTable` holds one :class:`Pace` per request, at most
:data:`MAX_PACES`, evicting the least recently used in O(1).
"""

from __future__ import annotations

import asyncio
import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from sidecar.limiter.windows import UNIT_SECONDS, Unit
from sidecar.protos.envoy.service.ratelimit.v3 import rls_pb2

OVER_LIMIT = rls_pb2.RateLimitResponse.OVER_LIMIT
MAX_PACES = 1024
"""Requests whose pace a client keeps; the least recently asked for is dropped beyond it."""
RECHECK = 0.05
"""Seconds a caller waiting its turn sleeps at most before looking again (answers move the turn)."""


@dataclass(frozen=True, slots=True)
class Refused:
    """What a refusal says about when to ask again: seconds until the reported reset, and the window."""

    reset: float
    window: float


def refusal(response: Any) -> Refused:
    """The latest reset among the limits that refused (all must have room again), and their window."""
    statuses = [status for status in response.statuses if status.code == OVER_LIMIT] or list(response.statuses)
    reset = max((status.duration_until_reset.seconds for status in statuses), default=1)
    windows = [UNIT_SECONDS[Unit(status.current_limit.unit)] for status in statuses if status.current_limit.unit]
    return Refused(float(reset), float(max(windows, default=max(reset, 1))))


def window_end(now: float, refused: Refused) -> float:
    """When the refusing window ends, on this host's Unix clock.

    The sidecar rounds the reset up to whole seconds, so the end lies in
    ``(now + reset - 1, now + reset]``; windows are aligned to the epoch in whole units,
    so when a multiple of the unit lies in that second it is the end (exact when clocks
    agree), else (a window of several units) ``now + reset``.
    """
    latest = now + refused.reset
    unit = refused.window
    snapped = math.floor(latest / unit) * unit
    return snapped if snapped > latest - 1 else latest


def _limited(response: Any) -> list[Any]:
    """The statuses that carry a limit."""
    return [status for status in response.statuses if status.HasField("current_limit") and status.current_limit.unit]


def _seconds_left(status: Any, wall: float) -> float:
    window = float(UNIT_SECONDS[Unit(status.current_limit.unit)])
    reset = float(max(1, status.duration_until_reset.seconds))
    return max(0.0, window_end(wall, Refused(reset, window)) - wall)


def _spent(status: Any) -> bool:
    return bool(status.code == OVER_LIMIT or status.limit_remaining == 0)


def pace_interval(response: Any, hits: int, wall: float) -> tuple[float, bool]:
    """Seconds until the next ask should go, from an answer, and whether that is because the budget is spent.

    ``hits * T / (remaining + hits)`` for the tightest limit (``T``: the time left in its window):
    what is left of the budget, spent at an even rate until the window ends. A limit that refused
    or has nothing left holds the next ask until its window ends.
    """
    interval, spent = 0.0, False
    for status in _limited(response):
        left = _seconds_left(status, wall)
        if _spent(status):
            interval, spent = max(interval, left), True
        else:
            interval = max(interval, left * hits / (status.limit_remaining + hits))
    return interval, spent


@dataclass(frozen=True, slots=True)
class Reading:
    """What one answer says, in seconds from when it arrived."""

    interval: float
    """Spacing of the next asks (:func:`pace_interval`)."""
    remaining: float
    """Hits left in the scarcest limit's window (0 when spent or refused; ``inf``: no limit)."""
    renews_in: float
    """Until the scarcest limit's window ends: its budget comes back then (the latest, when spent)."""
    fresh_for: float
    """How long these numbers hold: until the earliest window ends (a spent one's end, when spent)."""


def read_answer(response: Any, hits: int, wall: float) -> Reading:
    """The :class:`Reading` of an answer received at ``wall`` (this host's Unix clock)."""
    interval, spent = pace_interval(response, hits, wall)
    limited = _limited(response)
    if not limited:
        return Reading(interval, math.inf, 0.0, math.inf)
    if spent:
        renews_in = max(_seconds_left(status, wall) for status in limited if _spent(status))
        return Reading(interval, 0.0, renews_in, renews_in)
    scarcest = min(limited, key=lambda status: (status.limit_remaining, -_seconds_left(status, wall)))
    renews_in = _seconds_left(scarcest, wall)
    fresh_for = min(_seconds_left(status, wall) for status in limited)
    return Reading(interval, float(scarcest.limit_remaining), renews_in, fresh_for)


@dataclass
class Pace:
    """The pace of one request's asks through one client (times on the client's monotonic clock)."""

    not_before: float = -math.inf
    """When the next queued ask may go."""
    interval: float = 0.0
    remaining: float = math.inf
    """Hits left per the latest answer (see :class:`Reading`); meaningful while :meth:`fresh`."""
    renews_at: float = -math.inf
    fresh_until: float = -math.inf
    """Until when the latest answer's numbers hold; -inf before the first answer."""
    waiting: int = 0
    """Callers queued for their turn."""
    in_flight: int = 0
    """Asks sent and not yet answered."""
    probing: bool = False
    """An ask is on its way while no answer is fresh: the others wait for it."""
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    answered: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when an ask ends (answered or not), then replaced: what :class:`AwaitAnswer` waits for."""

    def fresh(self, now: float) -> bool:
        return now < self.fresh_until

    def claims(self) -> int:
        """Callers ahead of a newcomer: queued ones and asks on their way."""
        return self.waiting + self.in_flight

    def learn(self, reading: Reading, now: float) -> None:
        """Take an answer's numbers (the next ask may go one interval from now)."""
        self.interval = reading.interval
        self.remaining = reading.remaining
        self.renews_at = now + reading.renews_in
        self.fresh_until = now + reading.fresh_for
        self.not_before = now + reading.interval

    def spent_past(self, latest: float, now: float) -> bool:
        """The fresh answer says no hit is left until after ``latest``."""
        return self.fresh(now) and self.remaining <= 0 and self.renews_at > latest

    def ask_ended(self) -> None:
        """Wake every caller waiting for an answer (they plan again)."""
        ended, self.answered = self.answered, asyncio.Event()
        ended.set()


@dataclass(frozen=True, slots=True)
class Ask:
    """Ask now. ``out_of_turn``: before the pace's turn, because the deadline comes first."""

    out_of_turn: bool = False
    probe: bool = False
    """This ask learns the pace: no fresh answer and none on its way."""


@dataclass(frozen=True, slots=True)
class Queue:
    """Wait for the turn in the queue (it comes before the deadline)."""


@dataclass(frozen=True, slots=True)
class AwaitAnswer:
    """The answer that sets the pace is on its way: wait for it (at most until the deadline), then plan again."""


@dataclass(frozen=True, slots=True)
class Hold:
    """Everything left is claimed, and the next window starts before the deadline: sleep until then, plan again."""

    until: float


@dataclass(frozen=True, slots=True)
class Fail:
    """No slot before the deadline: budget comes back in ``retry_after`` seconds."""

    retry_after: float


Turn = Ask | Queue | AwaitAnswer | Hold | Fail


def plan_turn(pace: Pace, now: float, latest: float, hits: int) -> Turn:
    """What a caller does next: ``latest`` is the last moment its ask may go and be answered in time.

    In order: with no fresh answer, the first caller asks (the probe) and the others wait
    for its answer; a caller with no time left to wait asks at once. With a fresh answer: if
    every hit left is claimed by callers ahead (or the window is spent), the caller fails now
    when the budget comes back after ``latest``, else holds until it does; otherwise its turn
    is one interval per caller queued ahead after the next slot, and a turn after ``latest``
    asks at once, out of turn (there is budget for it; the claims bound how many do).
    """
    if not pace.fresh(now):
        if pace.probing and latest > now:
            return AwaitAnswer()
        return Ask(out_of_turn=pace.probing, probe=not pace.probing)
    if pace.remaining < (pace.claims() + 1) * hits:
        if pace.renews_at > latest:
            return Fail(pace.renews_at - now)
        return Hold(pace.renews_at)
    turn = max(now, pace.not_before) + pace.interval * pace.waiting
    if turn >= latest:
        return Ask(out_of_turn=True)
    return Queue()


class PaceTable:
    """One :class:`Pace` per request payload, at most ``cap``: the least recently used goes first.

    Every lookup is O(1) (an ordered dict, moved to the end when used). An evicted pace's
    callers keep their reference and finish with it; the request's next caller starts a
    fresh pace, learned again from one probe (a spent window costs one refused ask).
    """

    def __init__(self, cap: int = MAX_PACES) -> None:
        if cap < 1:
            raise ValueError("cap: at least 1")
        self.cap = cap
        self._paces: OrderedDict[bytes, Pace] = OrderedDict()

    def __len__(self) -> int:
        return len(self._paces)

    def __contains__(self, key: bytes) -> bool:
        return key in self._paces

    def get(self, key: bytes) -> Pace:
        """The pace of ``key``, made the most recently used (created, evicting the least, if new)."""
        pace = self._paces.get(key)
        if pace is not None:
            self._paces.move_to_end(key)
            return pace
        if len(self._paces) >= self.cap:
            self._paces.popitem(last=False)
        pace = self._paces[key] = Pace()
        return pace
