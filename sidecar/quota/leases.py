"""Quota buckets shared across replicas through Redis: demand out, leased shares in.

With ``--backend redis`` every sidecar publishes, per bucket, its Envoy's demand (allowed +
denied per second, from the 5 s usage reports) and picks up a leased share of the limit
computed by max-min fair share (:mod:`sidecar.quota.shares`, run in Redis by
``lua/share.lua``). One :class:`QuotaLeases` per process:

* **One round trip per batch.** A report marks its buckets due and wakes the sync task,
  which sends one ``share.lua`` call per due bucket, all pipelined (chunks of
  :data:`BATCH`); between reports only buckets whose shares are still moving are polled
  (every :data:`POLL_SECONDS`), and buckets that get less than they ask (a replica whose
  share may grow as soon as another gives capacity back); leases are renewed by every report.
* **Push at once.** A share that changes is pushed to every stream holding the bucket
  right away (the stream's loop is woken), not at the next report.
* **Leases and Envoy's TTL.** A share is leased for ``ttl + LEASE_MARGIN`` seconds from the
  call; it is pushed (and refreshed) only while at least ``ttl`` of its lease is left, so
  Envoy stops enforcing it by the time the lease ends in Redis, when it may be handed on.
* **Redis down.** Shares are kept while the lease allows (above), then every bucket gets
  the safe capacity ``ceil(limit / live replicas)``, and, until the other replicas' leases
  have surely ended (one lease after the first failed call), never more than they leave
  (``capacity - others`` of the last reply): a dead replica's lease is not handed out
  again. The live count is the highest seen within the last lease, so heartbeats that
  stop (a dead replica) or arrive late (after a pause) do not raise the safe capacity
  before the leases they stood for have ended. The next successful call rebuilds the
  lease. Calls fail fast while Redis is known to be down (``Availability``).
* **Windows.** A limit of a minute or more is a budget per window: the replicas' admitted
  requests are added to a per-window counter, shares are of what is left, and a share is
  assigned as ``max_tokens = share`` refilled over what is left of the window.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from importlib import resources
from typing import TYPE_CHECKING, Any, Protocol

import structlog

from sidecar.limiter.algorithms import Algorithm
from sidecar.limiter.redis.scripts import Script
from sidecar.quota.assignments import MAX_TOKENS, MIN_FILL_SECONDS, Action, Assignment, Kind, fill_of, nanos_after
from sidecar.quota.buckets import BucketKey
from sidecar.quota.shares import LEAVE, POLL, Call, Reply, safe_capacity

if TYPE_CHECKING:
    from sidecar.limiter.redis.replicas import Replicas
    from sidecar.limiter.redis.store import RedisStore
    from sidecar.quota.registry import LiveBucket, Stream

log = structlog.get_logger(__name__)

REPORT_SECONDS = 5.0
"""Envoy 1.40 reports every 5 s whatever ``reporting_interval`` says."""
LEASE_MARGIN = 2 * REPORT_SECONDS
"""A lease outlives Envoy's assignment TTL by two reports: the reports renew it in time."""
STALE_SECONDS = 3 * REPORT_SECONDS
"""A replica whose demand was not published for this long asks for nothing (and the
bucket's master holds its role this long after its last call)."""
POLL_SECONDS = 1.0
"""Between reports, buckets whose shares are still moving are asked again this often."""
TICK = 0.25
BATCH = 1000
"""Bucket calls per pipeline."""
HEADROOM = 0.1
"""Demand published = measured x (1 + HEADROOM), at least 1: room to grow before the next report."""
WINDOW_BUDGET_SECONDS = 60
"""Windows of at least this length are budgets (shares of what is left), shorter ones rates."""


def load_share_script() -> Script:
    source = resources.files("sidecar.quota").joinpath("lua", "share.lua").read_text(encoding="utf-8")
    return Script("share.lua", source, hashlib.sha1(source.encode("utf-8"), usedforsecurity=False).hexdigest())


SHARE = load_share_script()


def bucket_digest(key: BucketKey) -> str:
    """A fixed-length name for a bucket id (length-prefixed items, BLAKE2b 128 bits)."""
    digest = hashlib.blake2b(digest_size=16)
    for name, value in key:
        for part in (name, value):
            data = part.encode("utf-8")
            digest.update(len(data).to_bytes(4, "big") + data)
    return digest.hexdigest()


