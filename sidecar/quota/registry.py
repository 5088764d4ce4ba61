"""Live buckets per stream: what each was assigned, when it was last pushed and used.

Bookkeeping on a clock the caller passes in (no protobuf), so TTL refreshes, idle
abandonment and the caps are tested on a fake clock. Each method that decides something
queues :class:`Action` s on the stream (:meth:`Stream.push`); the service sends them.

* **TTL.** Envoy 1.40 drops an assignment when ``assignment_time_to_live`` runs out
  (unset means at once), so every assignment carries ``ttl`` and is pushed again once
  ``ttl / 3`` has passed since it was last sent (up to :data:`REFRESH_SPREAD` sooner, so
  buckets adopted or reassigned together are not all due in the same turn): two
  refreshes may be lost before it expires.
* **Idle buckets.** Envoy never forgets a bucket by itself, and bucket ids built from
  headers are unbounded, so a bucket whose reports show no request for ``idle_abandon``
  seconds gets ``abandon_action`` and is forgotten here too. Its id is remembered for
  :data:`ABANDON_MEMORY` seconds, so a zero-usage report already on its way does not
  bring it back.
* **Caps.** At most ``max_streams`` streams, ``max_buckets_per_stream`` buckets per
  stream and ``max_buckets`` per process. A new bucket beyond a cap gets the default
  action (ALLOW_ALL) and no state; it is adopted on a later report once there is room.
  Bucket ids outside the convention, or too large to keep, are served the same
  stateless way.
* **Bounded turns.** One event loop answers every ``ShouldRateLimit`` of the pod, so
  nothing here handles more than :data:`CHUNK` items (usages of a report, due refreshes,
  re-matches of a reload, releases of a closed stream) before it yields to the loop.
  A report's reader also waits while the stream's queue is over its byte bound
  (:mod:`sidecar.quota.outbox`): the client that does not read stops being read.
"""

from __future__ import annotations

import asyncio
import heapq
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from itertools import count, islice
from typing import TYPE_CHECKING

from sidecar.config.model import RateLimitConfig
from sidecar.heap import SETTLE_EVERY
from sidecar.quota.assignments import Action, Assignment, Pool, assign, assignment_identity, default, nanos_after
from sidecar.quota.buckets import BucketIdError, BucketKey, bucket_key, parse_bucket
from sidecar.quota.outbox import MAX_QUEUED_BYTES, Outbox
from sidecar.quota.shown import RateLimitedLog, shown_id
from sidecar.quota.stats import FrozenQuota, Gauges, QuotaStats
from sidecar.quota.stream import LiveBucket, Stream
from sidecar.turns import GiveWay

if TYPE_CHECKING:
    from sidecar.quota.leases import QuotaLeases

__all__ = ["LiveBucket", "QuotaRegistry", "QuotaSettings", "RateLimitedLog", "Stream", "StreamCapError"]

ABANDON_MEMORY = 15.0
"""Seconds an abandoned id stays remembered: three of Envoy's 5 s report periods."""
MAX_KEPT_ID_CHARS = 4096
"""Bucket ids longer than this (keys and values together) are served without state."""
CHUNK = 128
"""Items handled per event-loop turn. Adopting a new bucket (parse, match, queue) is the
dearest item, ~50 us, so a chunk is ~6 ms on an idle core; with the rest that follows it
(:mod:`sidecar.turns`) a call waits about one chunk (probe p99 15 ms, max 22 ms during a
20,000-bucket reconnect)."""
REFRESH_SPREAD = 0.25
"""Refreshes come up to this fraction of ``ttl / 3`` early, spread over the buckets."""
SPREAD_SLOTS = 16
WRITE_TIMEOUT = 10.0
"""Seconds a response message may wait for a client that does not read before the stream ends."""
MAX_SHOWN_CHARS = 64 * 1024
"""``/config`` lists buckets until their ids shown add up to this many characters."""


@dataclass(frozen=True)
class QuotaSettings:
    """The ``--quota-*`` flags and what they share with the other paths."""

    ttl: int = 60
    idle_abandon: float = 120.0
    max_buckets: int = 100_000
    max_buckets_per_stream: int = 20_000
    instances: int = 1
    admit_all: bool = False
    max_streams: int = 100
    max_queued_bytes: int = MAX_QUEUED_BYTES
    write_timeout: float = WRITE_TIMEOUT

    @property
    def refresh_after(self) -> float:
        """Seconds after a push at which the assignment is pushed again (at the latest)."""
        return self.ttl / 3


