"""Live buckets per stream: what each was assigned, when it was last pushed and used.

Pure bookkeeping on a clock the caller passes in (no asyncio, no protobuf), so TTL
refreshes, idle abandonment and the caps are tested on a fake clock. Each method that
decides something queues :class:`Action` s on the stream; the service sends them.

* **TTL.** Envoy 1.40 drops an assignment when ``assignment_time_to_live`` runs out
  (unset means at once), so every assignment carries ``ttl`` and is pushed again once
  ``ttl / 3`` has passed since it was last sent: two refreshes may be lost before it
  expires.
* **Idle buckets.** Envoy never forgets a bucket by itself, and bucket ids built from
  headers are unbounded, so a bucket whose reports show no request for ``idle_abandon``
  seconds gets ``abandon_action`` and is forgotten here too. Its id is remembered for
  :data:`ABANDON_MEMORY` seconds, so a zero-usage report already on its way does not
  bring it back.
* **Caps.** At most ``max_buckets_per_stream`` per stream and ``max_buckets`` per
  process. A new bucket beyond a cap gets the default action (ALLOW_ALL) and no state;
  it is adopted on a later report once there is room. Bucket ids outside the
  convention, or too large to keep, are served the same stateless way.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from itertools import count
from typing import TYPE_CHECKING

import structlog

from sidecar.config.model import RateLimitConfig
from sidecar.quota.assignments import Action, Assignment, assign, default, nanos_after
from sidecar.quota.buckets import BucketIdError, BucketKey, bucket_key, parse_bucket
from sidecar.quota.stats import FrozenQuota, Gauges, QuotaStats

if TYPE_CHECKING:
    from sidecar.quota.leases import QuotaLeases

log = structlog.get_logger(__name__)

ABANDON_MEMORY = 15.0
"""Seconds an abandoned id stays remembered: three of Envoy's 5 s report periods."""
MAX_KEPT_ID_CHARS = 4096
"""Bucket ids longer than this (keys and values together) are served without state."""
LOG_INTERVAL = 60.0
"""Recurring warnings (overflow, malformed input) are logged at most this often each."""


@dataclass(frozen=True)
class QuotaSettings:
    """The ``--quota-*`` flags and what they share with the other paths."""

    ttl: int = 60
    idle_abandon: float = 120.0
    max_buckets: int = 100_000
    max_buckets_per_stream: int = 20_000
    instances: int = 1
    admit_all: bool = False

    @property
    def refresh_after(self) -> float:
        """Seconds after a push at which the assignment is pushed again."""
        return self.ttl / 3


@dataclass(slots=True)
class LiveBucket:
    bucket_id: dict[str, str]
    assignment: Assignment
    sent_at: float
    used_at: float
    nanos: int = 0
    allowed: int = 0
    denied: int = 0


@dataclass
class Stream:
    """One open ``StreamRateLimitQuotas`` call."""

    id: int
    peer: str
    opened_at: float
    buckets: dict[BucketKey, LiveBucket] = field(default_factory=dict)
    abandoned: dict[BucketKey, float] = field(default_factory=dict)
    pending: list[Action] = field(default_factory=list)
    last_report_at: float | None = None
    domain: str = ""
    notify: Callable[[], None] = lambda: None
    """Called when actions were queued outside the stream's own loop (a reload)."""

    def push(self, action: Action) -> None:
        """Queue one action for the stream's writer: the one way actions are queued."""
        self.pending.append(action)


