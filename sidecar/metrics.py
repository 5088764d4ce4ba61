"""Prometheus metrics, recorded as plain integers and turned into metrics only when scraped.

The request path must stay cheap, so it never touches prometheus-client: per rule it
adds to a list of ints, per request it bisects a latency into a bucket list. A
:class:`SidecarCollector` reads those numbers (and the limiter's own counters) when
Prometheus scrapes ``/metrics``.

Per-rule names and labels follow envoyproxy/ratelimit's Prometheus mapping
(``ratelimit_service_rate_limit_total_hits{domain, key1, key2}`` ...) so existing
dashboards and alerts work: ``key1`` and ``key2`` are the stat key's first two parts after
the domain, as the reference's default statsd mapping cuts them. Each series also carries
``key``, the whole stat key without the domain, which tells apart the rules that share
their first two parts (our dashboards group by it). Like the reference's, they are
untyped series without a ``_total`` suffix.
Service-level metrics are ours (``ratelimit_sidecar_*``).
"""

from __future__ import annotations

import bisect
import functools
import math
import struct
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
    UnknownMetricFamily,
)
from prometheus_client.registry import Collector

RULE_STATS = ("total_hits", "over_limit", "near_limit", "within_limit", "shadow_mode", "warned", "suppressed")
TOTAL_HITS, OVER_LIMIT, NEAR_LIMIT, WITHIN_LIMIT, SHADOW_MODE, WARNED, SUPPRESSED = range(len(RULE_STATS))
MAX_RULE_SERIES = 10_000
"""Cap on per-rule series: request values are unbounded, a scrape must not be."""
MAX_STAT_KEY_LENGTH = 1024
"""Longer stat keys (request values of ``detailed_metric`` rules, the keys of request
overrides: up to 32 entries of 4096 characters) share the overflow row."""
MAX_RULE_SERIES_BYTES = 8 * 1024 * 1024
"""Cap on the bytes the per-rule series add to ``/metrics`` (:func:`row_bytes` each):
past it new rows share the overflow row, so ``/metrics`` stays within about this plus
the service metrics however long the request values (10,000 rows of 1,000-character
keys would otherwise render 64 MB)."""
ROW_OVERHEAD = 80
"""Bytes one rendered sample line takes besides its domain and key labels."""
ROW_IDLE_SECONDS = 600.0
"""A row minted from request values (``detailed_metric`` rules, request overrides, the
overflow row) whose hits did not change for this long is dropped (:meth:`RuleStats.expire`)."""
EXPIRE_EVERY_SECONDS = 60.0
"""How often the server looks for idle rows."""
OVERFLOW_SUFFIX = "_detailed_overflow"
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)
FLUSH_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
FLUSH_KEYS_BUCKETS = (1, 5, 10, 50, 100, 500, 1000, 5000, 10000)
LOOP_LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class Buckets:
    """A histogram as a list of ints: ``observe`` is one bisect and two additions."""

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    def family(self, name: str, documentation: str) -> HistogramMetricFamily:
        """Cumulative buckets as Prometheus expects them."""
        cumulative, running = [], 0
        for bound, count in zip((*self.bounds, float("inf")), self.counts, strict=True):
            running += count
            cumulative.append((_bucket_label(bound), running))
        return HistogramMetricFamily(name, documentation, buckets=cumulative, sum_value=self.total)

    def copy(self) -> Buckets:
        """The numbers as they are now (for a scrape rendered off the event loop)."""
        copied = Buckets.__new__(Buckets)
        copied.bounds, copied.counts, copied.total = self.bounds, list(self.counts), self.total
        return copied


