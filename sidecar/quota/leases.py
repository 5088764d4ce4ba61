"""Quota buckets shared across replicas through Redis: demand out, leased shares in.

With ``--backend redis`` every sidecar publishes, per bucket, its Envoy's demand (allowed +
denied per second, from the 5 s usage reports) and picks up a leased share of the limit
computed by max-min fair share (:mod:`sidecar.quota.shares`, run in Redis by
``lua/share.lua``). One :class:`QuotaLeases` per process:

* **Bounded work per loop turn.** A report marks its buckets ready and wakes the sync
  task, which calls ``share.lua`` for at most :data:`CHUNK` buckets per pipeline and per
  loop turn (building the calls, reading the replies, pushing what changed), yields to
  the loop between chunks, and handles at most :data:`MAX_PER_TICK` buckets per tick (the
  rest the next tick). Between reports a bucket comes back only by its timer
  (:mod:`sidecar.quota.timers`): a poll every :data:`POLL_SECONDS` while its shares move
  or it gets less than it asks, else its renewal, spread over half a report period by
  the bucket's digest so buckets adopted together do not all renew in one tick.
* **Push at once.** A share that changes is pushed to every stream holding the bucket
  right away (:meth:`Stream.push`, the stream woken), not at the next report.
* **Leases and Envoy's TTL.** A share is leased for ``ttl + LEASE_MARGIN`` seconds from the
  call; Redis keeps it reserved :attr:`QuotaLeases.hold` seconds more (the replica may be
  cut off rather than dead, and nobody can tell which).
* **Redis away, for everybody or for this replica only (the partition rule).** A
  replica keeps its last grant while ``ttl`` of its lease *and hold* are left (what
  Redis still reserves for it), then follows ``--quota-after-hold``
  (:mod:`sidecar.quota.partition`): ``deny`` assigns nothing (DENY_ALL), since the
  survivors may have taken it over by then; ``share`` enforces the safe capacity. A
  bucket that never heard from Redis starts at the safe capacity ``ceil(limit / live
  replicas)`` for as long (the live count is the highest seen within the last lease). So
  with ``deny`` what every Envoy enforces stays within the limit in every partition, with
  ``share`` within it plus the safe capacity per cut replica (the proof: docs/quota.md).
  While Redis is away no call is built but
  one probe per tick; a bucket is looked at again only when its assignment changes (its
  hold ends) or Redis is back, when every bucket is called again (the last known demand
  republished), a chunk at a time.
* **Clamps.** Every client number is clamped before it reaches arithmetic or Redis
  (:func:`sidecar.quota.shares.clamped`; the Lua clamps again). A call the script
  refuses is dropped with what it carried, counted and logged (at most once a minute):
  never retried forever.
* **A clean stop hands on.** :meth:`QuotaLeases.close` gives every lease back (a LEAVE
  call per bucket, a chunk per pipeline, within the drain's deadline), those of buckets
  whose streams already closed included: the others need not wait for the hold. A crash
  gives nothing back: the hold runs.
* **Windows.** A limit of a minute or more is a budget per window: the replicas' admitted
  requests are added to a per-window counter, shares are of what is left, and a share is
  assigned as ``max_tokens = share`` refilled over what is left of the window.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import structlog

from sidecar.quota.assignments import Action, Assignment, Pool, assignment_identity, nanos_after
from sidecar.quota.buckets import BucketKey
from sidecar.quota.partition import (
    REPORT_SECONDS,
    AfterHold,
    PartitionCounts,
    PartitionWatch,
    hold_seconds,
    lease_seconds,
)
from sidecar.quota.redis_shares import (
    CallRefused,
    ShareBackend,
    SharesUnavailable,
    bucket_tag,
    keys_of,
    share_keys,
)
from sidecar.quota.shape import MAX_COUNTED, Shape
from sidecar.quota.shared_bucket import Shared, ShareStats
from sidecar.quota.shares import LEAVE, POLL, Call, Reply, safe_capacity
from sidecar.quota.stream import LiveBucket, Stream
from sidecar.quota.timers import Timers
from sidecar.turns import GiveWay

if TYPE_CHECKING:
    from sidecar.limiter.redis.replicas import Replicas


log = structlog.get_logger(__name__)

STALE_SECONDS = 3 * REPORT_SECONDS
"""A replica whose demand was not published for this long asks for nothing (and the
bucket's master holds its role this long after its last call)."""
POLL_SECONDS = 1.0
"""Between reports, buckets whose shares are still moving are asked again this often."""
TICK = 0.25
CHUNK = 128
"""Buckets per pipeline and per loop turn (calls built, replies read, pushes). A pipeline's
replies are read and applied in one loop turn. Through redis-py's ``Pipeline`` that cost the
loop 80-140 us a bucket: with 20,000 shared buckets, pipelines of 250 held the loop 17-23 ms
(probe p99 24-33 ms with Redis up), of 128 10-14 ms (17-19 ms); of 64, 6 ms, but Redis then
fell behind the 5 s reports (``python -m loadtest.reliability --areas loop-stalls``, outage
row, runs in alternation). Packed by hand (``run_scripts(packed=True)``) a renewal costs
about 40 us a bucket, a changed share about 80 (``python -m loadtest.quota_share_cost``),
so 128 now hold a turn a few ms; kept at 128 rather than raised, since a smaller turn is
what the request path waits on, and not lowered, since Redis's pace is what 64 lacked."""
MAX_PER_TICK = 5000
"""Buckets called per tick (the rest wait for the next): 20,000 a second, the 100,000
buckets of a full process every 5 s report."""
MAX_REPORTED = 2**32
"""Allowed or denied in one report beyond this is not physically possible (860 million
requests a second for 5 s): clamped."""
REFUSAL_LOG_SECONDS = 60.0


class CallTimes(NamedTuple):
    """The durations of a ``share.lua`` call, in milliseconds (see :class:`Call`)."""

    lease_ms: int
    stale_ms: int
    master_ms: int
    master_gap_ms: int
    min_gap_ms: int
    hold_ms: int


class QuotaLeases:
    """Every shared bucket of this process and the task that syncs them with Redis."""

    def __init__(
        self,
        backend: ShareBackend,
        replica_id: str,
        ttl: int,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        replicas: Replicas | None = None,
        instances: int = 1,
        prefix: str = "rls",
        report_seconds: float = REPORT_SECONDS,
        hold: float | None = None,
        after_hold: AfterHold = "deny",
    ) -> None:
        self.backend = backend
        self.prefix = prefix
        self.report_seconds = report_seconds
        """Envoy's report period (5 s); the lease margin and the staleness follow it (tests shorten it)."""
        self.poll = POLL_SECONDS * report_seconds / REPORT_SECONDS
        """Seconds between polls of a moving or hungry bucket, and between event-driven computations."""
        self.replica_id = replica_id
        self.ttl = ttl
        self.lease = lease_seconds(ttl, report_seconds)
        self.hold = hold_seconds(ttl, hold, report_seconds)
        """Seconds past its end a lease stays reserved in Redis, and kept here without Redis."""
        self.times = CallTimes(
            lease_ms=int(self.lease * 1000),
            stale_ms=int(3 * report_seconds * 1000),
            master_ms=int(3 * report_seconds * 1000),
            master_gap_ms=int(report_seconds * 1000),
            min_gap_ms=int(self.poll * 1000),
            hold_ms=int(self.hold * 1000),
        )
        """The durations every ``share.lua`` call carries, fixed for the process."""
        self.after_hold = after_hold
        """What a bucket cut from Redis enforces once its hold ended: nothing, or the safe capacity."""
        self.clock = clock
        self.wall = wall
        self.replicas = replicas
        self.instances = instances
        self.buckets: dict[BucketKey, Shared] = {}
        self.ready: OrderedDict[BucketKey, None] = OrderedDict()
        """Buckets that need a call, oldest first."""
        self.leaving: OrderedDict[BucketKey, None] = OrderedDict()
        """Abandoned buckets whose lease is given back with the next calls."""
        self.recheck: OrderedDict[BucketKey, None] = OrderedDict()
        """While Redis is away: buckets whose assignment may have changed (their hold ended)."""
        self.kept: OrderedDict[BucketKey, float] = OrderedDict()
        """Buckets dropped with their lease left in Redis (their streams closed) -> when that
        lease and its hold end: a clean stop gives them back too."""
        self.timers: Timers[BucketKey] = Timers(TICK, clock())
        self.shapes: Pool[Shape] = Pool(lambda shape: shape)
        self.assignments: Pool[Assignment] = Pool(assignment_identity)
        """Shapes and shares shared by the buckets that have them: each object a bucket
        keeps alone is one more for every full collection to walk."""
        self.totals: dict[tuple[str, str], list[int]] = {}
        """``(domain, stat key) -> [units, demand]`` over the buckets, kept as they change."""
        self.stats = ShareStats()
        self.redis_up = True
        self.outages = 0
        self.down_since: float | None = None
        self.peak_live = 1
        self.peak_seen = -math.inf
        self.refusal_logged = -math.inf
        self.partition = PartitionWatch(after_hold, clock)
        self.wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    # -- the registry's side (each O(1)) ------------------------------------------------

    def adopt(self, stream: Stream, key: BucketKey, live: LiveBucket, base: Assignment) -> Assignment:
        """A stream holds a bucket: share it if its rule has a limit; returns what to push now."""
        shape = self._shape_of(base)
        if shape is None:
            return base
        now = self.clock()
        shared = self.buckets.get(key)
        if shared is None:
            tag = bucket_tag(self.prefix, key)
            spread = int(tag[-6:-1], 16) / 16**5
            shared = Shared(key, base, shape, tag, spread, counted_since=now - self.report_seconds)
            shared.unheard_until = now + self.lease + self.hold
            shared.outages = self.outages
            self.buckets[key] = shared
            self.leaving.pop(key, None)
            self.kept.pop(key, None)
            self.timers.put(key, self._changes_at(shared, now))  # its first call moves it, if Redis answers
        shared.holders[stream.id] = (stream, live)
        shared.reported = True
        self._make_ready(key)
        assignment = self.assignment_of(shared, now)
        self._show(shared, self.units_of(shared, now))
        return assignment

    def usage(self, key: BucketKey, allowed: int, denied: int) -> None:
        shared = self.buckets.get(key)
        if shared is not None:
            allowed = min(max(0, allowed), MAX_REPORTED)
            shared.count = min(shared.count + allowed + min(max(0, denied), MAX_REPORTED), MAX_COUNTED)
            shared.allowed = min(shared.allowed + allowed, MAX_COUNTED)
            shared.reported = True
            if self.redis_up:  # while Redis is away, a recovery makes every bucket ready
                self._make_ready(key)

    def release(self, stream: Stream, key: BucketKey, *, give_back: bool) -> None:
        """A stream stopped holding a bucket: abandoned (``give_back``: Envoy erased it, so the
        lease is given back at once), or the stream closed. A closed stream proves nothing
        about its Envoy, which enforces the last assignment until its TTL (the sidecar may
        have been killed, or the connection dropped): the lease is then left to run out in
        Redis (the bucket is remembered in :attr:`kept`), handed on only by a clean stop of
        this sidecar (:meth:`hand_on`)."""
        shared = self.buckets.get(key)
        if shared is None or shared.holders.pop(stream.id, None) is None:
            return
        if not shared.holders:
            del self.buckets[key]
            self._show(shared, 0, 0)
            self._mark(shared, held=False, past_hold=False)
            self.ready.pop(key, None)
            self.recheck.pop(key, None)
            self.timers.drop(key)
            if give_back:
                self.leaving[key] = None
                self.wake.set()
            else:
                self.kept[key] = self.clock() + self.lease + self.hold

    def rebase(self, key: BucketKey, base: Assignment) -> Assignment | None:
        """A reload changed the bucket's full assignment: the share to push, or None when the
        bucket is no longer shared (the caller pushes ``base``)."""
        shared = self.buckets.get(key)
        shape = self._shape_of(base)
        if shared is None or shape is None:
            return None
        self._show(shared, 0, 0)
        shared.base, shared.shape, shared.reported, shared.pushed = base, shape, True, None
        self._make_ready(key)
        now = self.clock()
        self._show(shared, self.units_of(shared, now))
        return self.assignment_of(shared, now)

    def _shape_of(self, base: Assignment) -> Shape | None:
        shape = Shape.of(base)
        return None if shape is None else self.shapes.shared(shape)

    def _make_ready(self, key: BucketKey) -> None:
        if key not in self.ready:
            self.ready[key] = None
        self.wake.set()

    # -- what a bucket is assigned -------------------------------------------------------

    def assignment_of(self, shared: Shared, now: float) -> Assignment:
        """This replica's units (:meth:`units_of`), split among its streams holding the bucket."""
        holders = max(1, len(shared.holders))
        units = self.units_of(shared, now) // holders
        return self.assignments.shared(shared.shape.assignment(shared.base, units, self.wall()))

    def units_of(self, shared: Shared, now: float) -> int:
        """This replica's share of the bucket's limit now (all its streams together).

        The last grant, while ``ttl`` of its lease and hold is left: Redis reserves it that
        long, whether this replica still reaches Redis or not. A bucket that never heard
        from Redis: the safe capacity, as long. After that, ``--quota-after-hold``: nothing
        (``deny``), or the safe capacity (``share``)."""
        if now <= self._hold_ends(shared):
            if shared.grant is not None:
                return min(shared.grant, shared.shape.limit)
        elif self.after_hold == "deny":
            return 0
        return safe_capacity(shared.shape.limit, max(shared.replicas, self.live(now), self.instances))

    def _hold_ends(self, shared: Shared) -> float:
        """When, with no news from Redis, its hold ends: less ``ttl``, so that an assignment
        pushed just before never outlives what Redis reserves."""
        if shared.grant is not None:
            return shared.lease_until + self.hold - self.ttl
        return shared.unheard_until - self.ttl

    def _changes_at(self, shared: Shared, now: float) -> float:
        """When its assignment next changes with no news from Redis: when its hold ends;
        never again once it ended (a past time would bring it back every tick)."""
        ends = self._hold_ends(shared)
        return ends if now <= ends else math.inf

    def _mark(self, shared: Shared, *, held: bool, past_hold: bool) -> None:
        """Keep the partition counts: held for a silent replica, past its own hold."""
        if held != shared.held:
            shared.held = held
            self.partition.held(held)
        if past_hold != shared.past_hold:
            shared.past_hold = past_hold
            if past_hold:
                self.partition.hold_ended()
            else:
                self.partition.hold_over()

    def partition_counts(self) -> PartitionCounts:
        """The partition rule's counts now (for the metrics)."""
        return self.partition.counts()

    def by_rule(self) -> dict[tuple[str, str], tuple[int, int]]:
        """``(domain, stat key) -> (share, demand)`` summed over this replica's shared buckets of
        each rule, in units per fill interval (for the metrics): kept as buckets change, so a
        scrape costs the rule count, not the bucket count."""
        return {key: (units, demand) for key, (units, demand) in self.totals.items() if units or demand}

    def _show(self, shared: Shared, units: int, demand: int | None = None) -> None:
        demand = shared.demand if demand is None else demand
        rule = shared.base.rule
        if rule is None or (units, demand) == shared.shown:
            return  # most renewals: nothing moved, no total to look up
        total = self.totals.setdefault((rule.domain, rule.stat_key), [0, 0])
        total[0] += units - shared.shown[0]
        total[1] += demand - shared.shown[1]
        shared.shown = (units, demand)

    def live(self, now: float) -> int:
        """The live replica count for the safe capacity: the highest heartbeat count seen within
        the last lease. A replica that stops beating may hold a lease for that long, and after a
        pause every beat is late for a moment: neither may raise the safe capacity."""
        count = self.replicas.live if self.replicas is not None else 1
        if count >= self.peak_live or now - self.peak_seen > self.lease:
            self.peak_live = count
        if count >= self.peak_live:
            self.peak_seen = now
        return self.peak_live

    # -- the sync task -----------------------------------------------------------------

    async def start(self) -> None:
        await self.backend.start()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="quota-leases")

    async def close(self, deadline: float | None = None) -> None:
        """Stop syncing, hand every lease on (:meth:`hand_on`, by ``deadline`` on this clock),
        and close the connections."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        try:
            await self.hand_on(deadline)
        finally:
            await self.backend.close()

    async def hand_on(self, deadline: float | None = None) -> int:
        """A clean stop: give back the lease of every bucket, those whose streams closed
        already included, so the other replicas get the capacity on their next call instead
        of after the hold. A LEAVE call per bucket, :data:`CHUNK` per pipeline, yielding
        between; it stops at ``deadline`` (or when Redis is away: what is left waits for the
        hold, as after a crash). Returns the records given back.

        Its Envoy may still enforce the last assignment until its TTL (``--quota-ttl``) if
        it outlives this sidecar: docs/quota.md says what that costs."""
        keys = [*self.buckets, *self.kept, *self.leaving]
        self.buckets.clear()
        self.kept.clear()
        self.leaving.clear()
        given = 0
        for start in range(0, len(keys), CHUNK):
            if deadline is not None and self.clock() >= deadline:
                break
            chunk = keys[start : start + CHUNK]  # live, kept and leaving are disjoint: no key twice
            leave = self._call_of(LEAVE, 0, -1, 0)
            calls = [(share_keys(self.prefix, key, -1), leave) for key in chunk]
            try:
                async with asyncio.timeout(None if deadline is None else max(0.0, deadline - self.clock())):
                    await self.backend.run(calls)
            except (SharesUnavailable, TimeoutError) as error:
                log.warning("quota_hand_on_stopped", given_back=given, left=len(keys) - start, reason=str(error)[:200])
                break
            given += len(chunk)
            await asyncio.sleep(0)  # the gRPC server has stopped: nothing to give way to
        self.partition.handed_on += given
        if given:
            log.info("quota_leases_handed_on", buckets=given)
        return given

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wake.wait(), TICK)
            self.wake.clear()
            try:
                await self.sync()
            except Exception:
                log.exception("quota_share_sync_failed")

    async def sync(self) -> None:
        """One tick: timers that came due, a probe while Redis is away, then up to
        :data:`MAX_PER_TICK` calls and rechecks, :data:`CHUNK` per loop turn."""
        now = self.clock()
        self.live(now)  # sampled every tick, so the peak is known when a safe capacity needs it
        self._forget_kept(now)
        await self._take_due(now)
        if not self.redis_up:
            await self._probe(now)
        if self.redis_up:
            await self._call_ready()
        await self._recheck_fallbacks()
        if self.ready and self.redis_up:
            self.wake.set()  # more than a tick's worth: go on at the next turn of the loop

    def _forget_kept(self, now: float) -> None:
        """Drop, oldest first and at most a chunk a tick, the kept buckets whose lease and
        hold ended: Redis has let them go already."""
        for _ in range(min(CHUNK, len(self.kept))):
            key, ends = next(iter(self.kept.items()))
            if ends > now:
                return
            del self.kept[key]

    async def _take_due(self, now: float) -> None:
        target = self.ready if self.redis_up else self.recheck
        due = self.timers.due(now)
        give_way = GiveWay()
        for start in range(0, len(due), CHUNK):
            if start:
                await give_way()
            for key in due[start : start + CHUNK]:
                if key in self.buckets and key not in target:
                    target[key] = None

    async def _probe(self, now: float) -> None:
        """Redis is away: one call a tick (it fails at once while Redis is known down), for
        a bucket that needs one, else any; when it goes through, every bucket is called again."""
        key = next(iter(self.leaving), None) or next(iter(self.ready), None) or next(iter(self.buckets), None)
        if key is None:
            return
        self.stats.probes += 1
        if await self._call([key]):
            await self._recovered()

    async def _recovered(self) -> None:
        """Redis answers again: every bucket is called (its lease rebuilt, its last demand
        republished), a chunk per loop turn, in the order they were adopted."""
        log.info("quota_shares_available", after=round(self.clock() - (self.down_since or self.clock()), 1))
        self.redis_up = True
        self.down_since = None
        self.stats.recovered += 1
        keys = list(self.buckets)  # a copy of pointers; the work on them is chunked
        give_way = GiveWay()
        for start in range(0, len(keys), CHUNK):
            await give_way()
            for key in keys[start : start + CHUNK]:
                if key in self.buckets and key not in self.ready:
                    self.ready[key] = None

    async def _call_ready(self) -> None:
        handled = 0
        give_way = GiveWay()
        while (self.leaving or self.ready) and handled < MAX_PER_TICK:
            keys = self._take(self.leaving, CHUNK)
            keys += self._take(self.ready, CHUNK - len(keys))
            handled += len(keys)
            if not await self._call(keys):
                return
            await give_way()

    @staticmethod
    def _take(queue: OrderedDict[BucketKey, None], count: int) -> list[BucketKey]:
        return [queue.popitem(last=False)[0] for _ in range(min(count, len(queue)))]

    async def _call(self, keys: list[BucketKey]) -> bool:
        """One pipeline for ``keys`` (at most :data:`CHUNK`); False when Redis is away."""
        now, wall = self.clock(), self.wall()
        calls: list[tuple[list[str], Call]] = []
        targets: list[Shared | BucketKey] = []
        buckets = self.buckets
        for key in keys:
            shared = buckets.get(key)
            if shared is None:  # given back (a bucket released without give-back leaves no key)
                calls.append((share_keys(self.prefix, key, -1), self._call_of(LEAVE, 0, -1, 0)))
                targets.append(key)
                continue
            calls.append((keys_of(shared.tag, shared.shape.window(wall)), self._publish(shared, now, wall)))
            targets.append(shared)
        try:
            replies = await self.backend.run(calls)
        except SharesUnavailable as error:
            self._outage(now, error, targets, calls)
            return False
        self.stats.batches += 1
        self.stats.calls += len(calls)
        self.redis_up = True
        for target, (_, call), reply in zip(targets, calls, replies, strict=True):
            if isinstance(reply, CallRefused):
                self._refused(target, call, reply, now)
            elif isinstance(target, Shared) and target.key in self.buckets:
                self._apply(target, reply, now)
        return True

    def _apply(self, shared: Shared, reply: Reply, now: float) -> None:
        self.stats.computed += reply.computed
        self._mark(shared, held=reply.silent > 0, past_hold=False)
        shared.grant = reply.grant
        shared.lease_until = now + self.lease
        shared.replicas = reply.replicas
        shared.outages = self.outages
        # Polled again soon while shares move, or while it gets less than it asks (it may
        # be waiting for capacity another replica gives back in a call it does not see);
        # else renewed a report period after the call, spread over the next half period.
        hungry = shared.demand > reply.grant
        if reply.unsettled or hungry:
            self.timers.put(shared.key, now + self.poll)
        else:
            self.timers.put(shared.key, now + self.report_seconds * (1 + shared.spread / 2))
        self._push(shared, now)

    def _refused(self, target: Shared | BucketKey, call: Call, reply: CallRefused, now: float) -> None:
        """The script refused this call: it would refuse it again. What it carried is dropped
        (not owed to the next call), the bucket goes on at its usual pace."""
        self.stats.refused += 1
        self.stats.dropped_used += call.used_add
        if now - self.refusal_logged >= REFUSAL_LOG_SECONDS:
            self.refusal_logged = now
            log.warning("quota_share_call_refused", reason=reply.reason, refused=self.stats.refused)
        if isinstance(target, Shared):
            self.timers.put(target.key, now + self.report_seconds)

    def _outage(
        self, now: float, error: Exception, targets: list[Shared | BucketKey], calls: list[tuple[list[str], Call]]
    ) -> None:
        """A chunk found Redis away: its buckets wait for the recovery (what they carried is
        owed to the next call, at most the limit); nothing else is built until then."""
        self.stats.failures += 1
        if self.redis_up:
            log.warning("quota_shares_unavailable", reason=str(error)[:200])
            self.redis_up = False
            self.outages += 1
            self.down_since = now
        for target, (_, call) in zip(targets, calls, strict=True):
            if isinstance(target, Shared):
                target.allowed = min(target.allowed + call.used_add, target.shape.limit)
                if target.unsent is not None:
                    count, target.counted_since, target.demand = target.unsent
                    target.count = min(target.count + count, MAX_COUNTED)
                    target.reported, target.unsent = True, None
                self.recheck[target.key] = None  # its next change is timed from here
            else:
                self.leaving[target] = None

    async def _recheck_fallbacks(self) -> None:
        """Redis is away: push what changed for the buckets whose hold ended (or that failed
        a call, or were waiting for one: a recovery makes every bucket ready anyway), and time
        each one's next change; a chunk per loop turn."""
        handled = 0
        give_way = GiveWay()
        while (self.recheck or (self.ready and not self.redis_up)) and handled < MAX_PER_TICK:
            now = self.clock()
            keys = self._take(self.recheck, CHUNK)
            if not self.redis_up:
                keys += self._take(self.ready, CHUNK - len(keys))
            for key in keys:
                shared = self.buckets.get(key)
                if shared is None:
                    continue
                if self.redis_up:
                    self._make_ready(key)
                    continue
                self._push(shared, now)
                changes_at = self._changes_at(shared, now)
                self._mark(shared, held=shared.held, past_hold=math.isinf(changes_at))
                self.timers.put(key, changes_at)
                handled += 1
            await give_way()

    def _call_of(self, demand: int, limit: int, window: int, used_add: int) -> Call:
        times = self.times
        return Call(
            self.replica_id,
            demand,
            limit,
            lease_ms=times.lease_ms,
            stale_ms=times.stale_ms,
            master_ms=times.master_ms,
            master_gap_ms=times.master_gap_ms,
            min_gap_ms=times.min_gap_ms,
            window=window,
            used_add=used_add,
            hold_ms=times.hold_ms,
        )

    def _publish(self, shared: Shared, now: float, wall: float) -> Call:
        demand = POLL
        shared.unsent = None
        if shared.reported:
            shared.unsent = (shared.count, shared.counted_since, shared.demand)
            rate = shared.count / max(1.0, now - shared.counted_since)
            demand = shared.demand = shared.shape.demand(rate, wall)
            shared.count, shared.counted_since, shared.reported = 0, now, False
        elif shared.outages != self.outages:
            demand = shared.demand  # republished: its record may have gone stale meanwhile
        shape = shared.shape
        used = min(shared.allowed, shape.limit)  # more than the limit spends the window all the same
        shared.allowed = 0
        return self._call_of(demand, shape.limit, shape.window(wall), used if shape.windowed else 0)

    def _push(self, shared: Shared, now: float) -> None:
        units = self.units_of(shared, now)
        self._show(shared, units)
        pushed = (units, len(shared.holders))
        if pushed == shared.pushed and not shared.shape.windowed:
            return  # the same assignment as last time (most renewals): nothing to build
        shared.pushed = pushed
        new = self.assignment_of(shared, now)
        for stream, live in shared.holders.values():
            if new.envoy_fields() == live.assignment.envoy_fields():
                live.assignment = new
                continue
            live.nanos = nanos_after(live.assignment, new, live.nanos)
            live.assignment = new
            live.sent_at = now
            stream.push(Action(live.bucket_id, new, live.nanos), shared.key)
            self.stats.pushes += 1
            stream.notify()

    def describe(self) -> dict[str, object]:
        """For ``/config``: counts only, the same size whatever the bucket count."""
        return {
            "replica_id": self.replica_id,
            "redis_up": self.redis_up,
            "shared_buckets": len(self.buckets),
            "ready": len(self.ready),
            "timed": len(self.timers),
            "leaving": len(self.leaving),
            "lease_seconds": self.lease,
            "hold_seconds": self.hold,
            "after_hold": self.after_hold,
            "kept": len(self.kept),
            "held_for_silent": self.partition.held_buckets,
            "past_hold": self.partition.past_hold_buckets,
            "calls": self.stats.calls,
            "batches": self.stats.batches,
            "failures": self.stats.failures,
            "refused": self.stats.refused,
            "computed": self.stats.computed,
            "pushes": self.stats.pushes,
        }
