"""Prometheus metrics, recorded as plain integers and turned into metrics only when scraped.

The request path must stay cheap, so it never touches prometheus-client: per rule it
adds to a list of ints, per request it bisects a latency into a bucket list. A
:class:`SidecarCollector` reads those numbers (and the limiter's own counters) when
Prometheus scrapes ``/metrics``.

Per-rule names and labels follow envoyproxy/ratelimit's Prometheus mapping
(``ratelimit_service_rate_limit_total_hits{domain, key}`` ...) so existing dashboards
work; like theirs they are exposed as untyped series without a ``_total`` suffix.
Service-level metrics are ours (``ratelimit_sidecar_*``).
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
    UnknownMetricFamily,
)
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from sidecar.quota.registry import QuotaRegistry

RULE_STATS = ("total_hits", "over_limit", "near_limit", "within_limit", "shadow_mode", "warned")
TOTAL_HITS, OVER_LIMIT, NEAR_LIMIT, WITHIN_LIMIT, SHADOW_MODE, WARNED = range(len(RULE_STATS))
MAX_RULE_SERIES = 10_000
"""Cap on per-rule series: request values are unbounded, a scrape must not be."""
MAX_STAT_KEY_LENGTH = 1024
"""Longer stat keys (request values of ``detailed_metric`` rules and request overrides:
up to 32 entries of 4096 characters) share the overflow row, so the series are
bounded in size as well as in number."""
OVERFLOW_SUFFIX = "_detailed_overflow"
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)
FLUSH_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
FLUSH_KEYS_BUCKETS = (1, 5, 10, 50, 100, 500, 1000, 5000, 10000)


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


def _bucket_label(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(float(bound))


@dataclass
class RuleStats:
    """Per-rule hit counts keyed by stat key, as envoyproxy/ratelimit counts them.

    Per check: ``total_hits`` always; ``over_limit`` when over (plus ``shadow_mode``
    when the rule is in shadow mode, which answers OK anyway); otherwise
    ``within_limit``, and ``near_limit`` too once the count reaches
    ``near_ratio`` of the limit. Each adds the check's hits. ``warned`` (ours, not
    envoyproxy/ratelimit's) counts hits of admitted requests past a rule's ``warn_at``;
    the service adds them with :meth:`warned` when it sends the warning.
    """

    near_ratio: float = 0.8
    rows: dict[str, list[int]] = field(default_factory=dict)
    domains: dict[str, str] = field(default_factory=dict)

    def row(self, stat_key: str, domain: str) -> list[int]:
        """The counts of ``stat_key``, created on first use; past :data:`MAX_RULE_SERIES`
        keys (request values of ``detailed_metric`` rules and request overrides are
        unbounded) new keys, and keys longer than :data:`MAX_STAT_KEY_LENGTH`, share one
        ``<domain>_detailed_overflow`` row."""
        row = self.rows.get(stat_key)
        if row is None:
            if len(self.rows) >= MAX_RULE_SERIES or len(stat_key) > MAX_STAT_KEY_LENGTH:
                stat_key = domain + OVERFLOW_SUFFIX
                row = self.rows.get(stat_key)
                if row is not None:
                    return row
            row = self.rows[stat_key] = [0] * len(RULE_STATS)
            self.domains[stat_key] = domain
        return row

    def record(self, row: list[int], hits: int, over: bool, *, shadow: bool, count: int, limit: int) -> None:
        """Count one check's hits; ``count`` includes them (the would-be count)."""
        row[TOTAL_HITS] += hits
        if over:
            row[OVER_LIMIT] += hits
            if shadow:
                row[SHADOW_MODE] += hits
        else:
            row[WITHIN_LIMIT] += hits
            if count >= self.near_ratio * limit:
                row[NEAR_LIMIT] += hits

    @staticmethod
    def warned(row: list[int], hits: int) -> None:
        """Count hits admitted past the rule's soft limit (``warn_at``)."""
        row[WARNED] += hits

    def families(self) -> Iterator[Metric]:
        for index, stat in enumerate(RULE_STATS):
            family = UnknownMetricFamily(
                f"ratelimit_service_rate_limit_{stat}",
                f"Hits per rule: {stat.replace('_', ' ')} (envoyproxy/ratelimit naming)",
                labels=("domain", "key"),
            )
            for stat_key, row in self.rows.items():
                domain = self.domains[stat_key]
                family.add_metric((domain, stat_key.removeprefix(domain + ".")), row[index])
            yield family


@dataclass
class ServiceStats:
    """What the service counts itself: requests, errors, latency, config loads."""

    rules: RuleStats = field(default_factory=RuleStats)
    requests: int = 0
    over_limit_requests: int = 0
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
        requests = CounterMetricFamily(
            "ratelimit_sidecar_requests", "ShouldRateLimit calls answered, by overall code", labels=("code",)
        )
        requests.add_metric(("OK",), self.requests - self.over_limit_requests)
        requests.add_metric(("OVER_LIMIT",), self.over_limit_requests)
        yield requests
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
        yield from self.rules.families()


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


def limiter_families(snapshot: LimiterSnapshot) -> Iterator[Metric]:
    """The backend's metrics; Redis ones only when the backend has Redis."""
    yield GaugeMetricFamily("ratelimit_sidecar_counters", "Live counters held by this process", value=snapshot.counters)
    yield CounterMetricFamily(
        "ratelimit_sidecar_evictions", "Counters dropped at the cap before their window ended", value=snapshot.evictions
    )
    if snapshot.redis_up is None:
        return
    yield GaugeMetricFamily("ratelimit_sidecar_redis_up", "1 while Redis answers", value=int(snapshot.redis_up))
    yield GaugeMetricFamily("ratelimit_sidecar_replicas", "Live replicas seen in Redis", value=snapshot.replicas or 0)
    trips = CounterMetricFamily(
        "ratelimit_sidecar_redis_round_trips", "Redis round trips, by where they happen", labels=("path",)
    )
    trips.add_metric(("request",), snapshot.round_trips_request_path or 0)
    trips.add_metric(("background",), snapshot.round_trips_background or 0)
    yield trips
    if snapshot.pending_hits is not None:
        yield GaugeMetricFamily(
            "ratelimit_sidecar_pending_hits",
            "Admitted hits Redis has not acknowledged yet",
            value=snapshot.pending_hits,
        )
    if snapshot.flush_seconds is not None:
        yield snapshot.flush_seconds.family("ratelimit_sidecar_flush_seconds", "Sync flush round trip time")
    if snapshot.flush_keys is not None:
        yield snapshot.flush_keys.family("ratelimit_sidecar_flush_keys", "Counters sent or read per sync flush")


class SidecarCollector(Collector):
    """Reads the service's and the backend's numbers when Prometheus scrapes."""

    def __init__(
        self, stats: ServiceStats, snapshot: Callable[[], LimiterSnapshot], quota: QuotaRegistry | None = None
    ) -> None:
        self.stats = stats
        self.snapshot = snapshot
        self.quota = quota
        """Quota mode's registry: its stats and live gauges (``ratelimit_sidecar_quota_*``)."""

    def collect(self) -> Iterator[Metric]:
        yield from self.stats.families()
        yield from limiter_families(self.snapshot())
        if self.quota is not None:
            yield from self.quota.stats.families(self.quota.gauges)


def render(registry: Any) -> bytes:
    """The text exposition format of ``registry``."""
    from prometheus_client import generate_latest  # noqa: PLC0415 - only at scrape time

    return bytes(generate_latest(registry))
