"""What a ``sync`` replica knows of each counter, and what one flush carries.

Kept apart from :mod:`sidecar.limiter.sync` (the decisions and the flush loop) because
these are its plain data: one :class:`WindowCounter` per counter and window, the
check an escalation sends (:func:`lowered_check`), and a :class:`FlushBatch`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from sidecar.limiter.algorithms import Algorithm
from sidecar.limiter.protocol import Check, CounterKey
from sidecar.limiter.redis.keys import EXPIRY_GRACE_SECONDS, counter_digest
from sidecar.limiter.suppression import AVERAGE_OVER, RING, Demand, Suppression, slot_of


@dataclass(slots=True)
class WindowCounter:
    """What this replica knows about one counter in one window."""

    key: str
    digest: str
    expire_at: int
    known: int = 0
    """Global total last read from Redis (includes our flushed hits)."""
    pending: int = 0
    """Admitted here, not yet sent to Redis."""
    inflight: int = 0
    """Sent in a flush that has not been acknowledged yet."""
    growth: float = 0.0
    """EWMA of hits other replicas add between two of our syncs."""
    own: int = 0
    """Hits this replica admitted in the window (the ``local`` failure mode's measure)."""
    doubt: int = 0
    """Hits of this replica's escalations on the wire: Redis may admit them any moment (the
    ``local`` failure mode counts them as admitted until their answer comes)."""
    touched: bool = True
    """Used since the last flush: its total is worth reading back."""
    read: int = -1
    """Sequence number of the last flush that read its total back (-1: none yet)."""
    busy: int = 0
    """Requests deciding with this counter right now: it must not be evicted or expired
    under them, or the hits they admit would land on a counter nobody flushes."""
    ban_key: str | None = None
    """Rules with ``ban_duration``: the counter's ban key, read back with every flush."""
    previous_key: str | None = None
    """Sliding window only: the previous window's key, read back with every flush."""
    previous: int | None = None
    """Sliding window only: the previous window's global total; None until known (every
    decision on the counter escalates until then)."""
    remembered: bool = True
    """False for a counter made for one request only, at ``--max-counters`` with no counter
    that can be forgotten: nothing flushes its hits, so only Redis (an escalation) may
    admit on it, and hits a failure mode admits on it are dropped and counted."""

    @property
    def unflushed(self) -> int:
        """Our hits Redis may not hold yet."""
        return self.pending + self.inflight

    def reserve(self, cap: int, replicas: int) -> int:
        """Room kept for other replicas' blind hits (``cap`` each) and their growth until our next sync."""
        if replicas <= 1:
            return 0
        return (replicas - 1) * cap + math.ceil(self.growth)

    def extra_reads(self) -> list[str]:
        """Keys a flush reads besides the counter: the previous window, the ban."""
        return [key for key in (self.previous_key, self.ban_key) if key is not None]


class ReturnWatch:
    """sync, returning from an outage: whether a counter may still lack a peer's outage hits.

    All may until this replica is settled (:attr:`Replicas.returning`); then each one that
    a flush read back before that, until a flush prepared since has read it again: what it
    knew was read before the peers' outage hits landed. A counter no flush has read yet is
    a first touch, as with Redis up all along.
    """

    def __init__(self) -> None:
        self.fresh_from: int | None = 0
        """Flushes from this sequence number on read every outage hit (None: still returning)."""

    def outage(self) -> None:
        """Redis was marked down."""
        self.fresh_from = None

    def held(self, returning: bool, sequence: int, counters: Sequence[WindowCounter]) -> bool:
        """Whether a decision on ``counters`` is held to this replica's share; ``sequence``:
        the last flush numbered."""
        if returning:
            self.fresh_from = None
            return True
        if self.fresh_from is None:
            self.fresh_from = sequence + 1
        fresh = self.fresh_from
        return any(0 <= counter.read < fresh for counter in counters)

    @staticmethod
    def with_doubt(counts: Sequence[int], counters: Sequence[WindowCounter]) -> tuple[int, ...]:
        """``counts`` (own hits) plus the hits of this replica's escalations on the wire (Redis
        may admit them any moment): what a held decision counts against the share."""
        return tuple(count + max(0, counter.doubt) for count, counter in zip(counts, counters, strict=True))


def lowered_check(check: Check, own: int, previous_part: int | None) -> Check:
    """The check an escalation sends: the limit lowered by our unflushed hits.

    A sliding window whose previous total is known goes as a fixed window with the
    limit also lowered by that total's weighted part, so the answer is the current
    window's count, which :meth:`SyncLimiter._learn` can learn from; one whose previous
    total is unknown goes as a sliding window and the script weighs the previous
    window itself.
    """
    # Not clamped at 0: hits counted past the limit (count_past_limit) can leave less
    # than nothing, and a check of 0 hits must then still be over.
    if previous_part is None:
        return check._replace(limit=check.limit - own)
    lowered = check.limit - own - previous_part
    return check._replace(limit=lowered, algorithm=Algorithm.FIXED_WINDOW)


@dataclass(slots=True)
class FlushBatch:
    """One flush: what was sent, so the answer (or failure) can be applied."""

    sent: dict[str, tuple[WindowCounter, int]]
    reads: list[WindowCounter]
    sequence: int
    """Grows with every new batch; a retried batch keeps its number (idempotent flush)."""

    bans: dict[str, int] = field(default_factory=dict)
    """Bans decided here since the last flush: ``{ban key: until}`` (SET NX, so the first wins)."""
    attempts: AttemptFlush | None = None
    """``overload: suppress``: the attempted hits this flush sends, and the slots it reads."""

    def counters(self) -> list[WindowCounter]:
        """Every counter the flush sends hits for or reads back."""
        return [counter for counter, _ in self.sent.values()] + self.reads


def attempt_key(prefix: str, key: CounterKey, slot: int) -> str:
    """Redis key of one counter's attempted hits in one sub-interval: ``prefix:{digest}:att:slot``
    (the counter's hash tag, so Cluster keeps it in the counter's slot)."""
    return f"{prefix}:{{{counter_digest(key)}}}:att:{slot}"


@dataclass(slots=True)
class AttemptFlush:
    """What one flush carries for ``overload: suppress``: attempted hits are shared like
    admitted ones, each replica adding its own to one key per counter and sub-interval and
    reading back every replica's, so all apply the same ``p``."""

    sent: dict[str, tuple[Demand, int, int]] = field(default_factory=dict)
    """``{key: (demand, slot, hits)}``: this replica's attempted hits, sent with INCRBY."""
    reads: dict[str, tuple[Demand, int]] = field(default_factory=dict)
    """``{key: (demand, slot)}``: the slots the estimate reads, read back."""
    expires: dict[str, int] = field(default_factory=dict)
    """When each sent key may expire (once no estimate reads its slot)."""

    def adds(self) -> dict[str, tuple[int, int]]:
        """The adds as :meth:`~sidecar.limiter.redis.store.RedisStore.flush` takes them."""
        return {key: (hits, self.expires[key]) for key, (_, _, hits) in self.sent.items()}

    def learn(self, totals: dict[str, int]) -> None:
        """Take on every replica's attempted hits from a flush's answer."""
        for key, (demand, slot, hits) in self.sent.items():
            if key in totals:
                demand.learn(slot, totals[key], hits)
        for key, (demand, slot) in self.reads.items():
            if key in totals:
                demand.learn(slot, totals[key], 0)


def attempt_flush(suppression: Suppression, prefix: str, now: float) -> AttemptFlush | None:
    """The attempted hits to send and the slots to read, for the counters attempted since the
    last flush (so the work follows the traffic, not the number of counters followed); each is
    read once more by the first flush after the sub-interval of its last attempt ends, so every
    replica learns that sub-interval's final total even if no attempt follows."""
    touched = suppression.take_touched()
    if not touched:
        return None
    flush = AttemptFlush()
    for key, demand in touched:
        for slot, hits in demand.send():
            name = attempt_key(prefix, key, slot)
            flush.sent[name] = (demand, slot, hits)
            flush.expires[name] = math.ceil((slot + RING + 1) * demand.length_ms / 1000) + EXPIRY_GRACE_SECONDS
        current = slot_of(now, demand.length_ms)
        for slot in range(current - AVERAGE_OVER, current + 1):
            name = attempt_key(prefix, key, slot)
            if name not in flush.sent:
                flush.reads[name] = (demand, slot)
        if current <= max(demand.slots) + 1:
            suppression.touched.setdefault(key, demand)  # read again once its last slot is complete
    return flush


def attempt_call(suppression: Suppression, prefix: str, checks: Sequence[Check], now: float) -> AttemptFlush:
    """Strict mode: the attempted hits of one request's ``suppress`` checks (already counted
    in flight by :meth:`~sidecar.limiter.suppression.Suppression.refused`), added by the
    request's own script call, which answers with every replica's total."""
    call = AttemptFlush()
    for check in checks:
        demand = suppression.demands.get(check.key)
        if not check.suppress or check.hits <= 0 or demand is None:
            continue
        slot = slot_of(now, demand.length_ms)
        name = attempt_key(prefix, check.key, slot)
        before = call.sent.get(name)
        call.sent[name] = (demand, slot, check.hits + (before[2] if before else 0))
        call.expires[name] = math.ceil((slot + RING + 1) * demand.length_ms / 1000) + EXPIRY_GRACE_SECONDS
    return call