class RateLimitedLog:
    """Log each event at most once per ``interval`` (and each distinct reason once)."""

    def __init__(self, interval: float = LOG_INTERVAL) -> None:
        self.interval = interval
        self.last: dict[str, float] = {}
        self.reasons: set[str] = set()

    def every(self, event: str, now: float, **fields: object) -> None:
        if now - self.last.get(event, -self.interval) >= self.interval:
            self.last[event] = now
            log.warning(event, **fields)

    def once(self, event: str, reason: str, **fields: object) -> None:
        if reason not in self.reasons and len(self.reasons) < 1000:
            self.reasons.add(reason)
            log.warning(event, reason=reason, **fields)


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
    ) -> None:
        self.config = config
        self.leases = leases
        """Shares of each limit across replicas through Redis (``--backend redis``), else None."""
        self.settings = settings
        self.stats = stats or QuotaStats()
        self.clock = clock
        self.streams: dict[int, Stream] = {}
        self.live = 0
        self.logs = RateLimitedLog()
        self._ids = count(1)

    def open(self, peer: str) -> Stream:
        stream = Stream(next(self._ids), peer, self.clock())
        self.streams[stream.id] = stream
        self.stats.streams_opened += 1
        return stream

    def close(self, stream: Stream) -> None:
        """Forget a stream's buckets: Envoy reports them all again when it reconnects."""
        if self.streams.pop(stream.id, None) is not None:
            if self.leases is not None:
                for key in stream.buckets:
                    self.leases.release(stream, key, give_back=False)
            self.live -= len(stream.buckets)
            stream.buckets.clear()

    def frozen_stats(self) -> FrozenQuota:
        """This scrape's numbers, copied on the event loop (the text is made in a thread)."""
        return self.stats.frozen(self.gauges())

    def gauges(self) -> Gauges:
        now = self.clock()
        lags = [now - (stream.last_report_at or stream.opened_at) for stream in self.streams.values()]
        shares = self.leases.by_rule() if self.leases is not None else {}
        return Gauges(self.live, len(self.streams), max(lags, default=0.0), shares)

    def report(self, stream: Stream, domain: str, usages: Iterator[tuple[dict[str, str], int, int]]) -> None:
        """One usage report: adopt new buckets, count usage; queues assignments for new ones."""
        now = self.clock()
        stream.last_report_at = now
        stream.domain = domain[:256]
        self.stats.reports += 1
        for bucket, allowed, denied in usages:
            self._usage(stream, bucket, allowed, denied, now)

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
            stream.push(Action(bucket, assignment))
            return assignment
        live = LiveBucket(bucket, assignment, sent_at=now, used_at=now)
        if self.leases is not None:
            live.assignment = assignment = self.leases.adopt(stream, key, live, assignment)
        stream.buckets[key] = live
        stream.abandoned.pop(key, None)
        self.live += 1
        stream.push(Action(bucket, assignment))
        return live

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
            return default("bad_id:" + error.reason)
        assignment = assign(self.config, parsed, self.settings.instances, self.settings.admit_all)
        if assignment.rule is None:
            self.stats.bump(self.stats.unmatched, assignment.why)
            self.logs.once("quota_bucket_unmatched", assignment.why, domain=parsed.domain[:64])
        return assignment

    def maintain(self, stream: Stream) -> None:
        """Queue TTL refreshes and idle abandons that are due."""
        now = self.clock()
        settings = self.settings
        idle: list[BucketKey] = []
        for key, live in stream.buckets.items():
            if now - live.used_at >= settings.idle_abandon:
                idle.append(key)
            elif now - live.sent_at >= settings.refresh_after:
                live.sent_at = now
                stream.push(Action(live.bucket_id, live.assignment, live.nanos))
        for key in idle:
            live = stream.buckets.pop(key)
            if self.leases is not None:
                self.leases.release(stream, key, give_back=True)
            self.live -= 1
            stream.abandoned[key] = now
            stream.push(Action(live.bucket_id, None))
            self.stats.bump(self.stats.abandoned, "idle")
        if stream.abandoned:
            self._forget_abandoned(stream, now)

    def _forget_abandoned(self, stream: Stream, now: float) -> None:
        old = [key for key, when in stream.abandoned.items() if now - when >= ABANDON_MEMORY]
        for key in old:
            del stream.abandoned[key]
        if len(stream.abandoned) > self.settings.max_buckets_per_stream:
            stream.abandoned.clear()  # bounded memory wins over a few re-adopted buckets

    def reassign(self, config: RateLimitConfig) -> None:
        """A new config: every live bucket of every stream gets its assignment again, now."""
        self.config = config
        now = self.clock()
        for stream in self.streams.values():
            for key, live in stream.buckets.items():
                new = self.assignment_of(live.bucket_id, now)
                if self.leases is not None:
                    new = self.leases.rebase(key, new) or new
                live.nanos = nanos_after(live.assignment, new, live.nanos)
                live.assignment = new
                live.sent_at = now
                stream.push(Action(live.bucket_id, new, live.nanos))
            stream.notify()

    def describe(self, limit: int = 1000) -> dict[str, object]:
        """Live buckets and their assignments for ``/config`` (at most ``limit`` listed)."""
        now = self.clock()
        shown: list[dict[str, object]] = []
        for stream in self.streams.values():
            for live in stream.buckets.values():
                if len(shown) >= limit:
                    break
                shown.append(
                    {
                        "stream": stream.id,
                        "bucket_id": live.bucket_id,
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
            },
            "streams": [
                {"id": s.id, "peer": s.peer, "domain": s.domain, "buckets": len(s.buckets)}
                for s in self.streams.values()
            ],
            "live_buckets": self.live,
            "buckets": shown,
            "buckets_not_shown": max(0, self.live - len(shown)),
        }
