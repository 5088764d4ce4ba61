"""Quota mode: live buckets on a fake clock (TTL refreshes, idle abandonment, caps, reloads)."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from sidecar.metrics import LimiterSnapshot, ServiceStats, SidecarCollector, render
from sidecar.quota.assignments import Action, Kind, nanos_after
from sidecar.quota.buckets import bucket_of
from sidecar.quota.registry import ABANDON_MEMORY, QuotaRegistry, QuotaSettings
from sidecar.quota.stream import Stream

RULES = """
domain: q
descriptors:
  - key: user
    rate_limit: {unit: second, requests_per_unit: 5}
  - key: probe
    shadow_mode: true
    rate_limit: {unit: minute, requests_per_unit: 2}
"""
RELOADED = RULES.replace(
    "unit: second, requests_per_unit: 5", "unit: second, unit_multiplier: 10, requests_per_unit: 5"
)


def user(name: str) -> dict[str, str]:
    return bucket_of("q", [("user", name)])


def usage(*items: tuple[dict[str, str], int, int]) -> Iterator[tuple[dict[str, str], int, int]]:
    return iter(items)


def take(stream: Stream) -> list[Action]:
    return stream.pending.take(len(stream.pending))


@pytest.fixture
def setup(h: SimpleNamespace) -> tuple[QuotaRegistry, Stream, SimpleNamespace]:
    clock = h.FakeClock(1000.0)
    registry = QuotaRegistry(
        h.config_of(RULES),
        QuotaSettings(ttl=60, idle_abandon=120, max_buckets=3, max_buckets_per_stream=2),
        clock=clock,
    )
    return registry, registry.open("peer"), clock


def test_a_new_bucket_gets_its_assignment_at_once(setup: tuple[QuotaRegistry, Stream, SimpleNamespace]) -> None:
    registry, stream, _ = setup
    registry.report(stream, "q", usage((user("a"), 1, 0)))
    [action] = take(stream)
    assert action.bucket_id == user("a")
    assert action.assignment is not None
    assert action.assignment.envoy_fields() == (Kind.TOKEN_BUCKET, 5, 5, 1)
    registry.report(stream, "q", usage((user("a"), 3, 2)))
    assert take(stream) == []  # known bucket: nothing to send until a refresh is due
    assert registry.stats.rules[("q", "q.user")] == [4, 2, 0]


def test_assignments_are_pushed_again_every_third_of_the_ttl(
    setup: tuple[QuotaRegistry, Stream, SimpleNamespace],
) -> None:
    registry, stream, clock = setup
    registry.report(stream, "q", usage((user("a"), 1, 0)))
    take(stream)
    refreshes = []
    for _ in range(70):  # 70 s on a 1 s tick, used all along
        clock.advance(1)
        registry.report(stream, "q", usage((user("a"), 1, 0)))
        registry.maintain(stream)
        refreshes += [clock.now - 1000 for action in take(stream) if action.assignment is not None]
    assert refreshes == [20, 40, 60]  # every TTL / 3: two refreshes can be lost before it expires


def test_idle_buckets_are_abandoned_and_forgotten(setup: tuple[QuotaRegistry, Stream, SimpleNamespace]) -> None:
    registry, stream, clock = setup
    registry.report(stream, "q", usage((user("a"), 1, 0), (user("b"), 1, 0)))
    take(stream)
    for _ in range(24):  # reports every 5 s; b keeps being used, a does not
        clock.advance(5)
        registry.report(stream, "q", usage((user("a"), 0, 0), (user("b"), 1, 0)))
        registry.maintain(stream)
        abandoned = [action.bucket_id for action in take(stream) if action.assignment is None]
        if abandoned:
            assert (clock.now - 1000, abandoned) == (120, [user("a")])
    assert list(stream.buckets) == [tuple(sorted(user("b").items()))]
    assert registry.live == 1
    assert registry.stats.abandoned == {"idle": 1}


def test_a_late_zero_report_does_not_bring_an_abandoned_bucket_back(
    setup: tuple[QuotaRegistry, Stream, SimpleNamespace],
) -> None:
    registry, stream, clock = setup
    registry.report(stream, "q", usage((user("a"), 1, 0)))
    clock.advance(120)
    registry.maintain(stream)
    take(stream)
    registry.report(stream, "q", usage((user("a"), 0, 0)))
    assert take(stream) == [] and registry.live == 0
    registry.report(stream, "q", usage((user("a"), 1, 0)))  # used again: a new bucket in Envoy
    assert [action.assignment is not None for action in take(stream)] == [True]
    clock.advance(ABANDON_MEMORY)
    registry.maintain(stream)
    assert stream.abandoned == {}


def test_caps_per_stream_and_per_process_give_the_default_and_keep_no_state(
    setup: tuple[QuotaRegistry, Stream, SimpleNamespace],
) -> None:
    registry, stream, _ = setup
    registry.report(stream, "q", usage((user("a"), 1, 0), (user("b"), 1, 0), (user("c"), 1, 0)))
    actions = take(stream)
    assert [action.assignment.why for action in actions if action.assignment] == ["fixed_window"] * 2 + ["overflow"]
    assert actions[2].assignment is not None and actions[2].assignment.kind is Kind.ALLOW_ALL
    other = registry.open("other")
    registry.report(other, "q", usage((user("d"), 1, 0), (user("e"), 1, 0)))
    assert [action.assignment.why for action in take(other) if action.assignment] == ["fixed_window", "overflow"]
    assert registry.live == 3
    assert registry.stats.overflow == {"stream": 1, "process": 1}
    registry.close(stream)
    assert registry.live == 1
    registry.report(other, "q", usage((user("e"), 1, 0)))  # room again: adopted now
    assert registry.live == 2


def test_bad_and_unmatched_ids_get_allow_all_and_are_counted_by_reason(
    setup: tuple[QuotaRegistry, Stream, SimpleNamespace],
) -> None:
    registry, stream, _ = setup
    bad = {"entry.0.user": "x"}
    registry.report(stream, "q", usage((bad, 2, 0), (bucket_of("q", [("nobody", "x")]), 1, 0)))
    actions = take(stream)
    assert all(a.assignment is not None and a.assignment.kind is Kind.ALLOW_ALL for a in actions)
    assert registry.stats.unmatched == {"missing_domain": 1, "no_match": 1}
    assert registry.live == 1  # the bad id is served without state
    assert registry.stats.defaults == {"bad_id:missing_domain": [2, 0], "no_match": [1, 0]}


def test_huge_ids_are_served_without_state(setup: tuple[QuotaRegistry, Stream, SimpleNamespace]) -> None:
    registry, stream, _ = setup
    registry.report(stream, "q", usage((user("v" * 4090), 1, 0)))
    [action] = take(stream)
    assert action.assignment is not None and action.assignment.kind is Kind.TOKEN_BUCKET
    assert registry.live == 0 and registry.stats.overflow == {"id_size": 1}


async def test_a_reload_pushes_every_bucket_and_flips_nanos_when_only_the_seconds_change(
    h: SimpleNamespace, setup: tuple[QuotaRegistry, Stream, SimpleNamespace]
) -> None:
    registry, stream, _ = setup
    woken = []
    stream.notify = lambda: woken.append(True)
    registry.report(stream, "q", usage((user("a"), 1, 0)))
    take(stream)
    registry.reassign(h.config_of(RELOADED))
    await registry.settled()
    [action] = take(stream)
    assert action.assignment is not None
    assert (action.assignment.envoy_fields(), action.nanos, woken) == ((Kind.TOKEN_BUCKET, 5, 5, 10), 1, [True])
    registry.reassign(h.config_of(RULES))
    await registry.settled()
    assert take(stream)[0].nanos == 0


def test_nanos_stay_when_envoy_sees_the_change_anyway(h: SimpleNamespace) -> None:
    from sidecar.quota.assignments import Assignment

    five = Assignment(Kind.TOKEN_BUCKET, "x", None, 5, 5, 1)
    assert nanos_after(five, Assignment(Kind.TOKEN_BUCKET, "x", None, 6, 6, 10), 0) == 0
    assert nanos_after(five, Assignment(Kind.ALLOW_ALL, "x"), 1) == 1
    assert nanos_after(five, Assignment(Kind.TOKEN_BUCKET, "x", None, 5, 5, 2), 1) == 0


def test_shadow_usage_is_counted_under_its_rule(setup: tuple[QuotaRegistry, Stream, SimpleNamespace]) -> None:
    registry, stream, _ = setup
    registry.report(stream, "q", usage((bucket_of("q", [("probe", "p")]), 9, 0)))
    assert registry.stats.rules[("q", "q.probe")] == [9, 0, 9]


def test_metrics_and_config_show_the_live_buckets(setup: tuple[QuotaRegistry, Stream, SimpleNamespace]) -> None:
    registry, stream, clock = setup
    registry.report(stream, "q", usage((user("a"), 4, 1)))
    clock.advance(7)
    collector = CollectorRegistry(auto_describe=False)
    collector.register(SidecarCollector(ServiceStats(), _snapshot, registry.frozen_stats))
    text = render(collector).decode()
    assert 'ratelimit_sidecar_quota_allowed_total{domain="q",key="user"} 4.0' in text
    assert 'ratelimit_sidecar_quota_denied_total{domain="q",key="user"} 1.0' in text
    assert "ratelimit_sidecar_quota_buckets 1.0" in text
    assert "ratelimit_sidecar_quota_streams 1.0" in text
    assert "ratelimit_sidecar_quota_report_lag_seconds 7.0" in text
    shown = registry.describe()
    assert shown["live_buckets"] == 1
    [one] = shown["buckets"]  # type: ignore[misc]
    assert one["assignment"]["max_tokens"] == 5 and one["allowed"] == 4


def _snapshot() -> LimiterSnapshot:
    return LimiterSnapshot(counters=0, evictions=0)
