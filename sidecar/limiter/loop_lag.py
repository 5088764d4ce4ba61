"""How late this process's event loop runs: a periodic timer, and how late it fires.

A Redis answer that arrives in time but sits in the socket while the loop runs other
work (a burst of requests, a CPU-throttled container) is read late; that lateness is
ours, not Redis's. :class:`LoopLag` measures it so :mod:`~sidecar.limiter.redis.availability` charges to
Redis only the silence during which this loop was free to read an answer.

Each tick records ``lateness = fired - due``: the loop could not run a callback for
about that long before ``fired``. :meth:`LoopLag.busy_since` sums the lateness of the
ticks in a period (clipped to it): the time within it that this process, not Redis,
was the reason nothing was read. The clock is the loop's (``loop.time()``) unless a
test gives another; :meth:`LoopLag.record` takes readings directly, so the arithmetic
is tested on a controllable clock.

Cost: one timer callback every :data:`INTERVAL` (100 a second), a deque append and a
bisect; nothing on the request path.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable

from sidecar.metrics import LOOP_LAG_BUCKETS, Buckets

INTERVAL = 0.01
"""Seconds between two ticks."""
HORIZON = 5.0
"""Seconds of ticks kept for :meth:`LoopLag.busy_since`: longer than any silence judged."""


class LoopLag:
    """Lateness of a periodic timer on the event loop: latest, max per scrape, histogram."""

    def __init__(self, interval: float = INTERVAL, horizon: float = HORIZON) -> None:
        self.interval = interval
        self.horizon = horizon
        self.latest = 0.0
        """Lateness of the last tick, seconds."""
        self.max_since_read = 0.0
        """Largest lateness since :meth:`take_max` was last called (each scrape)."""
        self.buckets = Buckets(LOOP_LAG_BUCKETS)
        """Every tick's lateness (``ratelimit_sidecar_event_loop_lag_seconds``)."""
        self._ticks: deque[tuple[float, float]] = deque()
        """``(fired, lateness)`` of the ticks of the last :attr:`horizon` seconds, oldest first."""
        self._due: float | None = None
        self._clock: Callable[[], float] | None = None
        self._handle: asyncio.TimerHandle | None = None

    # -- the timer ----------------------------------------------------------------------

    def start(self) -> None:
        """Tick on the running loop from now on (idempotent)."""
        if self._handle is not None:
            return
        loop = asyncio.get_running_loop()
        self._clock = loop.time
        self._due = loop.time() + self.interval
        self._handle = loop.call_at(self._due, self._tick)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _tick(self) -> None:
        assert self._clock is not None and self._due is not None
        self.record(self._due, self._clock())
        assert self._due is not None
        self._handle = asyncio.get_running_loop().call_at(self._due, self._tick)

    # -- the arithmetic ---------------------------------------------------------------------

    def record(self, due: float, fired: float) -> None:
        """A tick due at ``due`` ran at ``fired`` (loop-clock seconds); the next is due one
        :attr:`interval` later."""
        self._due = fired + self.interval
        lateness = max(0.0, fired - due)
        self.latest = lateness
        self.max_since_read = max(self.max_since_read, lateness)
        self.buckets.observe(lateness)
        ticks = self._ticks
        ticks.append((fired, lateness))
        while ticks and ticks[0][0] < fired - self.horizon:
            ticks.popleft()

    def busy_since(self, since: float, now: float) -> float:
        """Seconds of ``[since, now]`` during which the loop could not run a callback.

        The lateness of every tick that fired in the period, clipped to the period's
        start, plus how overdue the next tick is at ``now`` (the loop may be late
        right now: this very callback runs late).
        """
        busy = 0.0
        for fired, lateness in reversed(self._ticks):
            if fired <= since:
                break
            busy += min(lateness, fired - since)
        if self._due is not None and now > self._due:
            busy += now - max(self._due, since)
        return min(busy, max(0.0, now - since))

    def take_max(self) -> float:
        """The largest lateness since the last call, and start over (one scrape each)."""
        largest, self.max_since_read = self.max_since_read, 0.0
        return largest
