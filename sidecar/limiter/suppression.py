"""``overload: suppress``: steady admissions under overload, from the demand that was attempted.

A fixed or sliding window under sustained overload hands its whole budget to the first
requests of each window and refuses everything after, so throughput swings between all
and nothing at the window's period. A rule with ``overload: suppress`` instead admits
each request with probability ``p = min(1, limit_rate / attempted_rate)`` *before* its
window check (which stays the hard cap), so the budget is spread over the window.

``attempted_rate`` is the rate of hits that were *attempted* (admitted and refused
alike; the refused ones are the demand the limit has to absorb). It is estimated per
counter over sub-intervals of a tenth of the window (:data:`SLOTS_PER_WINDOW`), aligned
to the epoch so replicas agree on them: the average of the last :data:`AVERAGE_OVER`
complete sub-intervals, replaced by the one in progress as soon as that one alone
already holds more (Ably's modified moving average: a spike counts within the
sub-interval it starts in, and an onset settles within ``AVERAGE_OVER`` sub-intervals).
While the estimate is within the limit's rate ``p`` is exactly 1 and no random number
is drawn: a client within its limit is never suppressed.

Where the counts live: the memory backend counts its own requests; ``sync`` adds the
hits read back from Redis (each replica flushes its attempted hits with its batch, to
one key per counter and sub-interval: :mod:`sidecar.limiter.sync_counters`); ``strict``
adds and reads them in the request's own script call. So every replica applies the
same ``p`` from the global demand. Work per request is O(1) (a few slots of
one counter), and at most ``max_counters`` counters are followed, least recently used
forgotten first.
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

from sidecar.limiter.bounds import DEFAULT_MAX_COUNTERS

if TYPE_CHECKING:
    from sidecar.limiter.protocol import Check, CounterKey

Sharing = Literal["local", "flush", "call"]
"""How a replica's attempted hits reach the others (see :attr:`Suppression.sharing`)."""
SLOTS_PER_WINDOW = 10
"""Sub-intervals per window: a 1 s window is followed in 100 ms steps."""
AVERAGE_OVER = 2
"""Complete sub-intervals averaged: short, so an estimate both rises and falls within
two sub-intervals of a change (a long average keeps suppressing after the demand fell)."""
RING = AVERAGE_OVER + 1
"""Slots kept per counter: the one in progress and the complete ones averaged."""
SUPPRESSED_LIMIT = -1
"""The limit a suppressed check is decided against: every hit is over it, so the backend
refuses it through its ordinary path (the response, headers and all-or-nothing rule)."""
MAX_SHOWN = 20
"""Busy counters ``/config`` shows, highest demand first."""


