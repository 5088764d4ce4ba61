"""The embedded backend: windows and token buckets in this process's memory.

Counters are grouped by window (``(unit_seconds, start)``) so that expiry drops a
whole window's dict at once when it ends, instead of tracking a deadline per key.
Everything runs on the event loop thread, with no await between reading and
writing a counter, so no locks are needed and a request is atomic.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Sequence

import structlog

from sidecar.limiter.algorithms import Algorithm, bucket_after, now_us, previous_weight, sliding_part
from sidecar.limiter.bounds import BUCKET_SWEEP_MIN, DEFAULT_MAX_COUNTERS, Bans, EvictionLog
from sidecar.limiter.loop_lag import LoopLag
from sidecar.limiter.protocol import Check, CounterKey, Decision, decide
from sidecar.limiter.shares import share_of_limit
from sidecar.limiter.suppression import SUPPRESSED_LIMIT, Suppression
from sidecar.limiter.windows import window_start
from sidecar.metrics import LimiterSnapshot

log = structlog.get_logger(__name__)

WindowId = tuple[int, int]
"""``(unit_seconds, window_start)``."""


class MemoryLimiter:
    """Fixed-window counters held in memory, with expiry and a cap on live counters."""

    def __init__(
        self,
        *,
        instances: int = 1,
        max_counters: int = DEFAULT_MAX_COUNTERS,
        admit_all: bool = False,
        on_evict: Callable[[int], None] | None = None,
        suppression_seed: int | None = None,
    ) -> None:
        if instances < 1:
            raise ValueError("instances must be at least 1")
        if max_counters < 1:
            raise ValueError("max_counters must be at least 1")
        self.instances = instances
        self.max_counters = max_counters
        self.admit_all = admit_all
        self._windows: dict[WindowId, dict[CounterKey, int]] = {}
        self._live = 0
        self._next_expiry = math.inf
        self._on_evict = on_evict
        self.evictions = 0
        self._eviction_log = EvictionLog(max_counters)
        self._popped: dict[WindowId, int] = {}
        """Evictions per window since its dict was last rebuilt (see :meth:`_compacted`)."""
        self._kept: set[WindowId] = set()
        """Windows holding sliding-window counters: kept one window past their end."""
        self._buckets: OrderedDict[CounterKey, int] = OrderedDict()
        """Token buckets: the TAT in microseconds (a TAT in the past is a full bucket),
        least recently spent first."""
        self._new_buckets = 0
        """Buckets created since full ones were last swept out."""
        self._bucket_sweep = min(BUCKET_SWEEP_MIN, max_counters)
        """New buckets after which full ones are swept out (grows with the live ones)."""
        self._bans = Bans(max_counters)
        self.suppression = Suppression(max_counters, seed=suppression_seed)
        """``overload: suppress`` rules: this replica's attempted demand (each replica alone
        holds its share of the limit, so its own demand is the one that counts)."""
        self.loop_lag = LoopLag()
        """How late the event loop runs, from :meth:`start` on: a stall fails Envoy open in every
        mode, so the memory backend reports it as the Redis ones do (their lag lives in
        ``availability``, where it also keeps our own stalls from being charged to Redis)."""

    @property
    def live_counters(self) -> int:
        """Counters currently held (all live windows and token buckets)."""
        return self._live + len(self._buckets)

    async def check(self, checks: Sequence[Check], now: float, budget: float | None = None) -> Decision:
        """Decide the request and record its hits; see :class:`Limiter` (no budget: never waits)."""
        return self.check_now(checks, now)

    def check_now(self, checks: Sequence[Check], now: float, floors: Sequence[int] = ()) -> Decision:
        """Synchronous core of :meth:`check`, usable where no await is wanted.

        ``floors`` (a Redis failure mode's, see :mod:`sidecar.limiter.known_counts`): per
        check, a least would-be count, raising this replica's own count where what it
        knows was admitted elsewhere leaves less room than its share.
        """
        if now >= self._next_expiry:
            self._expire(now)
        for check in checks:
            if check.algorithm or check.ban_seconds or check.suppress:
                return self._check_extended(checks, now, floors)
        windows = [(check.unit_seconds, window_start(now, check.unit_seconds)) for check in checks]
        counts = self._would_be_counts(checks, windows)
        if floors:
            counts = tuple(max(count, floor) for count, floor in zip(counts, floors, strict=True))
        limits = tuple(share_of_limit(check.limit, self.instances) for check in checks)
        admitted, over, consume = decide(checks, counts, limits, self.admit_all)
        if admitted or True in consume:  # refused: only count_past_limit checks consume
            for check, window, spend in zip(checks, windows, consume, strict=True):
                if spend and check.hits:
                    self._add(window, check.key, check.hits)
        return Decision(admitted, over, counts, limits)

    def _check_extended(self, checks: Sequence[Check], now: float, floors: Sequence[int] = ()) -> Decision:
        """:meth:`check_now` for requests with a sliding window, a token bucket, a ban or
        ``overload: suppress`` (whose draw comes first: a refused draw decides the check
        against :data:`SUPPRESSED_LIMIT`, the window check stays the cap of the others).

        Kept apart so plain fixed windows, the common case, pay for none of it.
        """
        counts, states = self._extended_counts(checks, now)
        if floors:
            counts = tuple(max(count, floor) for count, floor in zip(counts, floors, strict=True))
        limits = tuple(share_of_limit(check.limit, self.instances) for check in checks)
        suppressed = self.suppression.refused(checks, limits, now)
        if suppressed is not None:
            limits = tuple(SUPPRESSED_LIMIT if out else limit for out, limit in zip(suppressed, limits, strict=True))
        admitted, over, consume = decide(checks, counts, limits, self.admit_all)
        if admitted or True in consume:
            for check, state, spend in zip(checks, states, consume, strict=True):
                if spend and check.hits:
                    self._spend(check, state, now)
        for index, (check, is_over) in enumerate(zip(checks, over, strict=True)):
            if is_over and check.ban_seconds and not (suppressed and suppressed[index]):  # a draw bans nothing
                self._bans.ban(check.key, now + check.ban_seconds, now)
        ban_ends = tuple(self._bans.until(check.key) if check.ban_seconds else 0.0 for check in checks)
        return Decision(admitted, over, counts, limits, ban_ends, suppressed or ())

    def _extended_counts(self, checks: Sequence[Check], now: float) -> tuple[tuple[int, ...], list[int]]:
        """Each check's count, and what recording it needs (a token bucket's new TAT).

        A counter named twice in one request sees the earlier check's hits, as for
        fixed windows.
        """
        seen: dict[tuple[int, CounterKey], int] = {}
        counts: list[int] = []
        states: list[int] = []
        microseconds = now_us(now)
        for check in checks:
            slot = (check.unit_seconds, check.key)
            state = 0
            if check.algorithm is Algorithm.TOKEN_BUCKET:
                tat = seen.get(slot)
                if tat is None:
                    tat = self._buckets.get(check.key, 0)
                state, count = bucket_after(tat, microseconds, check.interval_us * self.instances, check.hits)
                seen[slot] = state  # also when banned: a shadow rule's hits are still charged
            else:
                window = (check.unit_seconds, window_start(now, check.unit_seconds))
                before = seen.get(slot)
                if before is None:
                    counters = self._windows.get(window)
                    before = counters.get(check.key, 0) if counters else 0
                seen[slot] = before + check.hits
                count = before + check.hits
                if check.algorithm is Algorithm.SLIDING_WINDOW:
                    count += sliding_part(self._previous(check, window), previous_weight(now, check.unit_seconds))
            if check.ban_seconds and self._bans.active(check.key, now):
                count = check.limit + max(1, check.hits)  # banned: over whatever it holds
            counts.append(count)
            states.append(state)
        return tuple(counts), states

    def _previous(self, check: Check, window: WindowId) -> int:
        """The counter's total in the window before ``window`` (0 when unknown)."""
        counters = self._windows.get((window[0], window[1] - window[0]))
        return counters.get(check.key, 0) if counters else 0

    def _spend(self, check: Check, tat: int, now: float) -> None:
        """Record an admitted check: a bucket's new TAT, or hits in the current window."""
        if check.algorithm is Algorithm.TOKEN_BUCKET:
            self._take_tokens(check.key, tat, now)
            return
        window = (check.unit_seconds, window_start(now, check.unit_seconds))
        if check.algorithm is Algorithm.SLIDING_WINDOW and window not in self._kept:
            self._kept.add(window)  # the next window reads this one
        self._add(window, check.key, check.hits)

    def _take_tokens(self, key: CounterKey, tat: int, now: float) -> None:
        """Store a bucket's TAT; a new bucket may first sweep out full ones, and at the cap
        evicts the bucket spent least recently (its key gets a full bucket back).

        The cap is ``max_counters`` buckets, from the first one. Least recently spent,
        not oldest created: a client held at its rate keeps one bucket for ever, and a
        flood of new keys must not evict it first and hand it a fresh burst. An
        ``OrderedDict`` makes both the move and the eviction O(1), with no holes for
        ``next(iter(d))`` to walk over (see :meth:`_compacted`).
        """
        buckets = self._buckets
        if key in buckets:
            buckets.move_to_end(key)
        else:
            self._new_buckets += 1
            if self._new_buckets >= self._bucket_sweep:
                self._sweep_buckets(now)
            if len(buckets) >= self.max_counters and buckets.popitem(last=False)[1] > now_us(now):
                self.evictions += 1  # a full bucket is forgotten, a live one evicted
                if self._on_evict is not None:
                    self._on_evict(self.evictions)
                self._eviction_log.note(1, self.evictions)
        buckets[key] = tat

    def _sweep_buckets(self, now: float) -> None:
        """Forget full buckets (a TAT in the past is the same as no entry).

        A sweep reads every bucket, so the next one waits for as many new buckets as
        are left: each new bucket pays a bounded share of it, at the cap as well (a
        sweep for every new bucket there cost 5 ms per request at 200,000 buckets).
        """
        horizon = now_us(now)
        buckets = self._buckets
        for key in [key for key, tat in buckets.items() if tat <= horizon]:
            del buckets[key]
        self._new_buckets = 0
        self._bucket_sweep = max(min(BUCKET_SWEEP_MIN, self.max_counters), len(buckets))

    def record(self, check: Check, now: float) -> None:
        """Add hits admitted elsewhere (by Redis) to a counter, without deciding anything."""
        if now >= self._next_expiry:
            self._expire(now)
        if check.algorithm is Algorithm.TOKEN_BUCKET:
            interval = check.interval_us * self.instances
            tat, _ = bucket_after(self._buckets.get(check.key, 0), now_us(now), interval, check.hits)
            self._take_tokens(check.key, tat, now)
        else:
            self._spend(check, 0, now)

    def count(self, key: CounterKey, unit_seconds: int, now: float) -> int:
        """Current count of one counter (0 when absent or expired)."""
        window = self._windows.get((unit_seconds, window_start(now, unit_seconds)))
        return window.get(key, 0) if window else 0

    def snapshot(self) -> LimiterSnapshot:
        lag = self.loop_lag
        return LimiterSnapshot(
            counters=self.live_counters,
            evictions=self.evictions,
            loop_lag_latest=lag.latest,
            loop_lag_max=lag.take_max(),
            loop_lag=lag.buckets,
        )

    async def start(self) -> None:
        """Only the loop-lag timer runs in the background: expiry happens on the request path."""
        self.loop_lag.start()

    async def close(self, deadline: float | None = None) -> None:
        """Nothing to flush: memory dies with the process; the loop-lag timer stops."""
        self.loop_lag.stop()

    def _would_be_counts(self, checks: Sequence[Check], windows: Sequence[WindowId]) -> tuple[int, ...]:
        """Each counter plus this request's hits; repeated counters see earlier checks' hits."""
        seen: dict[tuple[WindowId, CounterKey], int] = {}
        counts = []
        for check, window in zip(checks, windows, strict=True):
            slot = (window, check.key)
            before = seen.get(slot)
            if before is None:
                counters = self._windows.get(window)
                before = counters.get(check.key, 0) if counters else 0
            after = before + check.hits
            seen[slot] = after
            counts.append(after)
        return tuple(counts)

    def _end(self, window: WindowId) -> int:
        """When a window's counters may go: its end, or one window later if sliding counters read it."""
        unit, start = window
        return start + (2 * unit if window in self._kept else unit)

    def _add(self, window: WindowId, key: CounterKey, hits: int) -> None:
        counters = self._windows.get(window)
        if counters is None:
            counters = self._windows[window] = {}
            self._next_expiry = min(self._next_expiry, self._end(window))
        before = counters.get(key)
        if before is None:
            self._live += 1
            counters[key] = hits
            if self._live > self.max_counters:
                self._evict()
        else:
            counters[key] = before + hits

    def _expire(self, now: float) -> None:
        """Drop every window that has ended; runs at most once per window end."""
        ended = [window for window in self._windows if self._end(window) <= now]
        for window in ended:
            self._live -= len(self._windows.pop(window))
            self._popped.pop(window, None)
            self._kept.discard(window)
        self._next_expiry = min(map(self._end, self._windows), default=math.inf)

    def _compacted(self, window: WindowId) -> dict[CounterKey, int]:
        """The counters of ``window``, rebuilt once evictions left many holes at its front.

        A dict keeps deleted slots until it is rebuilt, and ``next(iter(d))`` walks over
        them: popping the oldest entry again and again would scan every earlier hole,
        making each eviction slower than the last (117 us per new key at a 200,000 cap).
        """
        counters = self._windows[window]
        if self._popped.get(window, 0) > len(counters) // 16 + 64:
            counters = self._windows[window] = dict(counters)
            self._popped[window] = 0
        return counters

    def _evict(self) -> None:
        """Make room by dropping counters of the window that ends first, oldest insert first.

        Losing a live counter gives its key a fresh budget, so the counters that would
        have expired soonest go first: a per-second counter loses at most a second of
        history, a per-day one would lose a day. This only happens under a flood of
        unique values; evictions are counted and logged at most once a minute.
        """
        excess = self._live - self.max_counters
        evicted = 0
        while excess > 0:
            oldest = min(self._windows, key=self._end)
            counters = self._compacted(oldest)
            while excess > 0 and counters:
                counters.pop(next(iter(counters)))
                excess -= 1
                self._live -= 1
                self.evictions += 1
                evicted += 1
                self._popped[oldest] = self._popped.get(oldest, 0) + 1
            if not counters:
                del self._windows[oldest]
                self._popped.pop(oldest, None)
                self._kept.discard(oldest)
        if self._on_evict is not None:
            self._on_evict(self.evictions)
        self._eviction_log.note(evicted, self.evictions)
