"""Quota-mode metrics: plain integers written by the stream handlers, turned into metric
families only when Prometheus scrapes (the pattern of :mod:`sidecar.metrics`).

Envoy's ``rate_limit_quota`` filter has no stats of its own, so the per-rule allowed and
denied numbers here, taken from Envoy's usage reports, are the only place they exist.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from sidecar.config.model import RateLimitRule
from sidecar.metrics import MAX_RULE_SERIES

if TYPE_CHECKING:
    from sidecar.quota.partition import PartitionCounts

PREFIX = "ratelimit_sidecar_quota_"


@dataclass(frozen=True)
class Gauges:
    """What the registry knows at scrape time."""

    live_buckets: int
    open_streams: int
    report_lag_seconds: float
    shares: dict[tuple[str, str], tuple[int, int]] = field(default_factory=dict)
    """Across replicas (``--backend redis``): ``(domain, stat key) -> (share, demand)``."""
    partition: PartitionCounts | None = None
    """Across replicas: what the partition rule is doing (holds, holds ended, leases handed on)."""


@dataclass
class QuotaStats:
    """Counts of the quota service; every dict is keyed by a small, fixed set of labels
    except ``rules``, which is bounded by the rules of the config (and capped)."""

    rules: dict[tuple[str, str], list[int]] = field(default_factory=dict)
    """``(domain, stat key) -> [allowed, denied, shadow_allowed]`` from Envoy's reports."""
    defaults: dict[str, list[int]] = field(default_factory=dict)
    """Usage of buckets on the default action, by why: ``[allowed, denied]``."""
    streams_opened: int = 0
    reports: int = 0
    malformed: dict[str, int] = field(default_factory=dict)
    sent: dict[str, int] = field(default_factory=dict)
    abandoned: dict[str, int] = field(default_factory=dict)
    unmatched: dict[str, int] = field(default_factory=dict)
    overflow: dict[str, int] = field(default_factory=dict)
    streams_ended: dict[str, int] = field(default_factory=dict)
    """Streams refused or ended by this side, by reason: ``max_streams``, ``write_timeout``."""

    @staticmethod
    def bump(counts: dict[str, int], label: str, by: int = 1) -> None:
        counts[label] = counts.get(label, 0) + by

    def usage(self, rule: RateLimitRule | None, why: str, allowed: int, denied: int) -> None:
        """Add one report's numbers for one bucket to its rule (or to its default reason)."""
        if rule is None:
            row = self.defaults.setdefault(why, [0, 0])
        else:
            key = (rule.domain, rule.stat_key)
            found = self.rules.get(key)
            if found is None:
                if len(self.rules) >= MAX_RULE_SERIES:
                    key = (rule.domain, rule.domain + "_overflow")
                found = self.rules.setdefault(key, [0, 0, 0])
            row = found
            if rule.shadow_mode:
                row[2] += allowed
        row[0] += allowed
        row[1] += denied

    def frozen(self, gauges: Gauges) -> FrozenQuota:
        """A copy of the numbers, taken on the event loop, to be collected in a scrape thread."""
        copy = QuotaStats(
            rules={key: list(row) for key, row in self.rules.items()},
            defaults={key: list(row) for key, row in self.defaults.items()},
            streams_opened=self.streams_opened,
            reports=self.reports,
            malformed=dict(self.malformed),
            sent=dict(self.sent),
            abandoned=dict(self.abandoned),
            unmatched=dict(self.unmatched),
            overflow=dict(self.overflow),
            streams_ended=dict(self.streams_ended),
        )
        return FrozenQuota(copy, gauges)

    def families(self, gauges: Callable[[], Gauges]) -> Iterator[Metric]:
        yield from self._rule_families()
        defaults = CounterMetricFamily(
            PREFIX + "default_requests",
            "Requests Envoy reported for buckets on the default action (ALLOW_ALL), by why and result",
            labels=("why", "result"),
        )
        for why, (allowed, denied) in sorted(self.defaults.items()):
            defaults.add_metric((why, "allowed"), allowed)
            defaults.add_metric((why, "denied"), denied)
        yield defaults
        now = gauges()
        yield GaugeMetricFamily(PREFIX + "buckets", "Live quota buckets held (all streams)", value=now.live_buckets)
        yield GaugeMetricFamily(PREFIX + "streams", "Open StreamRateLimitQuotas streams", value=now.open_streams)
        yield GaugeMetricFamily(
            PREFIX + "report_lag_seconds",
            "Seconds since the least recent report of any open stream (Envoy reports every 5 s)",
            value=now.report_lag_seconds,
        )
        yield from _share_families(now.shares)
        if now.partition is not None:
            yield from _partition_families(now.partition)
        yield CounterMetricFamily(PREFIX + "streams_opened", "Streams opened", value=self.streams_opened)
        yield CounterMetricFamily(PREFIX + "reports", "Usage report messages received", value=self.reports)
        yield _labelled(PREFIX + "malformed", "Messages or report entries refused, by kind", "kind", self.malformed)
        yield _labelled(PREFIX + "actions_sent", "Bucket actions sent to Envoy, by action", "action", self.sent)
        yield _labelled(PREFIX + "abandoned_buckets", "Buckets abandoned, by reason", "reason", self.abandoned)
        unmatched = "New buckets without a rule (default action), by reason"
        yield _labelled(PREFIX + "unmatched_buckets", unmatched, "reason", self.unmatched)
        yield _labelled(PREFIX + "bucket_overflow", "New buckets refused state at a cap, by cap", "cap", self.overflow)
        ended = "Streams refused at --quota-max-streams or ended for not reading responses, by reason"
        yield _labelled(PREFIX + "streams_ended", ended, "reason", self.streams_ended)

    def _rule_families(self) -> Iterator[Metric]:
        names = (
            ("allowed", "Requests Envoy allowed, per rule (from its quota usage reports)"),
            ("denied", "Requests Envoy denied, per rule (from its quota usage reports)"),
            ("shadow_allowed", "Requests Envoy allowed on shadow-mode rules (ALLOW_ALL), per rule"),
        )
        for index, (name, documentation) in enumerate(names):
            family = CounterMetricFamily(PREFIX + name, documentation, labels=("domain", "key"))
            for (domain, stat_key), row in sorted(self.rules.items()):
                family.add_metric((domain, stat_key.removeprefix(domain + ".")), row[index])
            yield family


