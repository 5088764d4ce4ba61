"""The counters a ``sync`` replica holds: one :class:`WindowCounter` per counter and window.

Kept apart from :mod:`sidecar.limiter.sync` (the decisions and the flush loop), which
owns one :class:`CounterTable` and asks it for the counter of each check. The table
is where the state a client can make large lives, so it is where the bound is held:
at most ``max_counters`` counters, ended windows forgotten once Redis holds their
hits, and, at the cap, counters Redis already holds evicted (window ending first),
never one with hits Redis lacks, so no admitted hit that still counts is lost.
"""

from __future__ import annotations

from sidecar.limiter.algorithms import Algorithm
from sidecar.limiter.bounds import DEFAULT_MAX_COUNTERS, EvictionLog
from sidecar.limiter.protocol import Check, CounterKey
from sidecar.limiter.redis.keys import ban_key, counter_digest, expire_at, window_key
from sidecar.limiter.sync_counters import WindowCounter
from sidecar.limiter.windows import window_start

Slot = tuple[CounterKey, int]
"""A counter within a window: ``(counter key, unit seconds)``."""


class CounterTable:
    """The live counters of a ``sync`` replica, capped at ``max_counters``."""

    def __init__(self, prefix: str = "rls", max_counters: int = DEFAULT_MAX_COUNTERS) -> None:
        self.prefix = prefix
        self.max_counters = max_counters
        self.evictions = 0
        """Counters forgotten at the cap (their hits were in Redis, or their key had expired)."""
        self.expired_hits = 0
        """Unflushed hits forgotten with their counter after its Redis key expired (sending
        them would add to a key that expires at once)."""
        self._eviction_log = EvictionLog(max_counters)
        self._room_wait = 0
        """New counters to refuse room without looking, after a scan that could not free
        enough (every counter held hits Redis lacks): one scan per as many new counters
        as it read, or per flush that lands, so a flood at the cap costs O(1) per counter."""
        self._windows: dict[int, dict[Slot, WindowCounter]] = {}
        """Counters by window end, then by (counter key, unit): ended windows are dropped
        together, and the Redis key digest is computed once per counter and window."""
        self._live = 0
        self._previous_growth: dict[str, float] = {}
        """Growth estimate per counter digest, carried into the next window."""

    @property
    def live_counters(self) -> int:
        """Counters currently tracked."""
        return self._live

    def counter(self, check: Check, now: float) -> WindowCounter:
        """The counter of ``check`` in the window of ``now``, marked busy (the caller
        releases it with ``busy -= 1`` once decided): a new one if none is held, not
        remembered (``remembered = False``) when there is no room for it."""
        start = window_start(now, check.unit_seconds)
        end = start + check.unit_seconds
        window = self._windows.get(end)
        if window is None:
            window = self._windows[end] = {}
            self.expire(now)
        slot = (check.key, check.unit_seconds)
        counter = window.get(slot)
        if counter is None:
            digest = counter_digest(check.key)
            counter = WindowCounter(
                window_key(self.prefix, digest, start), digest, expire_at(start, check.unit_seconds)
            )
            counter.growth = self._previous_growth.get(digest, 0.0)
            if check.algorithm is Algorithm.SLIDING_WINDOW:
                self._follow_previous(counter, slot, start, check.unit_seconds)
            if check.ban_seconds:
                counter.ban_key = ban_key(self.prefix, digest)
            if self._live < self.max_counters or self._make_room(now):
                self._windows.setdefault(end, window)[slot] = counter  # room making may drop an empty window
                self._live += 1
            else:
                counter.remembered = False  # for this request only: see SyncLimiter._decide_locally and _apply
        counter.busy += 1  # this request is about to use it: no eviction or expiry under it
        counter.touched = True
        return counter

    def remembered(self, check: Check, counter: WindowCounter, now: float) -> WindowCounter:
        """After a flush for room: the counter to use instead of one that could not be remembered
        (a concurrent request may have remembered the same counter meanwhile)."""
        if counter.remembered:
            return counter
        counter.busy -= 1  # it holds no hit yet: this request had not decided
        return self.counter(check, now)

    def _follow_previous(self, counter: WindowCounter, slot: Slot, start: int, unit_seconds: int) -> None:
        """Set up a sliding window's counter: its key outlives the next window (which reads
        it), and the previous window's total starts from what this replica still holds
        of it (exact once the next flush reads it back), or unknown."""
        counter.expire_at += unit_seconds
        counter.previous_key = window_key(self.prefix, counter.digest, start - unit_seconds)
        before = self._windows.get(start, {}).get(slot)
        if before is not None:
            counter.previous = before.known + before.unflushed

    def expire(self, now: float) -> None:
        """Forget ended windows whose hits have all reached Redis."""
        for end in [end for end in self._windows if end <= now]:
            window = self._windows[end]
            for slot, counter in list(window.items()):
                if counter.unflushed == 0 and not counter.busy:
                    self._previous_growth[counter.digest] = counter.growth
                    del window[slot]
                    self._live -= 1
            if not window:
                del self._windows[end]
        if len(self._previous_growth) > 4 * max(1, self._live):
            self._previous_growth.clear()

    def flush_landed(self) -> None:
        """A flush delivered hits: the counters it carried can be forgotten again, so
        the next new counter at the cap scans for room."""
        self._room_wait = 0

    def _make_room(self, now: float) -> bool:
        """At the cap: forget counters for a new one; False if none can be forgotten.

        ``max_counters`` is a hard cap, also during an outage, when counters hold hits
        Redis lacks and cannot be forgotten. A scan frees down to 90 % of the cap; one
        that cannot (it read every counter and most hold unflushed hits) is not repeated
        for as many new counters as it read, or until a flush lands: so a flood of
        unique values at the cap costs O(1) per new counter, not a scan each.
        """
        if self._room_wait > 0:
            self._room_wait -= 1
            return False
        read = self._evict(now)
        if self._live > self.max_counters * 9 // 10:
            self._room_wait = read
        return self._live < self.max_counters

    def _evict(self, now: float) -> int:
        """Forget counters Redis already holds, window ending first; returns how many were read.

        Only counters not in use by a request are forgotten, and only those without
        unflushed hits, or whose Redis key has expired (their hits would add to a key
        that expires at once: :attr:`expired_hits`), so no admitted hit that still
        counts is lost. A forgotten counter is re-read from Redis by the next decision
        that needs it (it starts at ``known = 0`` and the reserve/escalation path
        corrects it).
        """
        before = self.evictions
        target = self.max_counters * 9 // 10
        read = 0
        for end in sorted(self._windows):
            window = self._windows[end]
            forgettable = []
            for slot, counter in window.items():
                read += 1
                if not counter.busy and (counter.unflushed == 0 or counter.expire_at <= now):
                    forgettable.append(slot)
                    if self._live - len(forgettable) <= target:
                        break
            for slot in forgettable:
                self.expired_hits += window.pop(slot).unflushed
            self._live -= len(forgettable)
            self.evictions += len(forgettable)
            if not window:
                del self._windows[end]
            if self._live <= target:
                break
        self._eviction_log.note(self.evictions - before, self.evictions)
        return read

    def all_counters(self) -> list[WindowCounter]:
        """Every counter held, window by window."""
        return [counter for window in self._windows.values() for counter in window.values()]

    def unflushed_hits(self) -> int:
        """This replica's hits Redis may not hold yet, over every counter."""
        return sum(counter.unflushed for counter in self.all_counters())

    def has_unflushed(self) -> bool:
        """Whether any counter holds hits Redis may not hold yet."""
        return any(counter.unflushed for counter in self.all_counters())
