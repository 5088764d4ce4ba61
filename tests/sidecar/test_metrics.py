"""Metrics: what the request path counts, and what a scrape shows."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from sidecar.client import build_request
from sidecar.config import load_config
from sidecar.limiter.memory import MemoryLimiter
from sidecar.metrics import (
    MAX_RULE_SERIES,
    Buckets,
    LimiterSnapshot,
    RuleStats,
    ServiceStats,
    SidecarCollector,
    render,
)
from sidecar.protos.envoy.service.ratelimit.v3 import rls_pb2
from sidecar.service.servicer import RateLimitService

NOW = 1_700_000_000.0
CONFIG = textwrap.dedent(
    """\
    domain: m
    descriptors:
      - key: user
        rate_limit: {unit: minute, requests_per_unit: 10}
      - key: team
        detailed_metric: true
        rate_limit: {unit: minute, requests_per_unit: 5}
      - key: probe
        shadow_mode: true
        rate_limit: {unit: minute, requests_per_unit: 2}
      - key: free
        rate_limit: {unlimited: true}
    """
)


def samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a scrape, keyed by name and sorted labels."""
    text = render(registry).decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


@pytest.fixture
def service(tmp_path: Path) -> RateLimitService:
    (tmp_path / "m.yaml").write_text(CONFIG)
    return RateLimitService(load_config(str(tmp_path)), MemoryLimiter(), clock=lambda: NOW)


def scrape(service: RateLimitService) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SidecarCollector(service.stats, service.limiter.snapshot))  # type: ignore[attr-defined]
    return samples(registry)


def rule(stat: str, key: str, domain: str = "m") -> tuple[str, tuple[tuple[str, str], ...]]:
    """A per-rule series: ``key`` plus the reference's ``key1`` and ``key2`` (its first two parts)."""
    first, _, rest = key.partition(".")
    labels = (("domain", domain), ("key", key), ("key1", first), ("key2", rest.partition(".")[0]))
    return (f"ratelimit_service_rate_limit_{stat}", labels)


async def test_per_rule_counts_follow_envoyproxy_ratelimit(service: RateLimitService) -> None:
    for _ in range(12):
        await service.decide(build_request("m", ["user=alice"]))
    seen = scrape(service)
    assert seen[rule("total_hits", "user")] == 12
    assert seen[rule("within_limit", "user")] == 10
    assert seen[rule("over_limit", "user")] == 2
    assert seen[rule("near_limit", "user")] == 2, "counts 9 and 10 pass floor(0.8 * 10), as the reference counts"
    assert seen[rule("shadow_mode", "user")] == 0


async def test_shadow_rules_count_over_limit_and_shadow_mode_but_answer_ok(service: RateLimitService) -> None:
    codes = [(await service.decide(build_request("m", ["probe=x"]))).overall_code for _ in range(3)]
    assert codes == [rls_pb2.RateLimitResponse.OK] * 3
    seen = scrape(service)
    assert (seen[rule("over_limit", "probe")], seen[rule("shadow_mode", "probe")]) == (1, 1)


async def test_detailed_metric_rules_get_one_series_per_value(service: RateLimitService) -> None:
    await service.decide(build_request("m", ["team=red"]))
    await service.decide(build_request("m", ["team=blue"]))
    seen = scrape(service)
    assert seen[rule("total_hits", "team_red")] == 1
    assert seen[rule("total_hits", "team_blue")] == 1
    assert rule("total_hits", "team") not in seen


async def test_hits_addend_counts_hits_not_requests(service: RateLimitService) -> None:
    await service.decide(build_request("m", ["user=bob"], hits=4))
    assert scrape(service)[rule("total_hits", "user")] == 4


async def test_unlimited_and_unmatched_descriptors_count_nothing(service: RateLimitService) -> None:
    await service.decide(build_request("m", ["free=1", "nothing=here"]))
    assert not [key for key in scrape(service) if key[0].startswith("ratelimit_service_rate_limit")]


def test_series_are_capped_and_the_rest_share_an_overflow_row() -> None:
    stats = RuleStats()
    for index in range(MAX_RULE_SERIES + 50):
        stats.record(stats.row(f"d.k_{index}", "d"), 1, False, shadow=False, count=1, limit=10)
    assert len(stats.rows) == MAX_RULE_SERIES + 1
    assert stats.rows["d_detailed_overflow"][0] == 50


def test_buckets_are_cumulative_with_sum_and_count() -> None:
    buckets = Buckets((0.001, 0.01))
    for value in (0.0005, 0.002, 0.003, 5.0):
        buckets.observe(value)
    registry = CollectorRegistry(auto_describe=False)
    stats = ServiceStats(latency=buckets)
    registry.register(SidecarCollector(stats, lambda: LimiterSnapshot(counters=3, evictions=1)))
    seen = samples(registry)
    assert seen[("ratelimit_sidecar_decision_seconds_bucket", (("le", "0.001"),))] == 1
    assert seen[("ratelimit_sidecar_decision_seconds_bucket", (("le", "0.01"),))] == 3
    assert seen[("ratelimit_sidecar_decision_seconds_bucket", (("le", "+Inf"),))] == 4
    assert seen[("ratelimit_sidecar_decision_seconds_count", ())] == 4
    assert seen[("ratelimit_sidecar_decision_seconds_sum", ())] == pytest.approx(5.0055)
    assert seen[("ratelimit_sidecar_counters", ())] == 3
    assert seen[("ratelimit_sidecar_evictions_total", ())] == 1
    assert not [key for key in seen if key[0].startswith("ratelimit_sidecar_redis")], "no Redis, no Redis metrics"


def test_redis_backends_add_their_state(redis_snapshot: LimiterSnapshot) -> None:
    snapshot = redis_snapshot
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SidecarCollector(ServiceStats(), lambda: snapshot))
    seen = samples(registry)
    assert seen[("ratelimit_sidecar_redis_up", ())] == 1
    assert seen[("ratelimit_sidecar_replicas", ())] == 3
    assert seen[("ratelimit_sidecar_redis_round_trips_total", (("path", "request"),))] == 7
    assert seen[("ratelimit_sidecar_redis_round_trips_total", (("path", "background"),))] == 11
    assert seen[("ratelimit_sidecar_pending_hits", ())] == 4
    assert ("ratelimit_sidecar_flush_seconds_count", ()) in seen


def test_config_loads_and_errors_are_counted() -> None:
    stats = ServiceStats()
    stats.config_loaded("abc", when=123.0)
    stats.config_refused()
    stats.error("invalid_argument")
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SidecarCollector(stats, lambda: LimiterSnapshot(counters=0, evictions=0)))
    seen = samples(registry)
    assert seen[("ratelimit_sidecar_config_loads_total", (("result", "ok"),))] == 1
    assert seen[("ratelimit_sidecar_config_loads_total", (("result", "error"),))] == 1
    assert seen[("ratelimit_sidecar_config_info", (("sha256", "abc"),))] == 1
    assert seen[("ratelimit_sidecar_config_loaded_timestamp_seconds", ())] == 123.0
    assert seen[("ratelimit_sidecar_request_errors_total", (("kind", "invalid_argument"),))] == 1