@dataclass(frozen=True)
class FrozenQuota:
    """Quota numbers of one scrape (see :meth:`QuotaStats.frozen`)."""

    stats: QuotaStats
    gauges: Gauges

    def collect(self) -> Iterator[Metric]:
        return self.stats.families(lambda: self.gauges)


def _share_families(shares: dict[tuple[str, str], tuple[int, int]]) -> Iterator[Metric]:
    """This replica's share of each rule's limit and its Envoy's demand (``--backend redis``)."""
    names = (
        ("share", "This replica's share of the rule's limit (leased, or the safe capacity while Redis is away), "
         "units per fill interval, summed over its buckets"),
        ("share_demand", "Demand this replica published for the rule (Envoy's allowed + denied, +10%), "
         "units per fill interval, summed over its buckets"),
    )  # fmt: skip
    for index, (name, documentation) in enumerate(names):
        family = GaugeMetricFamily(PREFIX + name, documentation, labels=("domain", "key"))
        for (domain, stat_key), row in sorted(shares.items())[:MAX_RULE_SERIES]:
            family.add_metric((domain, stat_key.removeprefix(domain + ".")), row[index])
        yield family


def _partition_families(counts: PartitionCounts) -> Iterator[Metric]:
    """The partition rule at work (``--backend redis``): what an SRE alerts on."""
    yield GaugeMetricFamily(
        PREFIX + "held_buckets",
        "Shared buckets in which Redis keeps a silent replica's last lease reserved for the hold "
        "(the replica is dead or cut from Redis), as of this replica's last call",
        value=counts.held_buckets,
    )
    yield CounterMetricFamily(
        PREFIX + "holds_started", "Times a shared bucket started being held for a silent replica",
        value=counts.holds_started,
    )  # fmt: skip
    past = GaugeMetricFamily(
        PREFIX + "past_hold_buckets",
        "Shared buckets of this replica, cut from Redis past their hold, enforcing --quota-after-hold "
        "(deny: nothing; share: ceil(limit / replicas))",
        labels=("policy",),
    )
    past.add_metric((counts.policy,), counts.past_hold_buckets)
    yield past
    ended = CounterMetricFamily(
        PREFIX + "holds_ended",
        "Times a shared bucket's hold ended while this replica was cut from Redis",
        labels=("policy",),
    )
    ended.add_metric((counts.policy,), counts.holds_ended)
    yield ended
    yield CounterMetricFamily(
        PREFIX + "leases_handed_on", "Leases given back at a clean stop (the others need not wait for the hold)",
        value=counts.handed_on,
    )  # fmt: skip


def _labelled(name: str, documentation: str, label: str, counts: dict[str, int]) -> CounterMetricFamily:
    family = CounterMetricFamily(name, documentation, labels=(label,))
    for value, count in sorted(counts.items()):
        family.add_metric((value,), count)
    return family
