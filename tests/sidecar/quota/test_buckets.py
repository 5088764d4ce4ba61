"""Quota mode: the bucket id convention and rule -> assignment."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sidecar.quota.assignments import Assignment, Kind, assign, assign_rules, fill_of
from sidecar.quota.buckets import BucketIdError, DescriptorEntry, ParsedBucket, bucket_key, bucket_of, parse_bucket

RULES = """
domain: q
descriptors:
  - key: per_second
    rate_limit: {unit: second, requests_per_unit: 5}
  - key: per_minute
    rate_limit: {unit: minute, requests_per_unit: 7}
  - key: two_hours
    rate_limit: {unit: hour, unit_multiplier: 2, requests_per_unit: 30}
  - key: free
    rate_limit: {unlimited: true}
  - key: probe
    shadow_mode: true
    rate_limit: {unit: minute, requests_per_unit: 2}
  - key: closed
    rate_limit: {unit: minute, requests_per_unit: 0}
  - key: bucket
    rate_limit: {unit: minute, requests_per_unit: 100, algorithm: token_bucket, burst: 20}
  - key: fast_bucket
    rate_limit: {unit: second, requests_per_unit: 10, algorithm: token_bucket, burst: 3}
  - key: several
    rate_limits:
      - {unit: second, requests_per_unit: 10}
      - {unit: minute, requests_per_unit: 100}
  - key: sliding
    rate_limit: {unit: minute, requests_per_unit: 9, algorithm: sliding_window}