class StreamCapError(Exception):
    """A new stream past ``--quota-max-streams``."""

    def __init__(self, cap: int) -> None:
        super().__init__(f"quota streams are at the cap of {cap} per process (--quota-max-streams)")


def id_chars(bucket: Mapping[str, str]) -> int:
    return sum(len(name) + len(value) for name, value in bucket.items())


class QuotaRegistry:
    """Every stream's live buckets, the caps, and the decisions to push or abandon."""

    def __init__(
        self,
        config: RateLimitConfig,
        settings: QuotaSettings,
        stats: QuotaStats | None = None,
        clock: Callable[[], float] = time.monotonic,
        leases: QuotaLeases | None = None,
        *,
        settle: Callable[[], object] = lambda: None,
    ) -> None:
        self.config = config
        self.settle = settle
        """Called after every :data:`~sidecar.heap.SETTLE_EVERY` adoptions, between two chunks:
        the server's :func:`sidecar.heap.settle` freezes the buckets made so far, so full
        collections do not walk them again."""
        self.unsettled = 0
        """Buckets adopted since the last settle."""
        self.generation = 0
        self.leases = leases
        """Shares of each limit across replicas through Redis (``--backend redis``), else None."""
        self.settings = settings
        self.stats = stats or QuotaStats()
        self.clock = clock
        self.streams: dict[int, Stream] = {}
        self.finishing = 0
        """Streams this side ended whose gRPC call is not finished: a client that does not
        read holds gRPC's buffers for it until it reads or goes, so they count to the cap."""
        self.live = 0
        self.logs = RateLimitedLog()
        self._ids = count(1)
        self._adopted = count()
        self._seq = count()
        self._reassigning: asyncio.Task[None] | None = None
        self._closing: set[asyncio.Task[None]] = set()
        self.assignments: Pool[Assignment] = Pool(assignment_identity)
        """One :class:`Assignment` object per rule and reason, shared by its buckets (what a
        full collection walks per bucket is then its :class:`LiveBucket` alone)."""

    def open(self, peer: str) -> Stream:
        """A new stream; :class:`StreamCapError` past ``max_streams``."""
        if len(self.streams) + self.finishing >= self.settings.max_streams:
            self.stats.bump(self.stats.streams_ended, "max_streams")
            raise StreamCapError(self.settings.max_streams)
        stream = Stream(next(self._ids), peer, self.clock(), pending=Outbox(self.settings.max_queued_bytes))
        self.streams[stream.id] = stream
        self.stats.streams_opened += 1
        return stream

    def call_finished(self, _call: object = None) -> None:
        """A call counted in :attr:`finishing` is over (a gRPC done callback)."""
        self.finishing -= 1

    def close(self, stream: Stream) -> None:
        """Forget a stream's buckets: Envoy reports them all again when it reconnects.

        The stream leaves at once; its buckets are released :data:`CHUNK` now and
        :data:`CHUNK` per turn after (by a task)."""
        if self.streams.pop(stream.id, None) is None:
            return
        buckets, stream.buckets = stream.buckets, {}
        outbox, stream.pending = stream.pending, Outbox(0)
        stream.due = []
        self.live -= len(buckets)
        self._release_chunk(stream, buckets, outbox)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop, so no one else to wait for: a tool or test
            while buckets or outbox:
                self._release_chunk(stream, buckets, outbox)
            return
        if buckets or outbox:
            task = loop.create_task(self._release(stream, buckets, outbox))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    def _release_chunk(self, stream: Stream, buckets: dict[BucketKey, LiveBucket], outbox: Outbox) -> None:
        for _ in range(min(CHUNK, len(buckets))):
            key, _live = buckets.popitem()
            if self.leases is not None:
                self.leases.release(stream, key, give_back=False)
        outbox.take(CHUNK)

    async def _release(self, stream: Stream, buckets: dict[BucketKey, LiveBucket], outbox: Outbox) -> None:
        give_way = GiveWay()
        while buckets or outbox:
            await give_way()
            self._release_chunk(stream, buckets, outbox)

    async def settled(self) -> None:
        """Wait for a reload's re-matching and closed streams' releases (tests, drain)."""
        while self._reassigning is not None and not self._reassigning.done():
            await asyncio.wait([self._reassigning])
        if self._closing:
            await asyncio.wait(set(self._closing))

    def frozen_stats(self) -> FrozenQuota:
        """This scrape's numbers, copied on the event loop (the text is made in a thread)."""
        return self.stats.frozen(self.gauges())

    def gauges(self) -> Gauges:
        now = self.clock()
        lags = [now - (stream.last_report_at or stream.opened_at) for stream in self.streams.values()]
        shares = self.leases.by_rule() if self.leases is not None else {}
        partition = self.leases.partition_counts() if self.leases is not None else None
        return Gauges(self.live, len(self.streams), max(lags, default=0.0), shares, partition)

    # -- reports -------------------------------------------------------------------------

    def report(self, stream: Stream, domain: str, usages: Iterator[tuple[dict[str, str], int, int]]) -> None:
        """One usage report in one pass: for callers with a few usages (simulations,
        tests); the service uses :meth:`report_in_chunks`."""
        for _ in self._report_steps(stream, domain, usages):
            pass

    async def report_in_chunks(
        self, stream: Stream, domain: str, usages: Iterator[tuple[dict[str, str], int, int]]
    ) -> None:
        """One usage report, :data:`CHUNK` usages per turn (``usages`` is read lazily, so
        ids are decoded a chunk at a time). Between chunks, and at the end, the writer is
        woken and this waits while the stream's queue is over its bound (backpressure)."""
        give_way = GiveWay()
        for _ in self._report_steps(stream, domain, usages):
            await self._between_chunks(stream, give_way)

    def _report_steps(
        self, stream: Stream, domain: str, usages: Iterator[tuple[dict[str, str], int, int]]
    ) -> Iterator[None]:
        """Adopt new buckets, count usage, queue assignments for new ones; yields after
        each :data:`CHUNK` usages (the next chunk is not decoded before), and stops if the
        stream was closed meanwhile."""
        now = self.clock()
        stream.last_report_at = now
        stream.domain = domain[:256]
        self.stats.reports += 1
        while chunk := list(islice(usages, CHUNK)):
            for bucket, allowed, denied in chunk:
                self._usage(stream, bucket, allowed, denied, now)
            if self.unsettled >= SETTLE_EVERY:
                self.unsettled = 0
                self.settle()
            yield
            if stream.id not in self.streams:
                return
            now = self.clock()

    @staticmethod
    async def _between_chunks(stream: Stream, give_way: GiveWay) -> None:
        if stream.pending:
            stream.notify()
        await give_way()
        await stream.pending.room.wait()

    def _usage(self, stream: Stream, bucket: dict[str, str], allowed: int, denied: int, now: float) -> None:
        key = bucket_key(bucket)
        live = stream.buckets.get(key)
        if live is None:
            if allowed == denied == 0 and key in stream.abandoned:
                return
            adopted = self._adopt(stream, key, bucket, now)
            if isinstance(adopted, Assignment):  # served without state: count its usage all the same
                self.stats.usage(adopted.rule, adopted.why, allowed, denied)
                return
            live = adopted
        if allowed or denied:
            live.used_at = now
            live.allowed += allowed
            live.denied += denied
        if self.leases is not None:
            self.leases.usage(key, allowed, denied)
        self.stats.usage(live.assignment.rule, live.assignment.why, allowed, denied)

    def _adopt(self, stream: Stream, key: BucketKey, bucket: dict[str, str], now: float) -> LiveBucket | Assignment:
        """State for a bucket seen for the first time, or just the assignment sent when it is
        served without state."""
        assignment = self.assignment_of(bucket, now)
        cap = self._cap_reached(stream, bucket)
        if cap is not None or assignment.why.startswith("bad_id"):
            if cap is not None:
                self.stats.bump(self.stats.overflow, cap)
                self.logs.every("quota_bucket_overflow", now, cap=cap, peer=stream.peer, live=self.live)
                assignment = default("overflow") if cap != "id_size" else assignment
            stream.push(Action(bucket, assignment), key)
            return assignment
        live = LiveBucket(
            bucket, assignment, now, now, refresh_every=self._refresh_period(), generation=self.generation
        )
        if self.leases is not None:
            live.assignment = assignment = self.leases.adopt(stream, key, live, assignment)
        stream.buckets[key] = live
        stream.abandoned.pop(key, None)
        self.live += 1
        self.unsettled += 1
        self._schedule(stream, key, live)
        stream.push(Action(bucket, assignment), key)
        return live

    def _refresh_period(self) -> float:
        """``ttl / 3``, less up to :data:`REFRESH_SPREAD` of it by adoption order (the
        first bucket gets the whole period), so refreshes do not all fall in one turn."""
        slot = next(self._adopted) % SPREAD_SLOTS
        return self.settings.refresh_after * (1 - REFRESH_SPREAD * slot / SPREAD_SLOTS)

    def _cap_reached(self, stream: Stream, bucket: Mapping[str, str]) -> str | None:
        if len(stream.buckets) >= self.settings.max_buckets_per_stream:
            return "stream"
        if self.live >= self.settings.max_buckets:
            return "process"
        if id_chars(bucket) > MAX_KEPT_ID_CHARS:
            return "id_size"
        return None

    def assignment_of(self, bucket: Mapping[str, str], now: float) -> Assignment:
        """The assignment of a bucket id under the current config (the default when unmatched)."""
        try:
            parsed = parse_bucket(bucket)
        except BucketIdError as error:
            self.stats.bump(self.stats.unmatched, error.reason)
            self.logs.once("quota_bucket_id_refused", error.reason, detail=error.detail)
            return self.assignments.shared(default("bad_id:" + error.reason))
        assignment = assign(self.config, parsed, self.settings.instances, self.settings.admit_all)
        if assignment.rule is None:
            self.stats.bump(self.stats.unmatched, assignment.why)
            self.logs.once("quota_bucket_unmatched", assignment.why, domain=parsed.domain[:64])
        return self.assignments.shared(assignment)

    # -- refreshes and idle buckets ------------------------------------------------------

    def _next_look(self, live: LiveBucket) -> float:
        return min(live.sent_at + live.refresh_every, live.used_at + self.settings.idle_abandon)

    def _schedule(self, stream: Stream, key: BucketKey, live: LiveBucket) -> None:
        heapq.heappush(stream.due, (self._next_look(live), next(self._seq), key))

    def maintain(self, stream: Stream) -> None:
        """Queue the TTL refreshes and idle abandons that are due, in one pass: for callers
        with a few buckets (simulations, tests); the service uses :meth:`maintain_in_chunks`."""
        for _ in self._maintain_steps(stream):
            pass

    async def maintain_in_chunks(self, stream: Stream) -> None:
        """Queue the TTL refreshes and idle abandons that are due, :data:`CHUNK` per turn."""
        give_way = GiveWay()
        for _ in self._maintain_steps(stream):
            await give_way()

    def _maintain_steps(self, stream: Stream) -> Iterator[None]:
        """Only buckets whose time has come are looked at (a heap ordered by it); an entry
        found early (the bucket was used or pushed since) is put back at its new time.
        Yields every :data:`CHUNK` buckets looked at or abandoned ids forgotten."""
        now = self.clock()
        handled = 0
        while stream.due and stream.due[0][0] <= now:
            if handled == CHUNK:
                yield
                if stream.id not in self.streams:
                    return
                handled = 0
            _, _, key = heapq.heappop(stream.due)
            live = stream.buckets.get(key)
            if live is not None:
                self._look(stream, key, live, now)
            handled += 1
        if len(stream.abandoned) > self.settings.max_buckets_per_stream:
            stream.abandoned, stream.abandon_order = {}, deque()  # bounded memory wins over a few re-adopted buckets
        order = stream.abandon_order
        while order and now - order[0][0] >= ABANDON_MEMORY:
            if handled == CHUNK:
                yield
                handled = 0
                continue
            when, key = order.popleft()
            if stream.abandoned.get(key) == when:
                del stream.abandoned[key]
            handled += 1

    def _look(self, stream: Stream, key: BucketKey, live: LiveBucket, now: float) -> None:
        if now - live.used_at >= self.settings.idle_abandon:
            del stream.buckets[key]
            if self.leases is not None:
                self.leases.release(stream, key, give_back=True)
            self.live -= 1
            stream.abandon(key, now)
            stream.push(Action(live.bucket_id, None), key)
            self.stats.bump(self.stats.abandoned, "idle")
            return
        if now - live.sent_at >= live.refresh_every:
            live.sent_at = now
            stream.push(Action(live.bucket_id, live.assignment, live.nanos), key)
        self._schedule(stream, key, live)

    # -- reloads -------------------------------------------------------------------------

    def reassign(self, config: RateLimitConfig) -> None:
        """A new config: every live bucket of every stream gets its assignment again.

        New buckets are matched under ``config`` from now on; the live ones are
        re-matched :data:`CHUNK` per turn by a task. A reload that comes while one is
        still running replaces it: the newest config wins, and a bucket already matched
        under it (adopted meanwhile) is not matched again."""
        self.config = config
        self.generation += 1
        self.assignments.clear()
        if self._reassigning is not None:
            self._reassigning.cancel()
        self._reassigning = asyncio.get_running_loop().create_task(self._rematch(self.generation))

    async def _rematch(self, generation: int) -> None:
        matched: dict[BucketKey, Assignment] = {}  # the same id on several streams is matched once
        give_way = GiveWay()
        for stream in list(self.streams.values()):
            keys = list(stream.buckets)  # a copy of pointers; the matching is chunked
            for start in range(0, len(keys), CHUNK):
                if generation != self.generation:
                    return
                self._rematch_chunk(stream, keys[start : start + CHUNK], matched, generation)
                stream.notify()
                await give_way()

    def _rematch_chunk(
        self, stream: Stream, keys: list[BucketKey], matched: dict[BucketKey, Assignment], generation: int
    ) -> None:
        now = self.clock()
        for key in keys:
            live = stream.buckets.get(key)
            if live is None or live.generation == generation:
                continue
            new = matched.get(key)
            if new is None:
                new = matched[key] = self.assignment_of(live.bucket_id, now)
            if self.leases is not None:
                new = self.leases.rebase(key, new) or new
            live.nanos = nanos_after(live.assignment, new, live.nanos)
            live.assignment = new
            live.generation = generation
            live.sent_at = now
            stream.push(Action(live.bucket_id, new, live.nanos), key)

    # -- /config -------------------------------------------------------------------------

    def describe(self, limit: int = 1000) -> dict[str, object]:
        """Live buckets and their assignments for ``/config``: at most ``limit`` listed,
        each id cut (:func:`~sidecar.quota.shown.shown_id`), and listing stops once the
        ids shown reach :data:`MAX_SHOWN_CHARS`."""
        now = self.clock()
        shown: list[dict[str, object]] = []
        chars = 0
        for stream in self.streams.values():
            for live in stream.buckets.values():
                if len(shown) >= limit or chars >= MAX_SHOWN_CHARS:
                    break
                bucket_id, used = shown_id(live.bucket_id)
                chars += used
                shown.append(
                    {
                        "stream": stream.id,
                        "bucket_id": bucket_id,
                        "assignment": live.assignment.describe(),
                        "seconds_since_push": round(now - live.sent_at, 1),
                        "seconds_since_use": round(now - live.used_at, 1),
                        "allowed": live.allowed,
                        "denied": live.denied,
                    }
                )
        return {
            "settings": {
                "ttl_seconds": self.settings.ttl,
                "refresh_after_seconds": self.settings.refresh_after,
                "idle_abandon_seconds": self.settings.idle_abandon,
                "max_buckets": self.settings.max_buckets,
                "max_buckets_per_stream": self.settings.max_buckets_per_stream,
                "max_streams": self.settings.max_streams,
                "max_queued_bytes": self.settings.max_queued_bytes,
                "write_timeout_seconds": self.settings.write_timeout,
            },
            "streams": [
                {"id": s.id, "peer": s.peer[:128], "domain": s.domain[:128], "buckets": len(s.buckets)}
                for s in self.streams.values()
            ],
            "live_buckets": self.live,
            "buckets": shown,
            "buckets_not_shown": max(0, self.live - len(shown)),
        }