def share_keys(prefix: str, key: BucketKey, window: int) -> list[str]:
    """``KEYS`` of ``share.lua``: the replicas hash, the meta hash, the window counter.

    All carry the bucket's hash tag, so one bucket's keys live in one Cluster slot."""
    tag = f"{prefix}:quota:{{{bucket_digest(key)}}}"
    meta = f"{tag}:meta"
    return [f"{tag}:replicas", meta, f"{tag}:used:{window}" if window >= 0 else meta]


@dataclass(frozen=True, slots=True)
class Shape:
    """How a rule's assignment is shared: ``limit`` units per ``seconds``."""

    limit: int
    seconds: int
    burst: int
    windowed: bool
    token_bucket: bool

    @classmethod
    def of(cls, base: Assignment) -> Shape | None:
        """The shape of a full-limit token-bucket assignment; None when it is not shared."""
        if base.kind is not Kind.TOKEN_BUCKET or base.rule is None:
            return None
        token_bucket = base.rule.algorithm is Algorithm.TOKEN_BUCKET and base.why != "several_limits"
        seconds = base.fill_seconds
        return cls(
            limit=base.tokens_per_fill,
            seconds=seconds,
            burst=base.max_tokens,
            windowed=not token_bucket and seconds >= WINDOW_BUDGET_SECONDS,
            token_bucket=token_bucket,
        )

    def assignment(self, base: Assignment, units: int, now_wall: float) -> Assignment:
        """The assignment of a share of ``units``."""
        if units <= 0:
            return Assignment(Kind.DENY_ALL, "shared_zero", base.rule)
        units = min(units, MAX_TOKENS)
        if self.windowed:
            left = self.seconds - int(now_wall) % self.seconds
            return Assignment(Kind.TOKEN_BUCKET, "shared_window", base.rule, units, units, max(MIN_FILL_SECONDS, left))
        if self.token_bucket:
            burst = max(1, self.burst * units // max(1, self.limit))
            tokens, seconds = fill_of(Fraction(units, self.seconds))
            return Assignment(Kind.TOKEN_BUCKET, "shared", base.rule, min(burst, MAX_TOKENS), tokens, seconds)
        return Assignment(Kind.TOKEN_BUCKET, "shared", base.rule, units, units, max(MIN_FILL_SECONDS, self.seconds))

    def window(self, now_wall: float) -> int:
        return int(now_wall) // self.seconds * self.seconds if self.windowed else -1

    def demand(self, rate: float, now_wall: float) -> int:
        """Units wanted for ``rate`` requests per second: per fill interval, or (windowed)
        for what is left of the window."""
        span = self.seconds - int(now_wall) % self.seconds if self.windowed else self.seconds
        wanted = max(1, math.ceil(rate * span * (1 + HEADROOM)))
        return min(wanted, self.limit) if self.windowed else wanted


class ShareBackend(Protocol):
    """Runs ``share.lua`` calls: Redis (:class:`RedisShares`) or the simulation's fake."""

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def run(self, calls: Sequence[tuple[list[str], Call]]) -> list[Reply]: ...


class SharesUnavailable(Exception):  # noqa: N818 - a state, as RedisUnavailable
    """The share calls could not run (Redis down, slow or refusing)."""


class RedisShares:
    """``share.lua`` over a :class:`~sidecar.limiter.redis.store.RedisStore`: one pipeline per batch."""

    def __init__(self, store: RedisStore, replicas: Replicas | None = None) -> None:
        self.store = store
        self.replicas = replicas
        """Heartbeats of the quota replicas: the live count for the safe capacity."""
        self.round_trips = 0

    async def start(self) -> None:
        await self.store.start()
        if self.replicas is not None:
            await self.replicas.start()

    async def close(self) -> None:
        if self.replicas is not None:
            await self.replicas.close()
        await self.store.close()

    async def run(self, calls: Sequence[tuple[list[str], Call]]) -> list[Reply]:
        from sidecar.limiter.redis.availability import FAILURES, RedisUnavailable  # noqa: PLC0415 - lazy

        store = self.store
        try:
            store.availability.ensure_available()
        except RedisUnavailable as error:
            raise SharesUnavailable(str(error)) from None
        try:
            replies = await self._pipeline(calls, with_body=False)
            missing = [index for index, reply in enumerate(replies) if _noscript(reply)]
            if missing:
                again = await self._pipeline([calls[index] for index in missing], with_body=True)
                for index, reply in zip(missing, again, strict=True):
                    replies[index] = reply
        except FAILURES as error:
            raise SharesUnavailable(str(store.availability.failed(error, request_path=False))) from error
        store.availability.answered()
        failure = next((reply for reply in replies if isinstance(reply, BaseException)), None)
        if failure is not None:
            raise SharesUnavailable(str(store.availability.failed(failure, request_path=False)))
        return [_reply(reply) for reply in replies]

    async def _pipeline(self, calls: Sequence[tuple[list[str], Call]], with_body: bool) -> list[Any]:
        pipe = self.store.client.pipeline(transaction=False)
        for keys, call in calls:
            args = share_arguments(call)
            if with_body:
                pipe.execute_command("EVAL", SHARE.source, len(keys), *keys, *args)
            else:
                # execute_command: redis-py blocks pipe.evalsha on Cluster pipelines.
                pipe.execute_command("EVALSHA", SHARE.sha, len(keys), *keys, *args)
        self.round_trips += 1
        async with asyncio.timeout(self.store.background_timeout):
            replies: list[Any] = await pipe.execute(raise_on_error=False)
        return replies


def _noscript(reply: object) -> bool:
    from redis.exceptions import NoScriptError  # noqa: PLC0415 - lazy

    return isinstance(reply, NoScriptError)


def share_arguments(call: Call, now_ms: int = 0) -> list[int | str]:
    keep_ms = 2 * max(call.lease_ms, call.stale_ms, call.master_ms)
    return [
        call.replica, now_ms, call.demand, call.limit, call.lease_ms, call.stale_ms, call.master_ms,
        call.threshold_pct, call.min_gap_ms, call.window, call.used_add, keep_ms, keep_ms, call.master_gap_ms,
    ]  # fmt: skip


def _reply(values: Sequence[Any]) -> Reply:
    grant, replicas, unsettled, master, computed, capacity, others = (int(value) for value in values)
    return Reply(grant, replicas, bool(unsettled), bool(master), bool(computed), capacity, others)


@dataclass
class Shared:
    """One bucket as this process shares it: its holders, usage since the last call, its lease."""

    key: BucketKey
    base: Assignment
    shape: Shape
    holders: dict[int, tuple[Stream, LiveBucket]] = field(default_factory=dict)
    count: int = 0
    """Allowed + denied reported since the demand was last published."""
    allowed: int = 0
    """Allowed reported since the last call (windowed: added to the window's counter)."""
    counted_since: float = 0.0
    reported: bool = True
    grant: int | None = None
    lease_until: float = 0.0
    """Local clock: when the lease ends (the call's start + the lease)."""
    replicas: int = 0
    heard: bool = False
    """Redis answered for this bucket at least once (its capacity and others are known)."""
    capacity: int = 0
    others: int = 0
    """From the last reply: what the other replicas' leases may hold (the safe capacity leaves it)."""
    next_poll: float = math.inf
    demand: int = 0
    republish: bool = False
    """A call failed: the next one publishes the last known demand (not a poll), since the
    record's demand may have gone stale in Redis meanwhile (it would count as 0)."""


@dataclass
class ShareStats:
    calls: int = 0
    batches: int = 0
    failures: int = 0
    computed: int = 0
    pushes: int = 0
    safe: int = 0


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
    ) -> None:
        self.backend = backend
        self.prefix = prefix
        self.report_seconds = report_seconds
        self.poll = POLL_SECONDS * report_seconds / REPORT_SECONDS
        """Seconds between polls of a moving or hungry bucket, and between event-driven computations."""
        """Envoy's report period (5 s); the lease margin and the staleness follow it (tests shorten it)."""
        self.replica_id = replica_id
        self.ttl = ttl
        self.lease = ttl + 2 * report_seconds
        self.clock = clock
        self.wall = wall
        self.replicas = replicas
        self.instances = instances
        self.buckets: dict[BucketKey, Shared] = {}
        self.leaving: set[BucketKey] = set()
        self.stats = ShareStats()
        self.redis_up = True
        self.down_since: float | None = None
        """Local time of the first failed call since the last answered one: the other
        replicas' leases, renewed at most until then, have ended one lease later."""
        self.peak_live = 1
        self.peak_seen = -math.inf
        self.wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    # -- the registry's side ----------------------------------------------------------

    def adopt(self, stream: Stream, key: BucketKey, live: LiveBucket, base: Assignment) -> Assignment:
        """A stream holds a bucket: share it if its rule has a limit; returns what to push now."""
        shape = Shape.of(base)
        if shape is None:
            return base
        now = self.clock()
        shared = self.buckets.get(key)
        if shared is None:
            shared = self.buckets[key] = Shared(key, base, shape, counted_since=now - self.report_seconds)
            self.leaving.discard(key)
        shared.holders[stream.id] = (stream, live)
        shared.reported = True
        self.wake.set()
        return self.assignment_of(shared, now)

    def usage(self, key: BucketKey, allowed: int, denied: int) -> None:
        shared = self.buckets.get(key)
        if shared is not None:
            shared.count += allowed + denied
            shared.allowed += allowed
            shared.reported = True
            self.wake.set()

    def release(self, stream: Stream, key: BucketKey, *, give_back: bool) -> None:
        """A stream stopped holding a bucket: abandoned (``give_back``: Envoy erased it, so the
        lease is given back at once), or the stream closed. A closed stream proves nothing
        about its Envoy, which enforces the last assignment until its TTL (the sidecar may
        have been killed, or the connection dropped): the lease is then left to run out in
        Redis, never handed on before that."""
        shared = self.buckets.get(key)
        if shared is None or shared.holders.pop(stream.id, None) is None:
            return
        if not shared.holders:
            del self.buckets[key]
            if give_back:
                self.leaving.add(key)
                self.wake.set()

    def rebase(self, key: BucketKey, base: Assignment) -> Assignment | None:
        """A reload changed the bucket's full assignment: the share to push, or None when the
        bucket is no longer shared (the caller pushes ``base``)."""
        shared = self.buckets.get(key)
        shape = Shape.of(base)
        if shared is None or shape is None:
            return None
        shared.base, shared.shape, shared.reported = base, shape, True
        self.wake.set()
        return self.assignment_of(shared, self.clock())

    def assignment_of(self, shared: Shared, now: float) -> Assignment:
        """The share while the lease allows pushing it (``ttl`` left), else the safe capacity."""
        holders = max(1, len(shared.holders))
        return shared.shape.assignment(shared.base, self.units_of(shared, now) // holders, self.wall())

    def units_of(self, shared: Shared, now: float) -> int:
        """This replica's share of the bucket's limit now (all its streams together)."""
        if shared.grant is not None and now + self.ttl <= shared.lease_until:
            return shared.grant
        live = max(shared.replicas, self.live(now), self.instances)
        units = safe_capacity(shared.shape.limit, live)
        if shared.heard and self.down_since is not None and now < self.down_since + self.lease:
            units = min(units, max(0, shared.capacity - shared.others))  # the others' leases may still run
        return units

    def by_rule(self) -> dict[tuple[str, str], tuple[int, int]]:
        """``(domain, stat key) -> (share, demand)`` summed over this replica's shared buckets of
        each rule, in units per fill interval (for the metrics)."""
        now = self.clock()
        rows: dict[tuple[str, str], tuple[int, int]] = {}
        for shared in self.buckets.values():
            rule = shared.base.rule
            if rule is None:
                continue
            key = (rule.domain, rule.stat_key)
            share, demand = rows.get(key, (0, 0))
            rows[key] = (share + self.units_of(shared, now), demand + shared.demand)
        return rows

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

    async def close(self) -> None:
        """Stop syncing. Leases are not given back: Envoy enforces them until their TTL."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.backend.close()

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wake.wait(), TICK)
            self.wake.clear()
            try:
                await self.sync()
            except Exception:
                log.exception("quota_share_sync_failed")

    def due(self, now: float) -> list[Shared]:
        return [
            shared
            for shared in self.buckets.values()
            if shared.reported or shared.next_poll <= now or now + self.ttl + self.report_seconds > shared.lease_until
        ]

    async def sync(self) -> None:
        """One pass: every due bucket's call, in pipelines of :data:`BATCH`; then pushes."""
        now = self.clock()
        self.live(now)  # sampled every tick, so the peak is known when a fallback needs it
        wall = self.wall()
        leaving = [(key, None) for key in self.leaving]
        self.leaving = set()
        due = self.due(now)
        calls: list[tuple[list[str], Call]] = []
        for key, _ in leaving:
            calls.append((share_keys(self.prefix, key, -1), self._call(LEAVE, 0, -1, 0)))
        for shared in due:
            calls.append(
                (share_keys(self.prefix, shared.key, shared.shape.window(wall)), self._publish(shared, now, wall))
            )
        if not calls:
            return
        replies: list[Reply] = []
        try:
            for start in range(0, len(calls), BATCH):
                replies += await self.backend.run(calls[start : start + BATCH])
                self.stats.batches += 1
        except SharesUnavailable as error:
            self.stats.failures += 1
            if self.redis_up:
                log.warning("quota_shares_unavailable", reason=str(error)[:200])
            self.redis_up = False
            if self.down_since is None:
                self.down_since = now
            for (_, call), shared in zip(calls[len(leaving) :], due, strict=True):
                shared.allowed += call.used_add  # owed to the window's counter: sent with the next call
            self._fallback(now)
            return
        if not self.redis_up:
            log.info("quota_shares_available")
        self.redis_up = True
        self.down_since = None
        self.stats.calls += len(calls)
        for shared, reply in zip(due, replies[len(leaving) :], strict=True):
            self.stats.computed += reply.computed
            shared.grant = reply.grant
            shared.lease_until = now + self.lease
            shared.replicas = reply.replicas
            shared.heard, shared.capacity, shared.others = True, reply.capacity, reply.others
            shared.republish = False
            # Polled again soon while shares move, or while it gets less than it asks (it may
            # be waiting for capacity another replica gives back in a call it does not see).
            hungry = shared.demand > reply.grant
            shared.next_poll = now + self.poll if reply.unsettled or hungry else math.inf
            self._push(shared, now)

    def _call(self, demand: int, limit: int, window: int, used_add: int) -> Call:
        return Call(
            self.replica_id,
            demand,
            limit,
            lease_ms=int(self.lease * 1000),
            stale_ms=int(3 * self.report_seconds * 1000),
            master_ms=int(3 * self.report_seconds * 1000),
            master_gap_ms=int(self.report_seconds * 1000),
            min_gap_ms=int(self.poll * 1000),
            window=window,
            used_add=used_add,
        )

    def _publish(self, shared: Shared, now: float, wall: float) -> Call:
        demand = POLL
        if shared.reported:
            rate = shared.count / max(1.0, now - shared.counted_since)
            demand = shared.demand = shared.shape.demand(rate, wall)
            shared.count, shared.counted_since, shared.reported = 0, now, False
        elif shared.republish:
            demand = shared.demand
        used, shared.allowed = shared.allowed, 0
        shape = shared.shape
        return self._call(demand, shape.limit, shape.window(wall), used if shape.windowed else 0)

    def _fallback(self, now: float) -> None:
        """Redis is away: keep each share while its lease allows, then the safe capacity."""
        for shared in self.buckets.values():
            shared.reported = False  # the demand is published again with the next report ...
            shared.republish = True  # ... or, if none came by then, the last one with the next call
            if shared.grant is not None and now + self.ttl > shared.lease_until:
                shared.grant = None
                self.stats.safe += 1
            self._push(shared, now)

    def _push(self, shared: Shared, now: float) -> None:

        new = self.assignment_of(shared, now)
        for stream, live in shared.holders.values():
            if new.envoy_fields() == live.assignment.envoy_fields():
                live.assignment = new
                continue
            live.nanos = nanos_after(live.assignment, new, live.nanos)
            live.assignment = new
            live.sent_at = now
            stream.push(Action(live.bucket_id, new, live.nanos))
            self.stats.pushes += 1
            stream.notify()

    def describe(self) -> dict[str, object]:
        return {
            "replica_id": self.replica_id,
            "redis_up": self.redis_up,
            "shared_buckets": len(self.buckets),
            "lease_seconds": self.lease,
            "calls": self.stats.calls,
            "batches": self.stats.batches,
            "failures": self.stats.failures,
            "computed": self.stats.computed,
            "pushes": self.stats.pushes,
        }