"""

keys = st.text(st.characters(codec="utf-8", exclude_characters="\x00"), min_size=1, max_size=20)
values = st.text(st.characters(codec="utf-8"), max_size=30)


@given(st.text(min_size=1, max_size=30), st.lists(st.tuples(keys, values), min_size=1, max_size=32))
def test_any_descriptor_round_trips_through_the_convention(domain: str, entries: list[tuple[str, str]]) -> None:
    parsed = parse_bucket(bucket_of(domain, entries))
    assert parsed == ParsedBucket(domain, tuple(DescriptorEntry(key, value) for key, value in entries))


def test_the_documented_example() -> None:
    bucket = {"domain": "edge", "entry.0.remote_address": "10.0.0.1"}
    assert parse_bucket(bucket) == ParsedBucket("edge", (DescriptorEntry("remote_address", "10.0.0.1"),))
    assert bucket_of("edge", [("remote_address", "10.0.0.1")]) == bucket


def test_keys_may_hold_dots_and_map_order_does_not_matter() -> None:
    bucket = {"entry.1.b.c": "2", "domain": "d", "entry.0.a": "1"}
    assert parse_bucket(bucket).entries == (DescriptorEntry("a", "1"), DescriptorEntry("b.c", "2"))
    assert bucket_key(bucket) == bucket_key(dict(reversed(bucket.items())))


@pytest.mark.parametrize(
    ("bucket", "reason"),
    [
        ({"entry.0.a": "1"}, "missing_domain"),
        ({"domain": "", "entry.0.a": "1"}, "bad_domain"),
        ({"domain": "d"}, "no_entries"),
        ({"domain": "d", "entry.0.a": "1", "entry.2.b": "2"}, "index_gap"),
        ({"domain": "d", "entry.1.a": "1"}, "index_gap"),
        ({"domain": "d", "entry.x.a": "1"}, "bad_index"),
        ({"domain": "d", "entry.-1.a": "1"}, "bad_index"),
        ({"domain": "d", "entry.00.a": "1"}, "bad_index"),
        ({"domain": "d", "entry. 0.a": "1"}, "bad_index"),
        ({"domain": "d", "entry.0": "1"}, "bad_index"),
        ({"domain": "d", "entry.0.": "1"}, "bad_key"),
        ({"domain": "d", "entry.0.a": "1", "entry.0.b": "2"}, "duplicate_index"),
        ({"domain": "d", "client": "1"}, "unknown_field"),
        ({"domain": "d", "entry.0.a": "v" * 5000}, "too_long"),
        ({"domain": "d", **{f"entry.{i}.k": "v" for i in range(40)}}, "too_many_entries"),
        ({"domain": "d", "entry.99999.a": "1"}, "too_many_entries"),
    ],
)
def test_ids_outside_the_convention_are_refused_with_a_reason(bucket: dict[str, str], reason: str) -> None:
    with pytest.raises(BucketIdError) as caught:
        parse_bucket(bucket)
    assert caught.value.reason == reason


def bucket_assignment(h: SimpleNamespace, *entries: tuple[str, str], instances: int = 1) -> Assignment:
    return assign(h.config_of(RULES), ParsedBucket("q", tuple(DescriptorEntry(*e) for e in entries)), instances)


def bucket(assignment: Assignment) -> tuple[Kind, int, int, int]:
    return assignment.envoy_fields()


def test_window_limits_become_token_buckets_refilled_over_the_window(h: SimpleNamespace) -> None:
    assert bucket(bucket_assignment(h, ("per_second", "x"))) == (Kind.TOKEN_BUCKET, 5, 5, 1)
    assert bucket(bucket_assignment(h, ("per_minute", "x"))) == (Kind.TOKEN_BUCKET, 7, 7, 60)
    assert bucket(bucket_assignment(h, ("two_hours", "x"))) == (Kind.TOKEN_BUCKET, 30, 30, 7200)
    assert bucket(bucket_assignment(h, ("sliding", "x"))) == (Kind.TOKEN_BUCKET, 9, 9, 60)


def test_token_bucket_rules_keep_burst_and_an_exact_rate_in_whole_seconds(h: SimpleNamespace) -> None:
    # 100 per minute = 5 tokens every 3 s (gcd 20); 10 per second = 10 every second.
    assert bucket(bucket_assignment(h, ("bucket", "x"))) == (Kind.TOKEN_BUCKET, 20, 5, 3)
    assert bucket(bucket_assignment(h, ("fast_bucket", "x"))) == (Kind.TOKEN_BUCKET, 3, 10, 1)


def test_several_limits_become_one_bucket_at_least_as_tight_as_each(h: SimpleNamespace) -> None:
    found = bucket_assignment(h, ("several", "x"))
    # The smallest size (10, of the per-second limit), the slowest rate (100 per minute).
    assert bucket(found) == (Kind.TOKEN_BUCKET, 10, 100, 60)
    assert found.why == "several_limits"


def test_unlimited_shadow_and_zero_limits(h: SimpleNamespace) -> None:
    assert bucket_assignment(h, ("free", "x")).kind is Kind.ALLOW_ALL
    shadow = bucket_assignment(h, ("probe", "x"))
    assert (shadow.kind, shadow.why, shadow.rule is not None) == (Kind.ALLOW_ALL, "shadow", True)
    assert bucket_assignment(h, ("closed", "x")).kind is Kind.DENY_ALL


def test_unknown_domain_and_no_match_get_the_allow_all_default(h: SimpleNamespace) -> None:
    config = h.config_of(RULES)
    unknown = assign(config, ParsedBucket("nope", (DescriptorEntry("per_second", "x"),)))
    assert (unknown.kind, unknown.why, unknown.rule) == (Kind.ALLOW_ALL, "unknown_domain", None)
    nothing = assign(config, ParsedBucket("q", (DescriptorEntry("other", "x"),)))
    assert (nothing.kind, nothing.why) == (Kind.ALLOW_ALL, "no_match")


def test_global_shadow_mode_allows_everything_but_keeps_the_rule(h: SimpleNamespace) -> None:
    config = h.config_of(RULES)
    found = assign(config, ParsedBucket("q", (DescriptorEntry("per_second", "x"),)), admit_all=True)
    assert (found.kind, found.why, found.rule is not None) == (Kind.ALLOW_ALL, "shadow_mode", True)


def test_instances_divide_like_the_memory_backend(h: SimpleNamespace) -> None:
    assert bucket(bucket_assignment(h, ("per_second", "x"), instances=2)) == (Kind.TOKEN_BUCKET, 3, 3, 1)
    assert bucket(bucket_assignment(h, ("per_minute", "x"), instances=3)) == (Kind.TOKEN_BUCKET, 3, 3, 60)
    # Burst ceil(20 / 3) = 7; rate 100 per 180 s = 5 every 9 s.
    assert bucket(bucket_assignment(h, ("bucket", "x"), instances=3)) == (Kind.TOKEN_BUCKET, 7, 5, 9)


@given(st.integers(1, 2**32 - 1), st.integers(1, 10**9))
def test_fills_are_whole_seconds_and_never_faster_than_the_rate(tokens: int, seconds: int) -> None:
    from fractions import Fraction

    per_fill, fill = fill_of(Fraction(tokens, seconds))
    assert fill >= 1
    assert 1 <= per_fill <= 2**32 - 1
    assert Fraction(per_fill, fill) <= Fraction(tokens, seconds)


def test_rules_outside_the_tree_are_never_assigned_a_sub_second_fill(h: SimpleNamespace) -> None:
    for rule in h.config_of(RULES).domains["q"].rules:
        found = assign_rules([rule])
        assert found.kind is not Kind.TOKEN_BUCKET or found.fill_seconds >= 1
