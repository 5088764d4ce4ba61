"""``strict`` mode: every request is decided by Redis in one atomic script call.

This is the envoyproxy/ratelimit design, made all-or-nothing: ``decide.lua`` reads
every counter of the request, applies :func:`protocol.decide` and adds the hits only
if the request is admitted, so the Redis counters equal the admitted hits and no
replica can overshoot a limit while Redis answers within the budget
(``--redis-timeout``). The script calls of one event-loop iteration share one
pipelined round trip (:class:`DecisionBatcher`); each request is still its own
atomic script and waits only its own budget.

A request that only windows Redis has already reported full would refuse is refused
without a round trip (:class:`~sidecar.limiter.full_windows.FullWindows`): Redis
would refuse it too and record nothing, so this stays exact, and in a burst or a flood
the requests over the limit (most of them) neither wait for Redis nor risk their
deadline.

When Redis does not answer in time, the request is decided by the failure policy,
and the accounting is made exact afterwards. The script usually still runs, so the
hits the failure policy admitted for it are held, not owed, until its answer comes
(:meth:`StrictLimiter._late_answer`): then Redis is owed the admitted hits minus the
hits the script consumed. Hits both admitted and consumed are thus never sent again,
hits the script consumed for a refused request are given back, and admitted hits the
script did not consume are sent. If no answer comes (the call failed, or nothing
arrives within twice the background timeout), the admitted hits are owed as they
are (:meth:`StrictLimiter._give_up`), and an answer arriving after all still
corrects them. Owed hits and corrections are entries of one ledger per counter,
merged by addition and sent as ``INCRBY`` (negative for give-backs), so a correction
is exact whether what it corrects is still owed, on the wire, or already in Redis.
A token bucket's ledger entries are ``hits * interval`` on its ``:tat`` key (see
:mod:`sidecar.limiter.failure` for what that approximates).

Sliding windows, token buckets and bans are decided by the same script (see
``lua/decide.lua``). Its clock is Redis ``TIME`` by default, so every replica charges
and refills token buckets on one clock; ``redis_time=False`` makes it use each
request's ``now`` instead (tests drive it with chosen times, as they drive the memory
backend).

Owed hits are never sent inside a request's script: a request on a counter whose
owed hits Redis may not hold yet waits (within its budget) until the reconciler's
flush has landed, so its decision sees them; the flush is idempotent
(``flush_once.lua``, one sequence number per flush), so a flush whose reply is lost
is retried as is and counted once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import structlog

from sidecar.limiter.algorithms import Algorithm, now_us
from sidecar.limiter.budget import FailureReasons, Reason, redis_wait
from sidecar.limiter.failure import FailurePolicy, Settlement
from sidecar.limiter.full_windows import FullWindows
from sidecar.limiter.hooks import RedisWaits
from sidecar.limiter.known_counts import redis_holds
from sidecar.limiter.ledger import Admitted
from sidecar.limiter.protocol import Check, Decision
from sidecar.limiter.redis.availability import RedisUnavailable, flush_until, stop_task
from sidecar.limiter.redis.batcher import DeadlineReached, DecisionBatcher
from sidecar.limiter.redis.cluster_health import ShardUnavailable, unavailable_reason
from sidecar.limiter.redis.flush_calls import PartialFlush
from sidecar.limiter.redis.keys import check_window, per_hit, previous_window
from sidecar.limiter.redis.replicas import Replicas
from sidecar.limiter.redis.store import CorruptKey, Counts, RedisStore
from sidecar.limiter.redis.store import verdict as script_verdict
from sidecar.limiter.suppression import Suppression, lowered_where
from sidecar.limiter.sync_counters import AttemptFlush, attempt_call
from sidecar.metrics import LimiterSnapshot

log = structlog.get_logger(__name__)

LATE: tuple[Reason, ...] = ("deadline", "redis_timeout")
"""Reasons that say nothing against Redis: the request's own budget ran out."""
RECONCILE_RETRY = 0.1
"""Seconds between two failed reconciliations while Redis still counts as available."""


