"""What a ``sync`` replica knows of each counter, and what one flush carries.

Kept apart from :mod:`sidecar.limiter.sync` (the decisions and the flush loop) because
these are its plain data: one :class:`WindowCounter` per counter and window, the
check an escalation sends (:func:`lowered_check`), and a :class:`FlushBatch`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sidecar.limiter.algorithms import Algorithm
from sidecar.limiter.protocol import Check, CounterKey
from sidecar.limiter.redis.keys import EXPIRY_GRACE_SECONDS, counter_digest
from sidecar.limiter.suppression import AVERAGE_OVER, RING, Demand, Suppression, slot_of

if TYPE_CHECKING:
    from sidecar.limiter.redis.store import RedisStore

GROWTH_SMOOTHING = 0.5
"""EWMA weight of the newest growth sample: reacts within two syncs to a change."""


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

    def adds_and_reads(self) -> tuple[dict[str, tuple[int, int]], list[str]]:
        """What :meth:`~sidecar.limiter.redis.store.RedisStore.flush` sends and reads for it."""
        adds = {key: (hits, counter.expire_at) for key, (counter, hits) in self.sent.items()}
        reads = [counter.key for counter in self.reads]
        reads += [key for counter in self.counters() for key in counter.extra_reads()]
        if self.attempts is not None:
            adds.update(self.attempts.adds())
            reads += self.attempts.reads
        return adds, reads

    def split(self, failed: Sequence[str]) -> tuple[FlushBatch, FlushBatch]:
        """``(what landed, what to send again)`` of a flush whose ``failed`` keys did not
        (:class:`~sidecar.limiter.redis.flush_calls.PartialFlush`: in Cluster, their master
        is down). The rest keeps this batch's sequence number, its bans (``SET NX``: a
        landed one is not moved) and its attempted hits if one of theirs failed (added once per key and
        sequence)."""
        gone = set(failed)
        landed = FlushBatch(
            {key: sent for key, sent in self.sent.items() if key not in gone},
            [counter for counter in self.reads if counter.key not in gone],
            self.sequence,
        )
        attempts = self.attempts
        rest = FlushBatch(
            {key: sent for key, sent in self.sent.items() if key in gone},
            [counter for counter in self.reads if counter.key in gone],
            self.sequence,
            self.bans,
            attempts if attempts is not None and gone & attempts.sent.keys() else None,
        )
        return landed, rest


def held_back(unacknowledged: Iterable[FlushBatch], store: RedisStore) -> Callable[[str], bool]:
    """Whether a counter's pending hits stay out of the next flush: a flush still to be
    resent carries earlier hits of its key (they must land first: ``flush_once.lua``'s
    marker is per key), or in Cluster its master is known down (the flush would fail)."""
    blocked = {key for batch in unacknowledged for key in batch.sent}
    nodes = getattr(store, "nodes", None)  # a simulated store has none
    down = nodes is not None and bool(nodes.down())
    return lambda key: key in blocked or (down and store.unavailable_for((key,)) is not None)


def prepare_flush(counters: Iterable[WindowCounter], held: Callable[[str], bool], batch: FlushBatch) -> FlushBatch:
    """Fill ``batch``: every counter's pending hits move in flight and are sent, except a
    ``held`` key's (a flush still to be resent carries its earlier hits, which must land
    first; or its master is known down): those stay pending, read back like any counter
    used since the last flush."""
    for counter in counters:
        if counter.pending and not held(counter.key):
            hits = counter.pending
            counter.inflight += hits
            counter.pending = 0
            batch.sent[counter.key] = (counter, hits)
        elif counter.touched:
            batch.reads.append(counter)
        counter.touched = False
    return batch


def learn_totals(batch: FlushBatch, totals: dict[str, int]) -> None:
    """Learn the global totals a flush read back; the growth we did not cause feeds the reserve."""
    own = {key: hits for key, (_, hits) in batch.sent.items()}
    for counter in batch.counters():
        if counter.previous_key is not None:
            counter.previous = totals.get(counter.previous_key, counter.previous)
        total = totals.get(counter.key, counter.known)
        sent = own.get(counter.key, 0)
        others = max(0, total - counter.known - sent)
        counter.growth = GROWTH_SMOOTHING * others + (1 - GROWTH_SMOOTHING) * counter.growth
        counter.inflight -= sent
        counter.known, counter.read = max(counter.known, total), batch.sequence


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