def slot_ms(unit_seconds: int) -> int:
    """Length of one sub-interval of a window, in whole milliseconds (at least 1)."""
    return max(1, unit_seconds * 1000 // SLOTS_PER_WINDOW)


def slot_of(now: float, length_ms: int) -> int:
    """The epoch-aligned sub-interval ``now`` falls in."""
    return math.floor(now * 1000) // length_ms


class Demand:
    """Attempted hits of one counter in its last few sub-intervals.

    Per slot: ``known`` (hits counted here, or the global total read back from Redis)
    and ``unflushed`` (this replica's hits Redis may not hold yet); the slot's count
    is their sum.
    """

    __slots__ = ("inflight", "known", "length_ms", "limit", "p", "pending", "slots")

    def __init__(self, length_ms: int) -> None:
        self.length_ms = length_ms
        self.slots = [-1] * RING
        self.known = [0] * RING
        self.pending = [0] * RING
        """Hits attempted here, not yet sent to Redis (only ``sync`` sends them)."""
        self.inflight = [0] * RING
        """Hits sent in a flush that has not been answered yet."""
        self.limit = 0
        """The limit of the last check, per window: what ``p`` is worked out against."""
        self.p = 1.0
        """The last ``p`` worked out, for ``/config``."""

    def _index(self, slot: int) -> int:
        """The ring index of ``slot``, cleared first if it held an older slot."""
        index = slot % RING
        if self.slots[index] != slot:
            self.slots[index] = slot
            self.known[index] = self.pending[index] = self.inflight[index] = 0
        return index

    def count(self, slot: int) -> int:
        """Attempted hits in ``slot`` (0 when it is no longer, or not yet, held)."""
        index = slot % RING
        if self.slots[index] != slot:
            return 0
        return self.known[index] + self.pending[index] + self.inflight[index]

    def attempt(self, slot: int, hits: int, *, sharing: Sharing = "local") -> None:
        """Count hits attempted in ``slot``: known (``local``), pending for the next flush
        (``flush``), or in flight with the request's own script call (``call``)."""
        index = self._index(slot)
        if sharing == "flush":
            self.pending[index] += hits
        elif sharing == "call":
            self.inflight[index] += hits
        else:
            self.known[index] += hits

    def learn(self, slot: int, total: int, sent: int) -> None:
        """A flush's answer: ``total`` attempted hits in ``slot`` over every replica,
        ``sent`` of them ours from that flush (no longer in flight)."""
        index = slot % RING
        if self.slots[index] > slot:
            return  # the slot left the ring while the flush was on the wire
        index = self._index(slot)  # a slot only the other replicas attempted in is taken on
        self.inflight[index] = max(0, self.inflight[index] - sent)
        self.known[index] = max(self.known[index], total)

    def send(self) -> list[tuple[int, int]]:
        """``(slot, hits)`` of every slot with hits pending for Redis, now in flight."""
        sent = []
        for index in range(RING):
            hits = self.pending[index]
            if hits:
                sent.append((self.slots[index], hits))
                self.inflight[index] += hits
                self.pending[index] = 0
        return sent

    def rate(self, slot: int) -> float:
        """Estimated attempted hits per sub-interval: the average of the last complete
        ones, or the one in progress once it alone holds more."""
        average = sum(self.count(slot - back) for back in range(1, AVERAGE_OVER + 1)) / AVERAGE_OVER
        return max(average, float(self.count(slot)))

    def probability(self, slot: int, limit: int) -> float:
        """``p = min(1, limit per sub-interval / attempted per sub-interval)``."""
        allowed = limit / SLOTS_PER_WINDOW
        attempted = self.rate(slot)
        self.limit = limit
        self.p = 1.0 if attempted <= allowed else allowed / attempted
        return self.p


class Suppression:
    """The attempted demand of every counter with ``overload: suppress``, and the draw."""

    def __init__(
        self, max_counters: int = DEFAULT_MAX_COUNTERS, *, seed: int | None = None, sharing: Sharing = "local"
    ) -> None:
        if max_counters < 1:
            raise ValueError("max_counters must be at least 1")
        self.max_counters = max_counters
        self.sharing: Sharing = sharing
        """How attempts reach the other replicas: not at all (``local``: memory), with the
        next flush (``flush``: sync), or with the request's own script call (``call``: strict)."""
        self.random = random.Random(seed)
        """Seedable, so tests and the accuracy harness are reproducible."""
        self.demands: OrderedDict[CounterKey, Demand] = OrderedDict()
        """Least recently used first: at the cap the first one is forgotten (O(1))."""
        self.suppressed = 0
        """Checks refused by a draw (a request with two suppressed checks counts twice)."""
        self.forgotten = 0
        """Counters forgotten at the cap."""
        self.touched: dict[CounterKey, Demand] = {}
        """``flush``: counters attempted since the last flush (:meth:`take_touched`)."""

    def demand(self, key: CounterKey, unit_seconds: int) -> Demand:
        """The demand of ``key``, created (and the least recently used one forgotten at the cap)."""
        demands = self.demands
        found = demands.get(key)
        if found is not None:
            demands.move_to_end(key)
            return found
        if len(demands) >= self.max_counters:
            demands.popitem(last=False)
            self.forgotten += 1
        made = demands[key] = Demand(slot_ms(unit_seconds))
        return made

    def refused(self, checks: Sequence[Check], limits: Sequence[int], now: float) -> tuple[bool, ...] | None:
        """Count every ``suppress`` check's hits as attempted, then draw for each.

        ``limits``: the limits the backend enforces (a replica's share with ``--instances``).
        Returns, per check, whether a draw refused it; None when none was refused (the
        common case allocates nothing). Checks of 0 hits attempt nothing and are not drawn.
        """
        refused: list[bool] | None = None
        for index, check in enumerate(checks):
            if not check.suppress or check.hits <= 0:
                continue
            demand = self.demand(check.key, check.unit_seconds)
            slot = slot_of(now, demand.length_ms)
            demand.attempt(slot, check.hits, sharing=self.sharing)
            if self.sharing == "flush":
                self.touched[check.key] = demand
            p = demand.probability(slot, limits[index])
            if p < 1.0 and self.random.random() >= p:
                if refused is None:
                    refused = [False] * len(checks)
                refused[index] = True
                self.suppressed += 1
        return None if refused is None else tuple(refused)

    def take_touched(self) -> list[tuple[CounterKey, Demand]]:
        """The counters attempted since the last call: what a ``sync`` flush sends and reads."""
        touched, self.touched = self.touched, {}
        return list(touched.items())

    def describe(self, now: float, limit: int = MAX_SHOWN) -> list[dict[str, object]]:
        """The busiest counters (highest attempted rate) with their current ``p``, for ``/config``.

        Reads at most :data:`MAX_SHOWN_SCAN` counters (the most recently used), so a
        call costs a bounded amount of work on the event loop however many are followed.
        """
        busy: list[tuple[float, CounterKey, float]] = []
        for key, demand in _recent(self.demands, MAX_SHOWN_SCAN):
            slot = slot_of(now, demand.length_ms)
            attempted = demand.rate(slot)
            if attempted <= 0:
                continue
            allowed = demand.limit / SLOTS_PER_WINDOW
            p = 1.0 if attempted <= allowed else allowed / attempted
            busy.append((attempted * 1000 / demand.length_ms, key, p))
        busy.sort(key=lambda item: -item[0])
        return [
            {"counter": list(key), "attempted_per_second": round(rate, 3), "p": round(p, 4)}
            for rate, key, p in busy[:limit]
        ]


def lowered_where(
    checks: Sequence[Check], drawn: Sequence[bool] | None, *, unbanned: bool = False, drawn_once: bool = False
) -> list[Check]:
    """``checks`` with those a draw refused decided against :data:`SUPPRESSED_LIMIT`.

    ``unbanned``: without their ban duration too, for a backend whose script would ban every
    over check (a draw is no full window). ``drawn_once``: every check loses its
    ``suppress`` flag, so a fallback that decides them again (strict mode's failure policy,
    a memory backend) does not draw a second time.
    """
    lowered = []
    for index, check in enumerate(checks):
        made = check
        if drawn is not None and drawn[index]:
            made = made._replace(limit=SUPPRESSED_LIMIT, ban_seconds=0 if unbanned else check.ban_seconds)
        lowered.append(made._replace(suppress=False) if drawn_once and check.suppress else made)
    return lowered


MAX_SHOWN_SCAN = 1000
"""Counters :meth:`Suppression.describe` reads at most, newest first."""


def _recent(demands: OrderedDict[CounterKey, Demand], most: int) -> list[tuple[CounterKey, Demand]]:
    """Up to ``most`` of the most recently used demands (reversed iteration stops early)."""
    found: list[tuple[CounterKey, Demand]] = []
    for key in reversed(demands):
        if len(found) >= most:
            break
        found.append((key, demands[key]))
    return found
