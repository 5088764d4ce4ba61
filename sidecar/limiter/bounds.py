"""What keeps a process's state bounded under a flood of unique values.

A client controls descriptor values, so every table keyed by them needs a cap and a
cheap way to stay under it: the counter cap is enforced by the backends (which evict
the window that ends first) and reported by :class:`EvictionLog` at most once per
interval; bans live in :class:`Bans`, capped, forgetting the oldest at the cap.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Hashable

import structlog

log = structlog.get_logger(__name__)

DEFAULT_MAX_COUNTERS = 2_000_000
"""Cap on live counters (``--max-counters``): about 2M keeps a flood of unique values under
~1 GB (measured ~300-450 bytes per counter depending on value length; see README)."""
EVICTION_LOG_INTERVAL = 60.0
"""Seconds between two ``counters_evicted`` log lines."""
BUCKET_SWEEP_MIN = 1024
"""Fewest new entries between two sweeps of a table for entries that ran out."""


class EvictionLog:
    """Logs counter evictions at most once per interval: a flood of unique values must
    not flood the logs as well."""

    def __init__(self, max_counters: int, interval: float = EVICTION_LOG_INTERVAL) -> None:
        self.max_counters = max_counters
        self.interval = interval
        self._unlogged = 0
        self._last = -math.inf

    def note(self, evicted: int, total: int) -> None:
        self._unlogged += evicted
        now = time.monotonic()
        if self._unlogged and now - self._last >= self.interval:
            log.warning(
                "counters_evicted",
                evicted=self._unlogged,
                total_evictions=total,
                max_counters=self.max_counters,
                hint="raise --max-counters or look for a flood of unique descriptor values",
            )
            self._unlogged = 0
            self._last = now


class Bans:
    """Counters refusing everything until a time (``ban_duration``), bounded in number."""

    def __init__(self, max_bans: int) -> None:
        self.max_bans = max_bans
        self._until: OrderedDict[Hashable, float] = OrderedDict()
        self._new = 0
        """Bans set since the ones that ran out were last forgotten."""
        self._sweep = min(BUCKET_SWEEP_MIN, max_bans)
        """New bans after which the ones that ran out are forgotten (grows with the live ones)."""

    def __len__(self) -> int:
        return len(self._until)

    def until(self, key: Hashable) -> float:
        """When ``key``'s ban ends (0 if it has none; a time in the past if it ran out)."""
        return self._until.get(key, 0.0)

    def active(self, key: Hashable, now: float) -> bool:
        """Whether ``key`` is banned at ``now``."""
        return self._until.get(key, 0.0) > now

    def ban(self, key: Hashable, until: float, now: float) -> None:
        """Ban ``key`` until ``until``; a ban already running is not extended (a banned
        client that keeps sending is not banned for longer, as with Cloud Armor)."""
        if self.active(key, now):
            return
        bans = self._until
        if key in bans:
            bans.move_to_end(key)
        else:
            self._new += 1
            if self._new >= self._sweep:
                self.expire(now)
            if len(bans) >= self.max_bans:
                bans.popitem(last=False)
        bans[key] = until

    def expire(self, now: float) -> None:
        """Forget bans that have run out.

        It reads every ban, so :meth:`ban` runs it only after as many new bans as are
        left, and at the cap drops the oldest ban instead: an expiry for every new ban
        there made a flood of refused unique values cost milliseconds per request. Bans
        that ran out refuse nothing, so nothing else needs to run it.
        """
        bans = self._until
        for key in [key for key, until in bans.items() if until <= now]:
            del bans[key]
        self._new = 0
        self._sweep = max(min(BUCKET_SWEEP_MIN, self.max_bans), len(bans))


def blind_cap(max_overshoot: float, limit: int, replicas: int) -> int:
    """``Q``: hits a sync replica may hold that Redis has not seen.

    ``(R - 1) * Q <= max_overshoot * limit`` by construction, so the proven bound never
    exceeds the configured fraction; 0 means every admission is exact.
    """
    if replicas <= 1:
        return limit
    return math.floor(max_overshoot * limit / (replicas - 1))