@dataclass(slots=True, eq=False)
class RedisCall:
    """One request's script call, kept so a late answer can correct the accounting."""

    keys: Sequence[str]
    checks: Sequence[Check]
    expire_ats: Sequence[int]
    now_us: int = 0
    """The script's clock (0: Redis ``TIME``)."""
    abandoned: bool = False
    """The request stopped waiting while the call was on the wire: it may still run."""
    spent: tuple[int, ...] = ()
    """Per check, hits the failure policy admitted for the request (when abandoned)."""
    owed: list[int] = field(default_factory=list)
    """Per check, hits owed to Redis so far on account of this request."""
    held: bool = False
    """Its keys are held in the failure policy until the script's fate is known."""
    timer: asyncio.TimerHandle | None = None
    attempts: AttemptFlush | None = None
    """``overload: suppress``: attempted hits the script adds, whatever it decides."""


@dataclass(slots=True)
class OwedFlush:
    """Owed hits sent (or to be sent again) as one idempotent flush."""

    adds: Admitted
    sequence: int


class StrictLimiter:
    """Limiter backend for ``--backend redis --mode strict``."""

    takes_budget = True
    """The service passes each call's budget (its gRPC deadline less a margin) to :meth:`check`."""

    def __init__(
        self,
        store: RedisStore,
        replicas: Replicas,
        policy: FailurePolicy,
        *,
        prefix: str = "rls",
        admit_all: bool = False,
        redis_time: bool = True,
        suppression_seed: int | None = None,
    ) -> None:
        self.store = store
        self.replicas = replicas
        self.policy = policy
        self.ledger = policy.ledger
        """Hits owed to Redis (the failure policy's ledger; corrections go there too)."""
        self.prefix = prefix
        self.admit_all = admit_all
        self.redis_time = redis_time
        """The script's clock is Redis ``TIME`` (else each request's ``now``)."""
        self.batcher = DecisionBatcher(store, admit_all)
        self.full = FullWindows(0 if getattr(store, "cluster", False) else policy.max_counters)
        """Windows Redis reported full: requests that only they refuse are refused here
        (not in Cluster, where a cross-slot request's give-backs may lower a count)."""
        self.suppression = Suppression(policy.max_counters, seed=suppression_seed, sharing="call")
        """``overload: suppress``: attempted hits, added by each request's own script call."""
        self.redis_decisions = 0
        self.reasons = FailureReasons()
        """Requests the failure policy decided, by why (``deadline``, ``redis_down``, ...)."""
        self._reconciler: asyncio.Task[None] | None = None
        self._reconcile_lock = asyncio.Lock()
        self._sequence = 0
        self._unacknowledged: dict[int, OwedFlush] = {}
        """Flushes whose reply was lost, by sequence number: each sent again, as is, before
        anything newer (in Cluster, only the keys a partial flush failed are kept)."""
        self._held: set[RedisCall] = set()
        """Abandoned calls whose answer (or failure) has not come yet."""
        self.redis_waits: RedisWaits | None = None
        """Wraps each script call and flush when tracing is on (:mod:`sidecar.limiter.hooks`)."""
        self.settlement = Settlement()
        """Whether the hits owed at Redis's last return have landed: until then this
        replica does not rejoin the heartbeats (:meth:`Replicas.follow_outages`)."""
        store.add_listener(policy.on_redis_state)
        store.add_listener(self._on_redis_state)
        if (nodes := getattr(store, "nodes", None)) is not None:  # a master's return is settled alike
            nodes.add_shard_listener(lambda up, _: self._on_redis_state(up, "a master returned"))

    async def start(self) -> None:
        """Connect (or start probing), join the replica set, start reconciling."""
        self.replicas.follow_outages(self.settlement.settled, shards=True)
        await self.store.start()
        await self.replicas.start()
        self._reconciler = asyncio.get_running_loop().create_task(self._reconcile_forever(), name="strict-reconcile")

    def _on_redis_state(self, available: bool, reason: str) -> None:
        """Redis (or in Cluster, one master's slots) is back: what is owed now (or on a flush
        not acknowledged) is to settle."""
        if available:
            self.settlement.returned(self._sequence, self.ledger.owes())

    # -- deciding --------------------------------------------------------------------

    async def check(self, checks: Sequence[Check], now: float, budget: float | None = None) -> Decision:
        """One script call within the budget; the failure policy when Redis cannot answer.

        The wait is the caller's ``budget`` (its deadline less a margin), at most
        ``--redis-timeout`` (:func:`~sidecar.limiter.budget.redis_wait`). An ``overload:
        suppress`` draw comes first: a check it refused goes to the script against
        :data:`~sidecar.limiter.suppression.SUPPRESSED_LIMIT` (and no ban: a draw is no
        full window), and the script adds the request's attempted hits whatever it decides.
        """
        if not checks:
            return Decision(True, (), (), ())
        for check in checks:
            if check.suppress:
                break
        else:
            return await self._check(checks, now, budget, None)
        drawn = self.suppression.refused(checks, [check.limit for check in checks], now)
        attempts = attempt_call(self.suppression, self.prefix, checks, now)
        lowered = lowered_where(checks, drawn, unbanned=True, drawn_once=True)
        decision = await self._check(lowered, now, budget, attempts)
        return decision if drawn is None else decision._replace(suppressed=drawn)

    async def _check(
        self, checks: Sequence[Check], now: float, budget: float | None, attempts: AttemptFlush | None
    ) -> Decision:
        """:meth:`check` once drawn; ``attempts`` bypass the full-window shortcut (Redis
        must count them, or the others would see less demand than there is)."""
        windows = [check_window(self.prefix, check, now) for check in checks]
        keys = [key for key, _ in windows]
        expire_ats = [expires for _, expires in windows]
        call = RedisCall(keys, checks, expire_ats, 0 if self.redis_time else now_us(now), attempts=attempts)
        available = self.store.available
        if available and attempts is None and (refused := self.full.refusal(checks, keys, self.admit_all)) is not None:
            return refused  # Redis would refuse it too, recording nothing
        returning = available and (self.replicas.returning or self.replicas.holds(keys))
        if returning and (refused := self.policy.beyond_share(checks, keys, expire_ats, now)) is not None:
            return refused  # a peer may still hold outage hits Redis lacks: this replica keeps its share
        if returning:
            self.policy.on_wire(checks, keys, 1)
        try:
            return await self._decide(call, now, budget, available)
        finally:
            if returning:
                self.policy.on_wire(checks, keys, -1)

    async def _decide(self, call: RedisCall, now: float, budget: float | None, available: bool) -> Decision:
        """Redis's decision within the budget, else the failure policy's."""
        checks, keys, expire_ats = call.checks, call.keys, call.expire_ats
        wait, limit, deadline = redis_wait(self.store.redis_timeout, budget)
        reason: Reason = "redis_down"
        if available and wait <= 0:
            reason = "deadline"  # nothing left to wait with: the answer is due now
        elif available:
            try:
                asked = self._ask(call, wait, limit)
                counts = await (asked if self.redis_waits is None else self.redis_waits.on_path(asked))
            except (TimeoutError, RedisUnavailable) as error:
                caller = deadline or (budget is not None and isinstance(error, DeadlineReached))
                reason = self._reason(error, caller, keys)
                if call.abandoned:
                    self.reasons.note(reason)
                    # Same step as the timeout, so before any late answer can be applied.
                    decision, call.spent = self.policy.check_without_owing(
                        checks, keys, expire_ats, now, late=self._late(reason)
                    )
                    self._hold(call)
                    return decision
            else:
                return self._redis_decision(call, counts, now)
        self.reasons.note(reason)
        return self.policy.check(checks, keys, expire_ats, now, late=self._late(reason))

    def _late(self, reason: Reason) -> bool:
        """Redis is up, only this request's time ran out: no share near a limit (issue 17)."""
        return reason in LATE and self.store.available

    def _reason(self, error: Exception, deadline: bool, keys: Sequence[str]) -> Reason:
        """Why Redis did not decide a request that asked it."""
        if isinstance(error, TimeoutError):
            return "deadline" if deadline else "redis_timeout"
        if isinstance(error, CorruptKey):
            return "corrupt_key"
        return unavailable_reason(error, self.store, keys)

    async def _ask(self, call: RedisCall, budget: float, limit: float) -> list[int]:
        """The script's would-be counts, within the request budget.

        A counter with hits owed to Redis (or on their way, or held), or a sliding
        window whose previous window has some, is asked only once they have landed, so
        the script counts them. Raises ``TimeoutError`` or
        :class:`RedisUnavailable`; ``call.abandoned`` then says whether the call is
        still on the wire, in which case its answer reaches :meth:`_late_answer`.
        Either wait running out counts as a Redis timeout, so a stalled Redis is soon
        marked unavailable and not waited on (once its silence is not our loop's lag).
        """
        try:
            watched = [*call.keys, *read_keys(call)]
            if not self.ledger.settled(watched):
                self._fail_if_down(watched)  # else it would wait its budget for a flush that cannot land
                loop = asyncio.get_running_loop()
                started = loop.time()
                async with asyncio.timeout(budget):
                    await self.ledger.wait_settled(watched)
                budget -= loop.time() - started
                limit -= loop.time() - started
                if budget <= 0:
                    raise TimeoutError
                self._fail_if_down(watched)
            call.abandoned = True  # until the batcher answers: its timeout leaves the call on the wire
            known = self.policy.known
            known.in_doubt(call.checks, call.keys, 1)  # Redis may admit its hits any moment
            try:
                counts = await self.batcher.decide(
                    call.keys,
                    call.checks,
                    call.expire_ats,
                    budget,
                    lambda counts: self._late_answer(call, counts),
                    now_us=call.now_us,
                    limit=limit,
                    on_settled=lambda: known.in_doubt(call.checks, call.keys, -1),
                    adds=call.attempts.adds() if call.attempts is not None else None,
                )
            except TimeoutError:
                raise  # still on the wire: the batcher ends the doubt when the call ends
            except BaseException:
                known.in_doubt(call.checks, call.keys, -1)
                raise
            known.in_doubt(call.checks, call.keys, -1)
        except TimeoutError:
            self.store.note_redis_timeout()
            raise
        except RedisUnavailable:
            call.abandoned = False  # the batch failed: nothing more will come of it
            raise
        call.abandoned = False
        if call.attempts is not None:
            call.attempts.learn(getattr(counts, "totals", {}))
        return counts

    def _fail_if_down(self, keys: Sequence[str]) -> None:
        """Raise :class:`ShardUnavailable` when Redis, or in Cluster the master of one of
        ``keys``, is known down: hits owed to them cannot land until it is back, so a request
        waiting for them would only spend its budget (the failure mode decides it now)."""
        why = self.store.unavailable_for(keys)
        if why is not None:
            raise ShardUnavailable(f"owed hits cannot land: {why}")

    def _redis_decision(self, call: RedisCall, counts: list[int], now: float) -> Decision:
        checks = call.checks
        limits = tuple(check.limit for check in checks)
        admitted, over, consume = script_verdict(checks, counts, limits, self.admit_all)
        self.redis_decisions += 1
        self.policy.note_admitted(checks, consume, now)
        self.policy.learn(checks, call.keys, call.expire_ats, counts, consume, now=now)
        if self.ledger.settled(call.keys):  # else a give-back on its way may lower a count
            self.full.learn(redis_holds(checks, call.keys, call.expire_ats, counts, consume), now=now)
        ban_ends = counts.ban_ends if isinstance(counts, Counts) else ()
        return Decision(admitted, over, tuple(counts), limits, ban_ends)

    def _hold(self, call: RedisCall) -> None:
        """The request was answered by the failure policy while its script may still run."""
        call.owed = [0] * len(call.checks)
        call.held = True
        self.ledger.hold(call.keys)
        self._held.add(call)
        call.timer = asyncio.get_running_loop().call_later(2 * self.store.background_timeout, self._give_up, call)

    def _late_answer(self, call: RedisCall, counts: list[int]) -> None:
        """The script ran after the failure policy answered: owe exactly what Redis lacks.

        Redis holds the hits the script consumed; the request was admitted for
        ``call.spent``. Per check, Redis is owed the difference, less what was owed for
        this request already (by :meth:`_give_up`): negative when the script consumed
        hits the failure policy refused, which gives them back.
        """
        _, _, consume = script_verdict(call.checks, counts, [check.limit for check in call.checks], self.admit_all)
        if call.attempts is not None:
            call.attempts.learn(getattr(counts, "totals", {}))
        self.policy.learn(call.checks, call.keys, call.expire_ats, counts, consume, now=time.time())
        self._unhold(call)
        self._owe_for(call, [check.hits if spent else 0 for check, spent in zip(call.checks, consume, strict=True)])

    def _give_up(self, call: RedisCall) -> None:
        """No answer came (the batch failed, or is too late to wait for): owe the admitted hits.

        If the script did run after all, Redis counts those hits twice (errs towards
        rejecting) unless its answer still arrives, which :meth:`_late_answer` corrects.
        """
        if call.held:
            self._unhold(call)
            self._owe_for(call, [0] * len(call.checks))

    def _unhold(self, call: RedisCall) -> None:
        if call.held:
            call.held = False
            self.ledger.release(call.keys)
            self._held.discard(call)
            if call.timer is not None:
                call.timer.cancel()

    def _owe_for(self, call: RedisCall, consumed: Sequence[int]) -> None:
        """Make what is owed for ``call`` equal to its admitted hits minus ``consumed``."""
        for index, (check, key, deadline, spent, script) in enumerate(
            zip(call.checks, call.keys, call.expire_ats, call.spent, consumed, strict=True)
        ):
            change = spent - script - call.owed[index]
            if change < 0:
                self.full.forget(key)  # a give-back lowers the count Redis reported
            if change and self.ledger.owe(key, change, deadline, per_hit(check)):
                call.owed[index] += change

    # -- reconciling -------------------------------------------------------------------

    async def reconcile(self) -> bool:
        """Send owed hits and give-backs to Redis; False if some could not land (they are kept).

        A flush whose reply is lost may or may not have landed: it is sent again with
        the same sequence number (and nothing newer goes first), and ``flush_once.lua``
        adds it only if the first attempt did not. In Cluster, a flush that landed on
        some masters only (:class:`PartialFlush`) keeps just its failed keys to send again,
        and newer flushes of the other keys go on meanwhile (the marker is per key, so only
        one key's flushes must land in order): hits owed on healthy masters do not wait
        for a dead one's failover, nor do requests on them (:meth:`_ask`).
        """
        async with self._reconcile_lock:
            for unacknowledged in list(self._unacknowledged.values()):
                if not await self._send(unacknowledged):
                    return False
            flush, held_back = self._next_flush()
            if flush is not None and not await self._send(flush):
                return False
            return not self._unacknowledged and not held_back

    def _next_flush(self) -> tuple[OwedFlush | None, bool]:
        """What is owed, numbered; and whether some was held back: keys of a flush still to be
        resent (their next add must not land before it), and keys of a master known down
        (their flush would fail at once; sent once it is back, under a newer number)."""
        owed = self.ledger.drain_admitted()
        blocked = {key for flush in self._unacknowledged.values() for key in flush.adds}
        nodes = getattr(self.store, "nodes", None)  # a simulated store has none
        down = nodes is not None and bool(nodes.down())
        held = {
            key: add for key, add in owed.items() if key in blocked or (down and self.store.unavailable_for((key,)))
        }
        if held:
            self.ledger.restore(held)
            owed = {key: add for key, add in owed.items() if key not in held}
        if not owed:
            return None, bool(held)
        self._sequence += 1
        return OwedFlush(owed, self._sequence), bool(held)

    async def _send(self, flush: OwedFlush) -> bool:
        """One idempotent flush; until Redis acknowledges it (even if cancelled), it stays to be
        resent. False if Redis failed it whole; True if it landed, or landed on some masters."""
        self._unacknowledged[flush.sequence] = flush
        try:
            sent = self.store.flush(flush.adds, once=(self.replicas.replica_id, flush.sequence))
            totals = await (sent if self.redis_waits is None else self.redis_waits.flush(len(flush.adds), sent))
        except PartialFlush as error:
            return self._partly_landed(flush, error)
        except RedisUnavailable:
            return False
        del self._unacknowledged[flush.sequence]
        self.settlement.landed(min(self._unacknowledged, default=self._sequence + 1) - 1)
        self.ledger.settle(flush.adds)
        refused = [key for key in flush.adds if key not in totals]
        if refused:  # keys holding no counter: the store logs each (rate-limited) and counts the hits
            log.debug("owed_hits_refused", keys=len(refused), hits=sum(flush.adds[key][0] for key in refused))
        return True

    def _partly_landed(self, flush: OwedFlush, error: PartialFlush) -> bool:
        """Some keys failed: in Cluster their master is down (True: the others' flushes may go
        on), on plain Redis the one call failed (False, as a whole failure). The keys that
        landed are settled now (requests on them ask Redis again at once); the failed ones
        stay to be sent again under the same number, so one whose add did land after all
        adds nothing the second time (in Cluster, ``flush_once.lua``'s marker is per key)."""
        failed = set(error.failed)
        landed = {key: add for key, add in flush.adds.items() if key not in failed}
        if landed:
            self.ledger.settle(landed)
            rest = {key: add for key, add in flush.adds.items() if key in failed}
            self._unacknowledged[flush.sequence] = OwedFlush(rest, flush.sequence)
        return getattr(self.store, "nodes", None) is not None

    def snapshot(self) -> LimiterSnapshot:
        local = self.policy.local_snapshot()
        return self.store.snapshot(
            counters=local.counters,
            evictions=local.evictions,
            replicas=self.replicas.live,
            pending_hits=self.unreconciled_hits(),
            failure_reasons=self.reasons.copy(),
            full_window_refusals=self.full.refusals,
        )

    def unreconciled_hits(self) -> int:
        """Admitted hits Redis may not hold yet: owed, held, or in a flush not acknowledged."""
        unsent = sum(self.ledger.hits_in(flush.adds) for flush in self._unacknowledged.values())
        held = sum(sum(call.spent) for call in self._held)
        return self.ledger.owed_hits + unsent + held

    async def close(self, deadline: float | None = None) -> None:
        """Apply late answers, leave the replica set, send what is still owed, close.

        While Redis does not answer, the last flush probes it again every 100 ms until
        ``deadline`` (``time.monotonic()``: what the shutdown grace left); what is still
        owed then is lost, and logged as an error with its count (``admitted_hits_lost``).
        """
        if self._reconciler is not None:
            await stop_task(self._reconciler)
        await asyncio.sleep(0)  # a batch queued in this iteration is sent in the next one
        await self.batcher.drain()  # late answers correct the ledger before the last flush
        for call in list(self._held):
            self._give_up(call)  # its batch failed: no answer will come
        await self.replicas.close()
        await flush_until(self._last_flush, self._flushed, deadline, self.store.background_timeout)
        unreconciled = self.unreconciled_hits()
        if unreconciled:
            log.error(
                "admitted_hits_lost",
                mode="strict",
                hits=unreconciled,
                reason=self.store.last_error,
                hint="Redis did not take the last flush within --shutdown-grace; these hits are not in its counters",
            )
        (log.warning if unreconciled else log.info)(
            "strict_closed",
            redis_decisions=self.redis_decisions,
            full_window_refusals=self.full.refusals,
            failure_decisions=self.policy.decisions,
            failure_reasons={reason: count for reason, count in self.reasons.counts.items() if count},
            late_answers=self.batcher.late_answers,
            unreconciled_hits=unreconciled,
            unreturned_hits=self.ledger.owed_give_backs,
            dropped_hits=self.ledger.dropped_hits,
            redis_round_trips_request_path=self.store.round_trips_request_path,
            redis_round_trips_background=self.store.round_trips_background,
        )
        await self.store.close()

    def _flushed(self) -> bool:
        return not self.ledger.owes() and not self._unacknowledged

    async def _last_flush(self) -> None:
        """One attempt of the last flush: probe Redis if it is down, then send what is owed."""
        if await self.store.probe():
            while not self._flushed() and await self.reconcile():
                pass

    async def _reconcile_forever(self) -> None:
        """Whenever hits are owed and Redis is available, flush them."""
        while True:
            if not self._unacknowledged:
                await self.ledger.wait_owed()
            await self.store.wait_available()
            if not await self.reconcile():
                # Usually the failed flush marked Redis unavailable and the next wait blocks;
                # the pause keeps a failure that does not do so from spinning this loop.
                await asyncio.sleep(RECONCILE_RETRY)


def read_keys(call: RedisCall) -> list[str]:
    """Keys the script reads besides the ones it may write: sliding windows' previous windows.

    Hits owed to a previous window change a sliding estimate, so a request waits for
    them to land as it waits for its own counters' (bans are never owed).
    """
    return [
        previous_window(key, check.unit_seconds)[0]
        for key, check in zip(call.keys, call.checks, strict=True)
        if check.algorithm is Algorithm.SLIDING_WINDOW
    ]