def _bucket_label(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(float(bound))


def row_bytes(stat_key: str, domain: str) -> int:
    """What one per-rule row adds to ``/metrics``: a line per :data:`RULE_STATS`, each with
    the domain, the key (the stat key without its ``domain.`` prefix) and its first two
    parts (``key1``, ``key2``) as labels."""
    return len(RULE_STATS) * (ROW_OVERHEAD + len(domain) + 2 * len(stat_key))


def reference_keys(key: str) -> tuple[str, str]:
    """``key1`` and ``key2`` of a stat key without its domain: its first two dot-separated
    parts (the second empty when there is one), as envoyproxy/ratelimit's mapping has them."""
    first, _, rest = key.partition(".")
    return first, rest.partition(".")[0]


@dataclass
class RuleStats:
    """Per-rule hit counts keyed by stat key, as envoyproxy/ratelimit counts them.

    Per check, hit by hit as the reference splits a multi-hit request (its dashboards
    read these as hits): ``total_hits`` all of them. An over-limit check adds to
    ``over_limit`` the hits past the limit (all of them when the counter was already at
    it, or is over for another reason: a ban, a suppression draw), to ``shadow_mode``
    the same when the rule is in shadow mode (it answers OK anyway), and to
    ``near_limit`` those between the near-limit threshold (``floor(limit *
    near_ratio)``) and the limit. A passing check adds all its hits to ``within_limit``
    and those past the threshold to ``near_limit`` too. ``warned`` (ours, not
    envoyproxy/ratelimit's) counts hits of admitted requests past a rule's ``warn_at``;
    the service adds them with :meth:`warned` when it sends the warning. ``suppressed``
    (ours) counts the ``over_limit`` hits an ``overload: suppress`` draw refused, not the
    full window.
    """

    near_ratio: float = 0.8
    rows: dict[str, list[int]] = field(default_factory=dict)
    domains: dict[str, str] = field(default_factory=dict)
    minted: dict[str, tuple[int, float]] = field(default_factory=dict)
    """Rows made from request values, which expire when idle: stat key to the hits seen at
    the last :meth:`expire` and when they last changed."""
    bytes: int = 0
    """What the rows add to ``/metrics`` (:func:`row_bytes`), held under :data:`MAX_RULE_SERIES_BYTES`."""
    idle_seconds: float = ROW_IDLE_SECONDS

    def row(self, stat_key: str, domain: str, *, minted: bool = False) -> list[int]:
        """The counts of ``stat_key``, created on first use.

        ``minted``: the key holds request values (``detailed_metric`` rules, request
        overrides), so it is unbounded, and the row expires once idle. New keys past
        :data:`MAX_RULE_SERIES` rows or :data:`MAX_RULE_SERIES_BYTES`, and keys longer
        than :data:`MAX_STAT_KEY_LENGTH`, share one ``<domain>_detailed_overflow`` row.
        """
        row = self.rows.get(stat_key)
        if row is None:
            size = row_bytes(stat_key, domain)
            if (
                len(self.rows) >= MAX_RULE_SERIES
                or len(stat_key) > MAX_STAT_KEY_LENGTH
                or self.bytes + size > MAX_RULE_SERIES_BYTES
            ):
                stat_key, minted = domain + OVERFLOW_SUFFIX, True
                row = self.rows.get(stat_key)
                if row is not None:
                    return row
                size = row_bytes(stat_key, domain)
            row = self.rows[stat_key] = [0] * len(RULE_STATS)
            self.domains[stat_key] = domain
            self.bytes += size
            if minted:
                self.minted[stat_key] = (-1, 0.0)
        return row

    def expire(self, now: float) -> int:
        """Drop request-minted rows whose hits did not change for :attr:`idle_seconds`
        (seen by the calls of this method, made every :data:`EXPIRE_EVERY_SECONDS`);
        returns how many went. Config rules' rows stay."""
        dropped = 0
        for stat_key, (seen, since) in list(self.minted.items()):
            row = self.rows.get(stat_key)
            if row is None:
                del self.minted[stat_key]
            elif row[TOTAL_HITS] != seen:
                self.minted[stat_key] = (row[TOTAL_HITS], now)
            elif now - since >= self.idle_seconds:
                domain = self.domains.pop(stat_key)
                del self.rows[stat_key], self.minted[stat_key]
                self.bytes -= row_bytes(stat_key, domain)
                dropped += 1
        return dropped

    def record(
        self, row: list[int], hits: int, over: bool, *, shadow: bool, count: int, limit: int, suppressed: bool = False
    ) -> None:
        """Count one check's hits; ``count`` is the count they are the last hits of (the
        would-be count, or for a passing check of a refused request the count kept:
        :func:`sidecar.service.reported.as_kept`, as the reference reads it back)."""
        row[TOTAL_HITS] += hits
        before = count - hits
        near = near_threshold(limit, self.near_ratio)
        if over:
            if before >= limit or count <= limit:
                past = hits
            else:
                past = count - limit
                row[NEAR_LIMIT] += limit - max(near, before)
            row[OVER_LIMIT] += past
            if suppressed:
                row[SUPPRESSED] += past
            if shadow:
                row[SHADOW_MODE] += past
        else:
            row[WITHIN_LIMIT] += hits
            if count > near:
                row[NEAR_LIMIT] += hits if before >= near else count - near

    @staticmethod
    def warned(row: list[int], hits: int) -> None:
        """Count hits admitted past the rule's soft limit (``warn_at``)."""
        row[WARNED] += hits

    def families(self) -> Iterator[Metric]:
        return rule_families(self.frozen())

    def frozen(self) -> FrozenRows:
        """The rows as they are, taken at C speed on the event loop, so a thread can render
        them while the loop adds and drops rows (the rows' ints are read live)."""
        return self.domains.copy(), list(self.rows.items())


@functools.lru_cache(maxsize=4096)
def near_threshold(limit: int, ratio: float) -> int:
    """The count past which a hit is near the limit: ``floor(limit * ratio)`` worked out in
    single precision, as envoyproxy/ratelimit does (a ratio of 0.7 makes 7 of a limit of
    10 there, 6 in double precision). Cached: limits are few, but a request override's
    is the client's choice, so the cache is bounded."""
    return math.floor(single(single(limit) * single(ratio)))


def single(value: float) -> float:
    """``value`` rounded to single precision (a float32)."""
    return float(struct.unpack("f", struct.pack("f", value))[0])


FrozenRows = tuple[dict[str, str], list[tuple[str, list[int]]]]
"""``(domain of each stat key, (stat key, row) pairs)``."""


def rule_families(frozen: FrozenRows) -> Iterator[Metric]:
    """The per-rule series of :meth:`RuleStats.frozen` rows."""
    domains, rows = frozen
    for index, stat in enumerate(RULE_STATS):
        family = UnknownMetricFamily(
            f"ratelimit_service_rate_limit_{stat}",
            f"Hits per rule: {stat.replace('_', ' ')} (envoyproxy/ratelimit naming)",
            labels=("domain", "key", "key1", "key2"),
        )
        for stat_key, row in rows:
            domain = domains[stat_key]
            key = stat_key.removeprefix(domain + ".")
            family.add_metric((domain, key, *reference_keys(key)), row[index])
        yield family


@dataclass
class ServiceStats:
    """What the service counts itself: requests, errors, latency, config loads."""

    rules: RuleStats = field(default_factory=RuleStats)
    requests: int = 0
    over_limit_requests: int = 0
    suppressed_requests: int = 0
    """Of the over-limit requests, those an ``overload: suppress`` draw refused."""
    errors: dict[str, int] = field(default_factory=dict)
    latency: Buckets = field(default_factory=lambda: Buckets(LATENCY_BUCKETS))
    config_loads: dict[str, int] = field(default_factory=lambda: {"ok": 0, "error": 0})
    config_digest: str = ""
    config_loaded_at: float = 0.0

    def error(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1

    def config_loaded(self, digest: str, when: float | None = None) -> None:
        self.config_loads["ok"] += 1
        self.config_digest = digest
        self.config_loaded_at = time.time() if when is None else when

    def config_refused(self) -> None:
        self.config_loads["error"] += 1

    def families(self) -> Iterator[Metric]:
        yield from self.service_families()
        yield from self.rules.families()

    def frozen(self) -> ServiceStats:
        """A copy of the service's own numbers (the rules' rows left out: see
        :meth:`RuleStats.frozen`), cheap enough for the event loop."""
        return replace(
            self,
            rules=RuleStats(),
            errors=dict(self.errors),
            latency=self.latency.copy(),
            config_loads=dict(self.config_loads),
        )

    def service_families(self) -> Iterator[Metric]:
        requests = CounterMetricFamily(
            "ratelimit_sidecar_requests", "ShouldRateLimit calls answered, by overall code", labels=("code",)
        )
        requests.add_metric(("OK",), self.requests - self.over_limit_requests)
        requests.add_metric(("OVER_LIMIT",), self.over_limit_requests)
        yield requests
        yield CounterMetricFamily(
            "ratelimit_sidecar_suppressed_requests",
            "OVER_LIMIT answers an overload: suppress draw decided (the window was not full)",
            value=self.suppressed_requests,
        )
        errors = CounterMetricFamily("ratelimit_sidecar_request_errors", "Calls refused, by kind", labels=("kind",))
        for kind, count in sorted(self.errors.items()):
            errors.add_metric((kind,), count)
        yield errors
        yield self.latency.family("ratelimit_sidecar_decision_seconds", "Time to decide a valid request")
        loads = CounterMetricFamily("ratelimit_sidecar_config_loads", "Config loads, by result", labels=("result",))
        for result, count in self.config_loads.items():
            loads.add_metric((result,), count)
        yield loads
        info = InfoMetricFamily("ratelimit_sidecar_config", "The active config")
        info.add_metric((), {"sha256": self.config_digest})
        yield info
        yield GaugeMetricFamily(
            "ratelimit_sidecar_config_loaded_timestamp_seconds",
            "Unix time the active config was loaded",
            value=self.config_loaded_at,
        )


@dataclass(frozen=True)
class LimiterSnapshot:
    """A backend's numbers at scrape time; Redis fields are None for the memory backend."""

    counters: int
    evictions: int
    redis_up: bool | None = None
    replicas: int | None = None
    round_trips_request_path: int | None = None
    round_trips_background: int | None = None
    pending_hits: int | None = None
    flush_seconds: Buckets | None = None
    flush_keys: Buckets | None = None
    corrupt_keys: int | None = None
    """Calls that met a Redis key holding something that is not a counter."""
    refused_hits: int | None = None
    """Admitted hits a flush could not add, their key holding no counter."""
    failure_reasons: dict[str, int] | None = None
    """Requests decided without Redis, by reason (``sidecar.limiter.budget.REASONS``)."""
    full_window_refusals: int | None = None
    """strict: requests refused without a round trip, on windows Redis had reported full."""
    loop_lag_latest: float | None = None
    """Lateness of the event loop's last timer tick, seconds."""
    loop_lag_max: float | None = None
    """Largest lateness since the previous scrape."""
    loop_lag: Buckets | None = None
    redis_nodes_up: dict[str, bool] | None = None
    """Redis Cluster: each master (``host:port``, at most 64) and whether it answers."""


OPTIONAL_SCALARS: tuple[tuple[str, type[GaugeMetricFamily] | type[CounterMetricFamily], str, str], ...] = (
    (
        "pending_hits",
        GaugeMetricFamily,
        "ratelimit_sidecar_pending_hits",
        "Admitted hits Redis has not acknowledged yet",
    ),
    (
        "corrupt_keys",
        CounterMetricFamily,
        "ratelimit_sidecar_redis_corrupt_keys",
        "Requests and flushes that met a Redis key holding something that is not a counter "
        "(the failure mode decided the requests)",
    ),
    (
        "refused_hits",
        CounterMetricFamily,
        "ratelimit_sidecar_redis_refused_hits",
        "Admitted hits a flush could not add to Redis: their key holds something that is not a counter",
    ),
    (
        "full_window_refusals",
        CounterMetricFamily,
        "ratelimit_sidecar_full_window_refusals",
        "Requests refused without a Redis round trip: a window they need was reported full by Redis",
    ),
)
"""``(LimiterSnapshot field, family, name, help)`` of the one-number series a backend may
report: each is exposed when its field is not None."""


def limiter_families(snapshot: LimiterSnapshot) -> Iterator[Metric]:
    """The backend's metrics; Redis ones only when the backend has Redis."""
    yield GaugeMetricFamily("ratelimit_sidecar_counters", "Live counters held by this process", value=snapshot.counters)
    yield CounterMetricFamily(
        "ratelimit_sidecar_evictions", "Counters dropped at the cap before their window ended", value=snapshot.evictions
    )
    if snapshot.loop_lag is not None:
        yield GaugeMetricFamily(
            "ratelimit_sidecar_event_loop_lag_latest_seconds",
            "How late the event loop ran its last timer tick (time not charged to Redis)",
            value=snapshot.loop_lag_latest or 0.0,
        )
        yield GaugeMetricFamily(
            "ratelimit_sidecar_event_loop_lag_max_seconds",
            "Largest event-loop lateness since the previous scrape",
            value=snapshot.loop_lag_max or 0.0,
        )
        yield snapshot.loop_lag.family(
            "ratelimit_sidecar_event_loop_lag_seconds", "Event-loop lateness of a periodic timer tick"
        )
    if snapshot.redis_up is None:
        return
    yield GaugeMetricFamily("ratelimit_sidecar_redis_up", "1 while Redis answers", value=int(snapshot.redis_up))
    if snapshot.redis_nodes_up:
        nodes = GaugeMetricFamily(
            "ratelimit_sidecar_redis_node_up",
            "Redis Cluster: 1 while this master answers (0: requests on its slots get the failure mode)",
            labels=("node",),
        )
        for node, up in sorted(snapshot.redis_nodes_up.items()):
            nodes.add_metric((node,), int(up))
        yield nodes
    yield GaugeMetricFamily("ratelimit_sidecar_replicas", "Live replicas seen in Redis", value=snapshot.replicas or 0)
    trips = CounterMetricFamily(
        "ratelimit_sidecar_redis_round_trips", "Redis round trips, by where they happen", labels=("path",)
    )
    trips.add_metric(("request",), snapshot.round_trips_request_path or 0)
    trips.add_metric(("background",), snapshot.round_trips_background or 0)
    yield trips
    for attribute, family, name, documentation in OPTIONAL_SCALARS:
        value = getattr(snapshot, attribute)
        if value is not None:
            yield family(name, documentation, value=value)
    if snapshot.failure_reasons is not None:
        reasons = CounterMetricFamily(
            "ratelimit_sidecar_failure_decisions",
            "Requests decided by the failure mode instead of Redis, by reason",
            labels=("reason",),
        )
        for reason, count in snapshot.failure_reasons.items():
            reasons.add_metric((reason,), count)
        yield reasons
    if snapshot.flush_seconds is not None:
        yield snapshot.flush_seconds.family("ratelimit_sidecar_flush_seconds", "Sync flush round trip time")
    if snapshot.flush_keys is not None:
        yield snapshot.flush_keys.family("ratelimit_sidecar_flush_keys", "Counters sent or read per sync flush")


class SidecarCollector(Collector):
    """Reads the service's and the backend's numbers when Prometheus scrapes."""

    def __init__(
        self,
        stats: ServiceStats,
        snapshot: Callable[[], LimiterSnapshot],
        quota: Callable[[], Collectable] | None = None,
    ) -> None:
        self.stats = stats
        self.snapshot = snapshot
        self.quota = quota
        """Quota mode's numbers (``ratelimit_sidecar_quota_*``), copied on the loop when called."""

    def collect(self) -> Iterator[Metric]:
        return self.frozen().collect()

    def frozen(self) -> FrozenScrape:
        """Copy the numbers now, on the event loop (well under a millisecond for 10,000
        rows), so :meth:`FrozenScrape.collect` can turn them into text in a thread."""
        snapshot = self.snapshot()
        if snapshot.flush_seconds is not None or snapshot.flush_keys is not None or snapshot.loop_lag is not None:
            snapshot = replace(
                snapshot,
                flush_seconds=snapshot.flush_seconds.copy() if snapshot.flush_seconds else None,
                flush_keys=snapshot.flush_keys.copy() if snapshot.flush_keys else None,
                loop_lag=snapshot.loop_lag.copy() if snapshot.loop_lag else None,
            )
        quota = self.quota() if self.quota is not None else None
        return FrozenScrape(self.stats.frozen(), self.stats.rules.frozen(), snapshot, quota)


class Collectable(Protocol):
    """Anything that yields metric families (a frozen copy, safe in a thread)."""

    def collect(self) -> Iterator[Metric]: ...


@dataclass(frozen=True)
class FrozenScrape:
    """The numbers of one scrape, copied on the event loop; safe to collect in any thread."""

    stats: ServiceStats
    rules: FrozenRows
    limiter: LimiterSnapshot
    quota: Collectable | None = None
    """Quota mode's numbers (``ratelimit_sidecar_quota_*``), copied likewise."""

    def collect(self) -> Iterator[Metric]:
        yield from self.stats.service_families()
        yield from rule_families(self.rules)
        yield from limiter_families(self.limiter)
        if self.quota is not None:
            yield from self.quota.collect()


class Scrape:
    """What ``/metrics`` renders: collectors, each collected (and rendered) in a worker thread."""

    def __init__(self, *collectors: Any) -> None:
        self.collectors = collectors

    def collect(self) -> Iterator[Metric]:
        for collector in self.collectors:
            yield from collector.collect()


def render(registry: Any) -> bytes:
    """The text exposition format of ``registry``."""
    from prometheus_client import generate_latest  # noqa: PLC0415 - only at scrape time

    return bytes(generate_latest(registry))
