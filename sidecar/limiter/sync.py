"""``sync`` mode: local wall-clock windows, reconciled with Redis off the request path.

Each replica decides from what it knows: the global total it last read from Redis
(``known``) plus the hits it admitted since (``pending``, and ``inflight`` while a
flush is on the wire). A background task flushes pending hits in one pipeline every
``sync_interval`` and reads the totals back. The request path touches Redis only
near a limit, where guessing stops and one atomic script decides ("escalation").

The rule for admitting locally (per counter, per window, ``R`` live replicas):

* **blind cap** ``Q``: a replica holds at most ``Q`` hits that Redis has not seen
  (``pending + inflight``). Reaching half of it wakes the flusher early, so under
  load the replica syncs as fast as it admits, and Redis round trips stay in the
  background. ``Q = floor(max_overshoot * limit / (R - 1))``; one replica alone
  has no cap, and ``Q = 0`` (a low limit) makes every admission exact.
* **reserve**: a hit is admitted locally only while
  ``known + own unflushed + hits + reserve <= limit`` with
  ``reserve = (R - 1) * Q + growth``, where ``growth`` estimates what the other
  replicas admit between two of our syncs (an EWMA of the global growth we did not
  cause). Inside the reserve zone every decision escalates to Redis.
* **rejections are local only when certain**: a request is refused without Redis
  only if what this replica itself knows is admitted (``known + own unflushed``)
  already leaves no room, so a well-behaved client is never refused while the
  global admitted total is below the limit.

Bound (docs/redis.md): escalations are exact against the counts Redis holds, and the
only hits Redis does not hold are the other replicas' blind hits, at most ``Q`` each, so
the total per counter and window exceeds the limit by at most ``(R - 1) * Q <=
max_overshoot * limit``, while Redis answers within the budget and the replicas agree on
``R`` (every flush reads the live count). Returning from an outage, a counter is also held
to the replica's share until the peers' outage hits are in what it knows (:class:`ReturnWatch`).

Sliding windows decide on the same rule with the previous window's weighted total
added to the count; that total is read back by every flush, so right after a
boundary it may lack the other replicas' last unflushed hits of the previous window
(at most ``Q`` each): the estimate's bound is ``2 x (R - 1) * Q`` until the first
flush after the boundary, then ``(R - 1) * Q``. Bans are refused locally, written by
the next flush (``SET NX`` with the end time) and learnt from the ban keys a flush
reads back or an escalation answers with.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable, Sequence

import structlog

from sidecar.limiter.algorithms import Algorithm, previous_weight, sliding_part
from sidecar.limiter.bounds import DEFAULT_MAX_COUNTERS, Bans, blind_cap
from sidecar.limiter.budget import DEFAULT_REDIS_TIMEOUT, FailureReasons, Reason, redis_wait
from sidecar.limiter.failure import FailureMode, Settlement, held_to_shares, sync_failure_limits
from sidecar.limiter.hooks import RedisWaits
from sidecar.limiter.protocol import Check, Decision, decide
from sidecar.limiter.redis.availability import RedisUnavailable, flush_until, stop_task
from sidecar.limiter.redis.batcher import DeadlineReached, DecisionBatcher
from sidecar.limiter.redis.cluster_health import unavailable_reason
from sidecar.limiter.redis.flush_calls import PartialFlush
from sidecar.limiter.redis.keys import ban_key, counter_digest
from sidecar.limiter.redis.replicas import Replicas
from sidecar.limiter.redis.store import CorruptKey, Counts, RedisStore
from sidecar.limiter.redis.store import verdict as script_verdict
from sidecar.limiter.suppression import Suppression, lowered_where
from sidecar.limiter.sync_counters import (
    FlushBatch,
    ReturnWatch,
    WindowCounter,
    attempt_flush,
    held_back,
    learn_totals,
    lowered_check,
    prepare_flush,
)
from sidecar.limiter.sync_table import CounterTable
from sidecar.limiter.windows import Clock, system_clock
from sidecar.metrics import FLUSH_KEYS_BUCKETS, FLUSH_SECONDS_BUCKETS, Buckets, LimiterSnapshot

log = structlog.get_logger(__name__)

DEFAULT_MAX_OVERSHOOT = 0.05


class SyncLimiter:
    """Limiter backend for ``--backend redis --mode sync``."""

    takes_budget = True
    """The service passes each call's budget (its gRPC deadline less a margin) to :meth:`check`."""

    def __init__(
        self,
        store: RedisStore,
        replicas: Replicas,
        *,
        prefix: str = "rls",
        sync_interval: float = 0.05,
        redis_timeout: float = DEFAULT_REDIS_TIMEOUT,
        failure_mode: FailureMode = "local",
        admit_all: bool = False,
        max_overshoot: float = DEFAULT_MAX_OVERSHOOT,
        max_counters: int = DEFAULT_MAX_COUNTERS,
        clock: Clock = system_clock,
        suppression_seed: int | None = None,
    ) -> None:
        self.store = store
        self.replicas = replicas
        self.prefix = prefix
        self.sync_interval = sync_interval
        self.redis_timeout = redis_timeout
        """``--redis-timeout``: the longest a request waits for an escalation's answer."""
        self.failure_mode = failure_mode
        self.admit_all = admit_all
        self.max_overshoot = max_overshoot
        self.max_counters = max_counters
        self.table = CounterTable(prefix, max_counters)
        """The counters this replica holds, capped at ``max_counters``."""
        self.dropped_hits = 0
        """Hits a failure mode admitted on counters that could not be remembered (at
        ``max_counters``, every counter holding hits Redis lacks): never sent to Redis."""
        self._drop_logged = False
        self._room_flush: asyncio.Task[None] | None = None
        """The flush requests at the cap wait for while Redis answers (:meth:`_wait_for_room`)."""
        self._flushes_delivered = 0
        """Flushes that delivered hits: each makes the counters it carried forgettable."""
        self.clock = clock
        self.suppression = Suppression(max_counters, seed=suppression_seed, sharing="flush")
        """``overload: suppress``: attempted hits, shared through Redis by every flush."""
        self._bans = Bans(max_counters)
        """Bans by Redis ban key: our own, and the others' read back by flushes."""
        self._ban_outbox: dict[str, int] = {}
        """Bans this replica decided, to be written to Redis with the next flush (key: until)."""
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._flush_lock = asyncio.Lock()
        self._sequence = 0
        self._unacknowledged: dict[int, FlushBatch] = {}
        self.escalations = 0
        self.flush_seconds = Buckets(FLUSH_SECONDS_BUCKETS)
        self.flush_keys = Buckets(FLUSH_KEYS_BUCKETS)
        self.batcher = DecisionBatcher(store, admit_all, lock=self._flush_lock)
        """Shares the flush lock: no escalation is in Redis while one of our flushes is."""
        self.local_decisions = 0
        self.failure_decisions = 0
        self.reasons = FailureReasons()
        """Requests the failure mode decided, by why (``deadline``, ``redis_down``, ...)."""
        self.redis_waits: RedisWaits | None = None
        """Wraps each escalation and flush when tracing is on (:mod:`sidecar.limiter.hooks`)."""
        self.settlement, self.returns = Settlement(), ReturnWatch()  # returning from an outage (docs/redis.md)

    # ----------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Connect (or start probing), start heartbeats and the background flusher."""
        self.store.add_listener(self._on_redis_state)
        if (nodes := getattr(self.store, "nodes", None)) is not None:
            nodes.add_shard_listener(self._on_shard)
        self.replicas.follow_outages(self.settlement.settled, shards=True)
        await self.store.start()
        await self.replicas.start()
        self._task = asyncio.create_task(self._sync_loop(), name="sync-flusher")

    async def close(self, deadline: float | None = None) -> None:
        """Stop the flusher and push every admitted hit to Redis before leaving.

        While Redis does not answer, the last flush probes it again every 100 ms until
        ``deadline`` (``time.monotonic()``: what the shutdown grace left), so an outage
        that ends within the grace loses nothing; what is still unflushed then is lost,
        and logged as an error with its count (``admitted_hits_lost``).
        """
        if self._task is not None:
            await stop_task(self._task)
        await self.batcher.drain()  # late answers adjust pending hits before the last flush
        table = self.table
        await flush_until(self._last_flush, lambda: not table.has_unflushed(), deadline, self.store.background_timeout)
        lost = table.unflushed_hits()
        if lost:
            log.error(
                "admitted_hits_lost",
                mode="sync",
                hits=lost,
                counters=sum(1 for counter in table.all_counters() if counter.unflushed),
                reason=self.store.last_error,
                hint="Redis did not take the last flush within --shutdown-grace; these hits are not in its counters",
            )
        log.info(
            "sync_closed",
            unflushed_hits=lost,
            dropped_hits=self.dropped_hits,
            expired_hits=self.expired_hits,
            escalations=self.escalations,
            late_answers=self.batcher.late_answers,
            local_decisions=self.local_decisions,
            failure_decisions=self.failure_decisions,
            failure_reasons={reason: count for reason, count in self.reasons.counts.items() if count},
            redis_round_trips_request_path=self.store.round_trips_request_path,
            redis_round_trips_background=self.store.round_trips_background,
        )
        await self.replicas.close()
        await self.store.close()

    async def _last_flush(self) -> None:
        """One attempt of the last flush: probe Redis if it is down, then flush."""
        if await self.store.probe():
            await self.sync_once()

    def _on_redis_state(self, available: bool, reason: str) -> None:
        """Log each change of Redis state once; pending hits wait for the next flush."""
        unflushed = self.table.unflushed_hits()
        if available:
            log.info("redis_recovered", mode="sync", unflushed_hits=unflushed)
            self.settlement.returned(self._sequence, unflushed > 0)
            self._wake.set()
        else:
            self._drop_logged = False  # log the next drop again: once per outage
            self.returns.outage()
            log.warning("redis_unavailable", mode="sync", reason=reason, failure_mode=self.failure_mode)

    def _on_shard(self, up: bool, slots: frozenset[int]) -> None:
        """In Cluster, a master's slots are back: what is unflushed now is to settle (docs/redis.md)."""
        if up:
            self.settlement.returned(self._sequence, self.table.unflushed_hits() > 0)
            self._wake.set()

    # -------------------------------------------------------------- the decision

    async def check(self, checks: Sequence[Check], now: float, budget: float | None = None) -> Decision:
        """Decide locally when safe, else escalate to one atomic Redis call, waiting the
        caller's ``budget`` at most ``redis_timeout`` (:func:`~sidecar.limiter.budget.redis_wait`).

        While Redis is known to be down, the failure mode decides everything, so
        ``closed`` really refuses and ``local`` really enforces the safe share.
        An ``overload: suppress`` draw comes first: a check it refused is decided against
        :data:`~.suppression.SUPPRESSED_LIMIT` (refused locally, as a certain refusal is).
        """
        drawn = self.suppression.refused(checks, [check.limit for check in checks], now)
        if drawn is not None:
            checks = lowered_where(checks, drawn)
        counters = [self.table.counter(check, now) for check in checks]
        try:
            if not all(counter.remembered for counter in counters):
                await self._wait_for_room(checks, counters, now)
            decision = await self._decide(checks, counters, now, budget)
        finally:
            for counter in counters:
                counter.busy -= 1
        if drawn is not None:
            decision = decision._replace(suppressed=drawn)
        banned = False
        for index, (check, over) in enumerate(zip(checks, decision.over, strict=True)):
            if check.ban_seconds:
                banned = True
                if over and not (drawn and drawn[index]):  # a draw is no full window: no ban
                    self._ban(check, now)
        if banned:
            ends = tuple(self._bans.until(counter.ban_key) if counter.ban_key else 0.0 for counter in counters)
            return decision._replace(ban_ends=ends)
        return decision

    async def _decide(
        self, checks: Sequence[Check], counters: Sequence[WindowCounter], now: float, budget: float | None
    ) -> Decision:
        # A counter whose key holds no counter in Redis (its flushes are refused) is the
        # failure mode's to decide, as it would be with Redis away.
        if not self.store.available:
            return self._decide_without_redis(checks, counters, now, "redis_down")
        if self.store.corrupt.any_of(counter.key for counter in counters):
            return self._decide_without_redis(checks, counters, now, "corrupt_key")
        held = self.replicas.returning or self.replicas.holds(counter.key for counter in counters)
        if self.returns.held(held, self._sequence, counters) and self.failure_mode == "local":
            own = self.returns.with_doubt(self._would_be(checks, counters, own=True, now=now), counters)
            if (limits := held_to_shares(checks, own, self.replicas.live, self.admit_all)) is not None:
                return self._apply(checks, counters, own, limits)
        decision = self._decide_locally(checks, counters, now)
        if decision is not None:
            self.local_decisions += 1
            return decision
        return await self._escalate_in_time(checks, counters, now, budget)

    async def _escalate_in_time(
        self, checks: Sequence[Check], counters: Sequence[WindowCounter], now: float, budget: float | None
    ) -> Decision:
        """Escalate within the caller's budget; the failure mode decides what Redis cannot in time."""
        wait, limit, deadline = redis_wait(self.redis_timeout, budget)
        if wait <= 0:  # no time left to ask, though Redis may be answering: no guess near the limit
            return self._decide_without_redis(checks, counters, now, "deadline", late=True)
        reason: Reason
        try:
            escalation = self._escalate(checks, counters, wait, limit)
            return await (escalation if self.redis_waits is None else self.redis_waits.on_path(escalation))
        except TimeoutError as error:
            caller = deadline or (budget is not None and isinstance(error, DeadlineReached))
            return self._decide_without_redis(
                checks, counters, now, "deadline" if caller else "redis_timeout", in_doubt=True, late=True
            )
        except CorruptKey:
            reason = "corrupt_key"
        except RedisUnavailable as error:
            reason = unavailable_reason(error, self.store, [counter.key for counter in counters])
        return self._decide_without_redis(checks, counters, now, reason)

    def _ban(self, check: Check, now: float) -> None:
        """A counter with ``ban_duration`` went over: refuse it here at once, and tell the
        other replicas with the next flush (an escalation's script sets the ban itself)."""
        key = ban_key(self.prefix, counter_digest(check.key))
        if self._bans.active(key, now):
            return
        until = math.ceil(now + check.ban_seconds)
        self._bans.ban(key, until, now)
        self._ban_outbox[key] = until

    def _decide_locally(
        self, checks: Sequence[Check], counters: Sequence[WindowCounter], now: float
    ) -> Decision | None:
        """A decision from local knowledge, or None when Redis must be asked.

        A sliding window counts like a fixed one plus its previous window's weighted
        total, so the same reserve and blind cap apply to the estimate; while that total
        is unknown, Redis decides.
        """
        replicas = self.replicas.live
        for counter in counters:
            if counter.previous_key is not None and counter.previous is None:
                return None
        counts = self._would_be(checks, counters, now=now)
        limits = tuple(check.limit for check in checks)
        spent: dict[int, int] = {}
        """Per counter, the hits this request puts on it up to this check: a counter named
        twice holds both checks' hits unflushed, and the blind cap bounds their sum."""
        for check, counter, count in zip(checks, counters, counts, strict=True):
            if not counter.remembered:
                return None  # nothing would flush hits admitted here: only Redis may admit them
            blind = spent.get(id(counter), 0) + check.hits
            spent[id(counter)] = blind
            if count > check.limit:
                continue  # certain: our own knowledge already leaves no room
            cap = self.blind_cap(check.limit, replicas)
            if counter.unflushed + blind > cap or count + counter.reserve(cap, replicas) > check.limit:
                return None
        return self._apply(checks, counters, counts, limits)

    async def _escalate(
        self, checks: Sequence[Check], counters: Sequence[WindowCounter], wait: float, limit: float
    ) -> Decision:
        """One atomic script, sent with every other escalation of this loop iteration.

        Our pending hits are not sent: the script sees each limit lowered by what we
        hold unflushed, which gives the same verdict without sending hits that a
        timed-out call might deliver twice. If the answer comes after the budget, the
        request was answered by the failure mode; :meth:`_late_answer` then corrects
        our pending hits so every admitted hit is counted exactly once.
        """
        self.escalations += 1
        held: list[int] = []
        parts: list[int] = []
        adjusted: list[Check] = []

        def lowered() -> list[Check]:
            # Called when the batch is sent, holding the flush lock: none of our flushes is
            # on the wire, so Redis holds none of our unflushed hits (computed earlier, a
            # flush could deliver them before the script runs and they would count twice).
            # Only our own hits: the script adds earlier checks of the same counter itself.
            held[:] = [counter.unflushed for counter in counters]
            known = [self._previous_part(check, counter) for check, counter in zip(checks, counters, strict=True)]
            parts[:] = [part or 0 for part in known]
            adjusted[:] = [
                lowered_check(check, own, part) for check, own, part in zip(checks, held, known, strict=True)
            ]
            return adjusted

        settled = self._doubt(checks, counters)
        abandoned = False
        try:
            counts = await self.batcher.decide(
                [counter.key for counter in counters],
                lowered,
                [counter.expire_at for counter in counters],
                wait,
                lambda late: self._late_answer(checks, counters, adjusted, late),
                limit=limit,
                on_settled=settled,
            )
        except TimeoutError:
            abandoned = True  # still on the wire: the batcher calls settled() when it ends
            raise
        finally:
            if not abandoned:
                settled()
        admitted, over, consume = self._learn(checks, counters, adjusted, counts)
        self._escalated(checks, counters, consume)
        if isinstance(counts, Counts) and counts.ban_ends:
            self._learn_ban_ends(counters, counts.ban_ends)
        totals = tuple(count + own + part for count, own, part in zip(counts, held, parts, strict=True))
        return Decision(admitted, over, totals, tuple(check.limit for check in checks))

    def _previous_part(self, check: Check, counter: WindowCounter, now: float | None = None) -> int | None:
        """What a sliding window's previous window adds to its estimate (0 for other
        algorithms); None while the previous total is unknown."""
        if counter.previous_key is None:
            return 0
        if counter.previous is None:
            return None
        weight = previous_weight(self.clock() if now is None else now, check.unit_seconds)
        return sliding_part(counter.previous, weight)

    def _escalated(self, checks: Sequence[Check], counters: Sequence[WindowCounter], consume: Sequence[bool]) -> None:
        """Hits an answered-in-time escalation admitted are this replica's own hits too."""
        for check, counter, spent in zip(checks, counters, consume, strict=True):
            if spent:
                counter.own += check.hits

    def _learn(
        self,
        checks: Sequence[Check],
        counters: Sequence[WindowCounter],
        adjusted: Sequence[Check],
        counts: Sequence[int],
    ) -> tuple[bool, tuple[bool, ...], tuple[bool, ...]]:
        """Update ``known`` from a script's answer; returns the script's ``decide`` verdict."""
        verdict = script_verdict(adjusted, counts, [check.limit for check in adjusted], self.admit_all)
        for check, counter, count, spent in zip(adjusted, counters, counts, verdict[2], strict=True):
            if check.algorithm is Algorithm.SLIDING_WINDOW:
                continue  # an estimate, not the window's count: the next flush reads the count
            counter.known = max(counter.known, count if spent else count - check.hits)
        return verdict

    @staticmethod
    def _doubt(checks: Sequence[Check], counters: Sequence[WindowCounter]) -> Callable[[], None]:
        """An escalation goes on the wire: its hits are in doubt until the returned function is called."""
        for check, counter in zip(checks, counters, strict=True):
            counter.doubt += check.hits

        def settled() -> None:
            for check, counter in zip(checks, counters, strict=True):
                counter.doubt -= check.hits

        return settled

    def _late_answer(
        self,
        checks: Sequence[Check],
        counters: Sequence[WindowCounter],
        adjusted: Sequence[Check],
        counts: list[int],
    ) -> None:
        """The script ran after we answered from the failure mode: undo the double count.

        Redis already holds the hits the script consumed, so they come off our pending
        hits (possibly below zero: the next flush then subtracts them in Redis). Hits
        the failure mode admitted are counted once either way; hits it refused are not
        counted at all.
        """
        _, _, consume = self._learn(checks, counters, adjusted, counts)
        for check, counter, spent in zip(checks, counters, consume, strict=True):
            if spent:
                counter.pending -= check.hits

    # -------------------------------------------------------------- without Redis

    def _decide_without_redis(
        self,
        checks: Sequence[Check],
        counters: Sequence[WindowCounter],
        now: float,
        reason: Reason,
        *,
        in_doubt: bool = False,
        late: bool = False,
    ) -> Decision:
        """Redis did not decide (``reason``): the failure mode decides
        (:func:`~sidecar.limiter.failure.sync_failure_limits`); admitted hits stay pending.

        ``in_doubt``: this request's own escalation is still on the wire (its hits are not
        counted twice). ``late``: it escalated and ran out of time to hear the answer; that
        matters only while Redis is not known to be down (the others still admit through
        it), and a late answer that admitted gives its hits back (:meth:`_late_answer`).
        """
        self.failure_decisions += 1
        self.reasons.note(reason)
        local = self.failure_mode == "local"
        own = self._would_be(checks, counters, own=local, now=now)
        known = self._would_be(checks, counters, now=now) if local else own
        doubt = [
            counter.doubt - (check.hits if in_doubt else 0) for check, counter in zip(checks, counters, strict=True)
        ]
        counts, limits = sync_failure_limits(
            self.failure_mode,
            checks,
            own=own,
            known=known,
            doubt=doubt,
            remembered=[counter.remembered for counter in counters],
            live=self.replicas.live,
            late=late and self.store.available,
        )
        return self._apply(checks, counters, counts, limits)

    def _drop(self, hits: int) -> None:
        """Hits admitted on a counter that could not be remembered: counted, logged once per outage."""
        self.dropped_hits += hits
        if not self._drop_logged:
            self._drop_logged = True
            log.error(
                "failure_hits_dropped",
                mode="sync",
                failure_mode=self.failure_mode,
                max_counters=self.max_counters,
                hint="every counter holds hits Redis lacks: new counters are not remembered until Redis is back",
            )

    def _apply(
        self,
        checks: Sequence[Check],
        counters: Sequence[WindowCounter],
        counts: tuple[int, ...],
        limits: tuple[int, ...],
    ) -> Decision:
        """Run the shared admission rule and record admitted hits as pending."""
        admitted, over, consume = decide(checks, counts, limits, self.admit_all)
        if admitted or True in consume:  # refused: only count_past_limit checks consume
            for check, counter, spend in zip(checks, counters, consume, strict=True):
                if spend and check.hits and not counter.remembered:
                    self._drop(check.hits)
                elif spend and check.hits:
                    counter.pending += check.hits
                    counter.own += check.hits
                    if counter.pending * 2 >= self.blind_cap(check.limit, self.replicas.live):
                        self._wake.set()
        return Decision(admitted, over, counts, tuple(max(0, limit) for limit in limits))

    def _would_be(
        self, checks: Sequence[Check], counters: Sequence[WindowCounter], own: bool = False, now: float = 0.0
    ) -> tuple[int, ...]:
        """Per check, what this replica knows is admitted (``own``: what it admitted
        itself) plus this request's hits (earlier checks of the same counter included,
        so a counter named twice is not admitted twice); a sliding window adds its
        previous window's weighted total (not to ``own``: the safe share is per window)."""
        extra: dict[int, int] = {}
        values = []
        for check, counter in zip(checks, counters, strict=True):
            before = extra.get(id(counter), 0)
            if counter.ban_key is not None and self._bans.active(counter.ban_key, now):
                values.append(check.limit + max(1, check.hits))  # banned: over whatever it holds
                continue
            base = counter.own if own else counter.known + counter.unflushed
            if counter.previous_key is not None and not own:
                base += self._previous_part(check, counter, now) or 0
            values.append(base + before + check.hits)
            extra[id(counter)] = before + check.hits
        return tuple(values)

    def blind_cap(self, limit: int, replicas: int) -> int:
        """``Q`` at this limiter's ``--sync-max-overshoot`` (:func:`~sidecar.limiter.bounds.blind_cap`)."""
        return blind_cap(self.max_overshoot, limit, replicas)

    # ------------------------------------------------------------ local counters

    @property
    def live_counters(self) -> int:
        """Counters currently tracked."""
        return self.table.live_counters

    @property
    def evictions(self) -> int:
        """Counters forgotten at ``max_counters`` (:class:`~sidecar.limiter.sync_table.CounterTable`)."""
        return self.table.evictions

    @property
    def expired_hits(self) -> int:
        """Unflushed hits forgotten with their counter after its Redis key expired."""
        return self.table.expired_hits

    def snapshot(self) -> LimiterSnapshot:
        return self.store.snapshot(
            counters=self.table.live_counters,
            evictions=self.table.evictions,
            replicas=self.replicas.live,
            pending_hits=self.table.unflushed_hits(),
            flush_seconds=self.flush_seconds,
            flush_keys=self.flush_keys,
            failure_reasons=self.reasons.copy(),
        )

    async def _wait_for_room(self, checks: Sequence[Check], counters: list[WindowCounter], now: float) -> None:
        """At the cap with every counter holding hits Redis lacks, while Redis answers: flush now.

        The counters whose hits land can then be forgotten, so the request's new counters
        are remembered (replaced in ``counters``) and it is decided as below the cap, its
        hits kept for Redis, and the cap holds. Not remembering them would leave the
        request to an escalation within the request budget, and a flood would be refused
        by the failure mode whenever those time out. Requests waiting for room share one
        flush; others may take the room it makes, so this goes on while flushes deliver
        hits, for at most the background timeout, then the request is decided as before
        (escalated, or the failure mode's while Redis is away).
        """
        deadline = time.monotonic() + self.store.background_timeout
        while self.store.available and time.monotonic() < deadline:
            delivered = self._flushes_delivered
            if self._room_flush is None or self._room_flush.done():
                self._room_flush = asyncio.create_task(self._flush_once(), name="sync-room-flush")
            await asyncio.shield(self._room_flush)
            for index, (check, counter) in enumerate(zip(checks, counters, strict=True)):
                counters[index] = self.table.remembered(check, counter, now)
            if all(counter.remembered for counter in counters) or self._flushes_delivered == delivered:
                return  # room, or no flush delivered a hit: no counter became forgettable

    async def _flush_once(self) -> None:
        try:
            await self.sync_once()
        except Exception:
            log.exception("sync_failed")

    # ------------------------------------------------------------------- syncing

    async def _sync_loop(self) -> None:
        """Flush every ``sync_interval``, or sooner when a blind cap is half used."""
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.sync_interval)
            self._wake.clear()
            try:
                await self.sync_once()
            except Exception:
                log.exception("sync_failed")
                await asyncio.sleep(self.sync_interval)

    async def sync_once(self) -> None:
        """Send pending hits, read back totals of active counters. Flushes not acknowledged go
        first, as they were (same sequence: ``flush_once.lua`` adds nothing twice); in Cluster
        one that landed on some masters keeps only its failed keys (:class:`PartialFlush`) and
        newer flushes go on for the other counters (:func:`held_back`)."""
        async with self._flush_lock:
            self.table.expire(self.clock())
            for batch in list(self._unacknowledged.values()):
                if not await self._send(batch):
                    return
            self._sequence += 1
            bans, self._ban_outbox = self._ban_outbox, {}
            attempts = attempt_flush(self.suppression, self.prefix, self.clock())
            batch = FlushBatch({}, [], self._sequence, bans, attempts)
            prepare_flush(self.table.all_counters(), held_back(self._unacknowledged.values(), self.store), batch)
            if not batch.sent and not batch.reads and not batch.bans and batch.attempts is None:
                self.settlement.landed(min(self._unacknowledged, default=batch.sequence + 1) - 1)  # all landed
                return
            await self._send(batch)

    async def _send(self, batch: FlushBatch) -> bool:
        """One flush; False if Redis failed it whole (it stays to be sent again as it is)."""
        adds, reads = batch.adds_and_reads()
        once = (self.replicas.replica_id, batch.sequence)
        self.flush_keys.observe(len(adds) + len(reads))
        started = time.perf_counter()
        self._unacknowledged[batch.sequence] = batch  # until acknowledged, even if cancelled on the wire
        try:
            flush = self.store.flush(adds, reads, once=once, live_since=self.replicas.alive_since, bans=batch.bans)
            totals = await (flush if self.redis_waits is None else self.redis_waits.flush(len(adds), flush))
        except PartialFlush as error:  # some keys failed: in Cluster, a master is down
            landed, self._unacknowledged[batch.sequence] = batch.split(error.failed)
            self._landed(landed, error.totals)
            return getattr(self.store, "nodes", None) is not None  # plain Redis: its one call failed whole
        except RedisUnavailable:
            return False  # the adds may or may not have landed: sent again, as they are
        del self._unacknowledged[batch.sequence]
        self.settlement.landed(min(self._unacknowledged, default=batch.sequence + 1) - 1)
        self.flush_seconds.observe(time.perf_counter() - started)
        self._landed(batch, totals)
        return True

    def _landed(self, batch: FlushBatch, totals: dict[str, int]) -> None:
        """What a flush read back: the live count, the totals, the bans, the attempts."""
        live = totals.pop(self.store.replicas_key, None)
        if live is not None:
            self.replicas.observe(live)
        self._apply_flush(batch, totals)
        self._learn_bans(batch, totals)
        if batch.attempts is not None:
            batch.attempts.learn(totals)

    def _learn_bans(self, batch: FlushBatch, totals: dict[str, int]) -> None:
        """Take on the bans other replicas (or escalations) wrote: a ban key holds its end time."""
        counters = batch.counters()
        self._learn_ban_ends(counters, [totals.get(counter.ban_key or "", 0) for counter in counters])

    def _learn_ban_ends(self, counters: Sequence[WindowCounter], ends: Sequence[float]) -> None:
        """Bans Redis holds (read by a flush, or answered by an escalation) are refused here too."""
        now = self.clock()
        for counter, until in zip(counters, ends, strict=True):
            if counter.ban_key is not None and until > now:
                self._bans.ban(counter.ban_key, until, now)

    def _apply_flush(self, batch: FlushBatch, totals: dict[str, int]) -> None:
        """Learn the global totals; the growth we did not cause feeds the reserve."""
        if batch.sent:
            self.table.flush_landed()  # counters whose hits landed can be forgotten again
            self._flushes_delivered += 1
        learn_totals(batch, totals)
