"""The config extensions: ``algorithm``, ``unit_multiplier``, ``burst``, ``ban_duration``, ``rate_limits``.

Every valid form is read into the rule; every invalid one gives exactly one issue naming
the file, the line and the field. Then, through ``RateLimitService.decide`` with a fake
clock: windows of N units and bans.
"""

from __future__ import annotations

from typing import Any

import pytest

from sidecar.config.model import counter_id
from sidecar.config.parse import MAX_REQUESTS_PER_UNIT, parse_duration
from sidecar.limiter.algorithms import Algorithm
from sidecar.limiter.bounds import Bans
from sidecar.limiter.memory import MemoryLimiter
from sidecar.limiter.protocol import Check
from sidecar.limiter.windows import Unit
from sidecar.protos.envoy.service.ratelimit.v3 import rls_pb2
from sidecar.service.servicer import RateLimitService

OK = rls_pb2.RateLimitResponse.OK
OVER = rls_pb2.RateLimitResponse.OVER_LIMIT
FILE = "rules/test.yaml"


def one_rule(h, block: str) -> Any:
    """The rule of a one-descriptor file whose ``rate_limit`` is ``block`` (flow style)."""
    domain = h.parse_domain(
        f"""
        domain: d
        descriptors:
          - key: k
            rate_limit: {block}
        """
    )
    (rule,) = domain.rules
    return rule


# -- valid forms ---------------------------------------------------------------------------------


def test_defaults_are_those_of_envoyproxy_ratelimit(h):
    rule = one_rule(h, "{unit: minute, requests_per_unit: 5}")
    assert rule.algorithm is Algorithm.FIXED_WINDOW
    assert (rule.unit_multiplier, rule.burst, rule.interval_us, rule.ban_seconds) == (1, 0, 0, 0)
    assert (rule.unit_seconds, rule.limit, rule.reported_unit) == (60, 5, Unit.MINUTE)
    assert rule.where == "descriptors[0].rate_limit"


@pytest.mark.parametrize(
    ("text", "algorithm"),
    [
        ("fixed_window", Algorithm.FIXED_WINDOW),
        ("sliding_window", Algorithm.SLIDING_WINDOW),
        ("token_bucket", Algorithm.TOKEN_BUCKET),
        ("Sliding_Window", Algorithm.SLIDING_WINDOW),
        ("TOKEN_BUCKET", Algorithm.TOKEN_BUCKET),
    ],
)
def test_algorithm_names(h, text, algorithm):
    assert one_rule(h, f"{{unit: second, requests_per_unit: 5, algorithm: {text}}}").algorithm is algorithm


def test_token_bucket_rate_and_burst(h):
    rule = one_rule(h, "{unit: second, requests_per_unit: 10, algorithm: token_bucket, burst: 25}")
    assert (rule.requests_per_unit, rule.burst, rule.limit, rule.interval_us) == (10, 25, 25, 100_000)
    default = one_rule(h, "{unit: minute, requests_per_unit: 30, algorithm: token_bucket}")
    assert (default.burst, default.limit, default.interval_us) == (30, 30, 2_000_000)
    smaller = one_rule(h, "{unit: second, requests_per_unit: 10, algorithm: token_bucket, burst: 1}")
    assert smaller.limit == 1


def test_token_bucket_interval_counts_the_multiplier(h):
    rule = one_rule(h, "{unit: second, requests_per_unit: 10, algorithm: token_bucket, unit_multiplier: 5}")
    assert (rule.unit_seconds, rule.interval_us) == (5, 500_000)


@pytest.mark.parametrize(
    ("unit", "multiplier", "seconds", "reported"),
    [
        ("second", 1, 1, Unit.SECOND),
        ("second", 7, 7, Unit.SECOND),
        ("second", 60, 60, Unit.MINUTE),
        ("minute", 5, 300, Unit.MINUTE),
        ("minute", 60, 3600, Unit.HOUR),
        ("hour", 24, 86_400, Unit.DAY),
        ("day", 7, 7 * 86_400, Unit.WEEK),
        ("day", 30, 30 * 86_400, Unit.MONTH),
        ("day", 365, 365 * 86_400, Unit.YEAR),
        ("year", 100, 100 * 365 * 86_400, Unit.YEAR),
    ],
)
def test_unit_multiplier(h, unit, multiplier, seconds, reported):
    rule = one_rule(h, f"{{unit: {unit}, requests_per_unit: 5, unit_multiplier: {multiplier}}}")
    assert (rule.unit_multiplier, rule.unit_seconds, rule.reported_unit) == (multiplier, seconds, reported)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("1", 1),
        ("90", 90),
        ("90s", 90),
        ("10m", 600),
        ("1h30m", 5400),
        ("1h", 3600),
        ("1d", 86_400),
        ("2d12h", 216_000),
        ("1m30s", 90),
        ("365d", 365 * 86_400),
        ("31536000", 365 * 86_400),
    ],
)
def test_ban_duration(h, text, seconds):
    assert one_rule(h, f"{{unit: second, requests_per_unit: 5, ban_duration: {text}}}").ban_seconds == seconds


def test_parse_duration():
    assert [parse_duration(value) for value in (0, 5, "5s", " 10m ", "1h1m1s", True, 1.5, "5", "5 m", "")] == [
        0,
        5,
        5,
        600,
        3661,
        None,
        None,
        None,
        None,
        None,
    ]


def test_every_extension_together_on_several_limits(h):
    domain = h.parse_domain(
        """
        domain: d
        descriptors:
          - key: user
            rate_limit: {name: fast, unit: second, requests_per_unit: 10, ban_duration: 1m}
            rate_limits:
              - name: sustained
                unit: minute
                requests_per_unit: 100
                algorithm: sliding_window
                warn_at: 0.8
              - {name: bucket, unit: second, unit_multiplier: 10, requests_per_unit: 50,
                 algorithm: token_bucket, burst: 20}
        """
    )
    node = domain.root.defaults["user"]
    assert node.rule is not None
    assert [rule.name for rule in (node.rule, *node.more)] == ["fast", "sustained", "bucket"]
    assert [rule.name for rule in domain.rules] == ["fast", "sustained", "bucket"]
    assert [rule.where for rule in domain.rules] == [
        "descriptors[0].rate_limit",
        "descriptors[0].rate_limits[0]",
        "descriptors[0].rate_limits[1]",
    ]
    assert [rule.source for rule in domain.rules] == [f"{FILE}:4", f"{FILE}:6", f"{FILE}:11"]
    fast, sustained, bucket = domain.rules
    assert (fast.ban_seconds, sustained.algorithm, sustained.warn_at) == (60, Algorithm.SLIDING_WINDOW, 0.8)
    assert (bucket.unit_seconds, bucket.limit, bucket.interval_us) == (10, 20, 200_000)
    assert len({rule.counter_id for rule in domain.rules}) == 3
    assert domain.warns


def test_rate_limits_alone(h):
    domain = h.parse_domain(
        """
        domain: d
        descriptors:
          - key: user
            rate_limits:
              - {unit: second, requests_per_unit: 1}
        """
    )
    node = domain.root.defaults["user"]
    assert node.rule is not None and node.more == ()
    assert node.rule.where == "descriptors[0].rate_limits[0]"


def test_the_same_window_with_different_algorithms_is_allowed(h):
    domain = h.parse_domain(
        """
        domain: d
        descriptors:
          - key: user
            rate_limits:
              - {unit: minute, requests_per_unit: 10}
              - {unit: minute, requests_per_unit: 10, algorithm: sliding_window}
              - {unit: second, requests_per_unit: 1, unit_multiplier: 60, algorithm: token_bucket}
        """
    )
    assert len({rule.counter_id for rule in domain.rules}) == 3


# -- counter identity ----------------------------------------------------------------------------


def test_fixed_windows_keep_the_counter_id_they_had_before_the_extensions(h):
    domain = h.parse_domain(
        """
        domain: web
        descriptors:
          - key: remote_address
            rate_limit: {unit: second, requests_per_unit: 20}
          - key: path
            value: /login
            descriptors:
              - key: user
                rate_limit: {unit: minute, requests_per_unit: 3, algorithm: fixed_window}
        """
    )
    assert [rule.counter_id for rule in domain.rules] == [
        '["web",1,[["remote_address",null]]]',
        '["web",60,[["path","/login"],["user",null]]]',
    ]


def test_other_algorithms_and_multipliers_get_their_own_counter_ids(h):
    path: list[tuple[str, str | None]] = [("k", None)]
    ids = {
        block: one_rule(h, f"{{unit: minute, requests_per_unit: 5, {block}}}").counter_id
        for block in (
            "algorithm: fixed_window",
            "algorithm: sliding_window",
            "algorithm: token_bucket",
            "unit_multiplier: 2",
            "unit_multiplier: 3",
            "unit_multiplier: 2, algorithm: sliding_window",
        )
    }
    assert len(set(ids.values())) == len(ids)
    assert ids["algorithm: sliding_window"] == '["d",60,[["k",null]],"sliding_window"]'
    assert ids["algorithm: token_bucket"] == counter_id("d", 60, path, Algorithm.TOKEN_BUCKET)
    assert ids["unit_multiplier: 2"] == '["d",120,[["k",null]]]'
    # 60 seconds is the same window as a minute, so the same counter.
    sixty = one_rule(h, "{unit: second, requests_per_unit: 5, unit_multiplier: 60}")
    assert sixty.counter_id == ids["algorithm: fixed_window"]


def test_a_plain_envoyproxy_ratelimit_file_parses_unchanged(h):
    domain = h.parse_domain(
        """
        domain: mongo_cps
        descriptors:
          - key: database
            value: users
            rate_limit:
              unit: second
              requests_per_unit: 500
          - key: database
            value: default
            rate_limit:
              unit: second
              requests_per_unit: 500
          - key: remote_address
            rate_limit:
              name: per_address
              unit: minute
              requests_per_unit: 10
            shadow_mode: true
          - key: key1
            value: value1
            descriptors:
              - key: key2
                rate_limit:
                  unit: hour
                  requests_per_unit: 1000
                  replaces:
                    - name: per_address
          - key: internal
            rate_limit:
              unlimited: true
        """
    )
    assert len(domain.rules) == 5
    for rule in domain.rules:
        assert rule.algorithm is Algorithm.FIXED_WINDOW
        assert (rule.unit_multiplier, rule.burst, rule.interval_us, rule.ban_seconds) == (1, 0, 0, 0)
        assert rule.warn_at is None
        assert rule.reported_unit is rule.unit
        assert rule.limit == rule.requests_per_unit
        assert not rule.counter_id.endswith('_window"]') and "token_bucket" not in rule.counter_id
    nodes = [domain.root.exact[("database", "users")], domain.root.defaults["remote_address"]]
    assert all(node.more == () for node in nodes)
    assert not domain.warns


# -- invalid forms: exactly one issue each -------------------------------------------------------

LIMIT_ERRORS: dict[str, tuple[str, str, str]] = {
    # name: (rate_limit block, field under descriptors[0].rate_limit, message fragment)
    "burst without token_bucket": (
        "{unit: second, requests_per_unit: 5, burst: 10}",
        "burst",
        "only applies to algorithm: token_bucket",
    ),
    "burst with sliding_window": (
        "{unit: second, requests_per_unit: 5, algorithm: sliding_window, burst: 10}",
        "burst",
        "only applies to algorithm: token_bucket",
    ),
    "burst 0": (
        "{unit: second, requests_per_unit: 5, algorithm: token_bucket, burst: 0}",
        "burst",
        f"must be a whole number between 1 and {MAX_REQUESTS_PER_UNIT}, got 0",
    ),
    "burst negative": (
        "{unit: second, requests_per_unit: 5, algorithm: token_bucket, burst: -1}",
        "burst",
        "got -1",
    ),
    "burst true": (
        "{unit: second, requests_per_unit: 5, algorithm: token_bucket, burst: true}",
        "burst",
        "got True",
    ),
    "burst text": (
        '{unit: second, requests_per_unit: 5, algorithm: token_bucket, burst: "5"}',
        "burst",
        "got '5'",
    ),
    "burst too large": (
        f"{{unit: second, requests_per_unit: 5, algorithm: token_bucket, burst: {MAX_REQUESTS_PER_UNIT + 1}}}",
        "burst",
        f"got {MAX_REQUESTS_PER_UNIT + 1}",
    ),
    "token bucket without a rate": (
        "{unit: second, requests_per_unit: 0, algorithm: token_bucket}",
        "requests_per_unit",
        "must be at least 1 for a token_bucket (it is the refill rate)",
    ),
    "token bucket without a rate but a burst": (
        "{unit: second, requests_per_unit: 0, algorithm: token_bucket, burst: 5}",
        "requests_per_unit",
        "must be at least 1 for a token_bucket",
    ),
    "token bucket with a rate that is not a number": (
        "{unit: second, requests_per_unit: lots, algorithm: token_bucket}",
        "requests_per_unit",
        "must be a whole number, got 'lots'",
    ),
    "token bucket with a rate too large": (
        f"{{unit: second, requests_per_unit: {MAX_REQUESTS_PER_UNIT + 1}, algorithm: token_bucket}}",
        "requests_per_unit",
        f"must be between 0 and {MAX_REQUESTS_PER_UNIT}",
    ),
    "unit_multiplier 0": (
        "{unit: second, requests_per_unit: 5, unit_multiplier: 0}",
        "unit_multiplier",
        "must be a whole number of at least 1, got 0",
    ),
    "unit_multiplier -1": (
        "{unit: second, requests_per_unit: 5, unit_multiplier: -1}",
        "unit_multiplier",
        "got -1",
    ),
    "unit_multiplier true": (
        "{unit: second, requests_per_unit: 5, unit_multiplier: true}",
        "unit_multiplier",
        "got True",
    ),
    "unit_multiplier text": (
        '{unit: second, requests_per_unit: 5, unit_multiplier: "5"}',
        "unit_multiplier",
        "got '5'",
    ),
    "unit_multiplier fraction": (
        "{unit: second, requests_per_unit: 5, unit_multiplier: 1.5}",
        "unit_multiplier",
        "got 1.5",
    ),
    "unit_multiplier too large": (
        "{unit: year, requests_per_unit: 5, unit_multiplier: 101}",
        "unit_multiplier",
        f"makes a window of {101 * 365 * 86_400} s, longer than a century",
    ),
    "unit_multiplier on unlimited": (
        "{unlimited: true, unit_multiplier: 2}",
        "unit_multiplier",
        "must not be set when unlimited",
    ),
    "ban_duration unknown suffix": (
        "{unit: second, requests_per_unit: 5, ban_duration: 10x}",
        "ban_duration",
        "must be a duration from 1 s to 365 d, in seconds or like 90s, 10m, 1h30m, 1d; got '10x'",
    ),
    "ban_duration 0": (
        "{unit: second, requests_per_unit: 5, ban_duration: 0}",
        "ban_duration",
        "got 0",
    ),
    "ban_duration 0s": (
        "{unit: second, requests_per_unit: 5, ban_duration: 0s}",
        "ban_duration",
        "got '0s'",
    ),
    "ban_duration negative": (
        "{unit: second, requests_per_unit: 5, ban_duration: -5}",
        "ban_duration",
        "got -5",
    ),
    "ban_duration in years": (
        "{unit: second, requests_per_unit: 5, ban_duration: 1y}",
        "ban_duration",
        "got '1y'",
    ),
    "ban_duration over a year": (
        "{unit: second, requests_per_unit: 5, ban_duration: 366d}",
        "ban_duration",
        "got '366d'",
    ),
    "ban_duration fraction": (
        "{unit: second, requests_per_unit: 5, ban_duration: 1.5}",
        "ban_duration",
        "got 1.5",
    ),
    "ban_duration true": (
        "{unit: second, requests_per_unit: 5, ban_duration: true}",
        "ban_duration",
        "got True",
    ),
    "ban_duration upper case": (
        "{unit: second, requests_per_unit: 5, ban_duration: 10M}",
        "ban_duration",
        "got '10M'",
    ),
    "ban_duration on unlimited": (
        "{unlimited: true, ban_duration: 10m}",
        "ban_duration",
        "must not be set when unlimited (nothing can go over)",
    ),
    "algorithm typo": (
        "{unit: second, requests_per_unit: 5, algorithm: sliding}",
        "algorithm",
        "invalid algorithm 'sliding' (one of fixed_window, sliding_window, token_bucket)",
    ),
    "algorithm number": (
        "{unit: second, requests_per_unit: 5, algorithm: 1}",
        "algorithm",
        "invalid algorithm 1 (one of fixed_window, sliding_window, token_bucket)",
    ),
    "algorithm typo with a burst": (
        "{unit: second, requests_per_unit: 5, algorithm: token_buckt, burst: 10}",
        "algorithm",
        "invalid algorithm 'token_buckt'",
    ),
    "algorithm on unlimited": (
        "{unlimited: true, algorithm: token_bucket}",
        "algorithm",
        "must not be set when unlimited",
    ),
    "typo of a new field": (
        "{unit: second, requests_per_unit: 5, ban_durations: 10}",
        "ban_durations",
        "unknown field (expected one of algorithm, ban_duration, burst, count_past_limit, name, overload, replaces,",
    ),
    "ban_duration as quoted digits": (
        '{unit: second, requests_per_unit: 5, ban_duration: "45"}',
        "ban_duration",
        "got '45'",
    ),
}


@pytest.mark.parametrize("name", LIMIT_ERRORS)
def test_an_invalid_limit_gives_one_issue_naming_file_line_and_field(h, name):
    block, field, fragment = LIMIT_ERRORS[name]
    issues = h.parse_issues(
        f"""
        domain: d
        descriptors:
          - key: k
            rate_limit: {block}
        """
    )
    assert len(issues) == 1, [str(issue) for issue in issues]
    assert str(issues[0]).startswith(f"{FILE}:4: descriptors[0].rate_limit.{field}: ")
    assert fragment in issues[0].message


RATE_LIMITS_ERRORS: dict[str, tuple[str, int, str, str]] = {
    # name: (the descriptor's lines after "- key: k", line, path, message fragment)
    "not a list": (
        "rate_limits: {unit: second, requests_per_unit: 1}",
        4,
        "descriptors[0].rate_limits",
        "must be a non-empty list of rate limits",
    ),
    "text": (
        "rate_limits: lots",
        4,
        "descriptors[0].rate_limits",
        "must be a non-empty list of rate limits",
    ),
    "empty": (
        "rate_limits: []",
        4,
        "descriptors[0].rate_limits",
        "must be a non-empty list of rate limits",
    ),
    "an entry not a mapping": (
        """rate_limits:
              - {unit: second, requests_per_unit: 1}
              - 5""",
        4,
        "descriptors[0].rate_limits[1]",
        "must be a mapping",
    ),
    "an entry with an error": (
        """rate_limits:
              - {unit: second, requests_per_unit: 1}
              - {unit: minute, requests_per_unit: 5, burst: 3}""",
        6,
        "descriptors[0].rate_limits[1].burst",
        "only applies to algorithm: token_bucket",
    ),
    "unlimited beside rate_limit": (
        """rate_limit: {unit: second, requests_per_unit: 1}
            rate_limits:
              - {unlimited: true}""",
        6,
        "descriptors[0].rate_limits[0]",
        "unlimited cannot be combined with other limits on the same descriptor",
    ),
    "unlimited rate_limit beside rate_limits": (
        """rate_limit: {unlimited: true}
            rate_limits:
              - {unit: second, requests_per_unit: 1}""",
        4,
        "descriptors[0].rate_limit",
        "unlimited cannot be combined with other limits on the same descriptor",
    ),
    "duplicate window and algorithm": (
        """rate_limits:
              - {unit: minute, requests_per_unit: 10}
              - {unit: minute, requests_per_unit: 20}""",
        6,
        "descriptors[0].rate_limits[1]",
        "same window (60 s) and algorithm as descriptors[0].rate_limits[0]: only the lower limit",
    ),
    "60 seconds is a minute": (
        """rate_limit: {unit: minute, requests_per_unit: 10, algorithm: sliding_window}
            rate_limits:
              - {unit: second, unit_multiplier: 60, requests_per_unit: 20, algorithm: sliding_window}""",
        6,
        "descriptors[0].rate_limits[0]",
        "same window (60 s) and algorithm as descriptors[0].rate_limit",
    ),
    "two token buckets of one window": (
        """rate_limits:
              - {unit: second, requests_per_unit: 10, algorithm: token_bucket}
              - {unit: second, requests_per_unit: 100, algorithm: token_bucket, burst: 5}""",
        6,
        "descriptors[0].rate_limits[1]",
        "same window (1 s) and algorithm as descriptors[0].rate_limits[0]: both would share one bucket",
    ),
    "two limits without a unit": (
        """rate_limits:
              - {requests_per_unit: 10}
              - {requests_per_unit: 20, unit: week}
              - {requests_per_unit: 20, unit: weeks}""",
        7,
        "descriptors[0].rate_limits[2].unit",
        "invalid unit 'weeks'",
    ),
}


@pytest.mark.parametrize("name", RATE_LIMITS_ERRORS)
def test_an_invalid_rate_limits_gives_one_issue_naming_file_line_and_path(h, name):
    lines, line, path, fragment = RATE_LIMITS_ERRORS[name]
    issues = h.parse_issues(
        f"""
        domain: d
        descriptors:
          - key: k
            {lines}
        """
    )
    if name == "two limits without a unit":
        # the missing unit is an issue of its own; what matters is that no duplicate-window issue follows
        assert [issue.path for issue in issues] == ["descriptors[0].rate_limits[0].unit", path]
        issues = issues[1:]
    assert len(issues) == 1, [str(issue) for issue in issues]
    assert str(issues[0]).startswith(f"{FILE}:{line}: {path}: ")
    assert fragment in issues[0].message


def test_errors_in_several_limits_are_all_reported(h):
    issues = h.parse_issues(
        """
        domain: d
        descriptors:
          - key: k
            rate_limits:
              - {unit: second, requests_per_unit: 1, burst: 2}
              - {unit: minute, requests_per_unit: 1, unit_multiplier: 0}
              - {unit: hour, requests_per_unit: 1, ban_duration: soon}
        """
    )
    assert [str(issue).split(": ")[1] for issue in issues] == [
        "descriptors[0].rate_limits[0].burst",
        "descriptors[0].rate_limits[1].unit_multiplier",
        "descriptors[0].rate_limits[2].ban_duration",
    ]
    assert [issue.line for issue in issues] == [5, 6, 7]


def test_replaces_may_name_one_limit_of_a_node(h):
    domain = h.parse_domain(
        """
        domain: d
        descriptors:
          - key: user
            rate_limits:
              - {name: per_second, unit: second, requests_per_unit: 10}
              - {name: per_minute, unit: minute, requests_per_unit: 100}
          - key: vip
            rate_limit: {unit: minute, requests_per_unit: 1000, replaces: [{name: per_minute}]}
        """
    )
    assert domain.rules[-1].replaces == frozenset({"per_minute"})


# -- through the service: windows of N units -----------------------------------------------------

MINUTE_START = 1_700_000_040
SEVEN_START = MINUTE_START - MINUTE_START % 7
"""The start of a 7-second window, counted from the epoch."""

RULES = """
    domain: ext
    descriptors:
      - key: seven
        rate_limit: {name: seven, unit: second, unit_multiplier: 7, requests_per_unit: 3}
      - key: sixty
        rate_limit: {name: sixty, unit: second, unit_multiplier: 60, requests_per_unit: 2}
      - key: five_minutes
        rate_limit: {unit: minute, unit_multiplier: 5, requests_per_unit: 2, algorithm: sliding_window}
      - key: banned
        rate_limit: {name: banned, unit: second, requests_per_unit: 2, ban_duration: 10}
      - key: banned_bucket
        rate_limit: {unit: second, requests_per_unit: 1, algorithm: token_bucket, ban_duration: 1m}
      - key: banned_sliding
        rate_limit: {unit: minute, requests_per_unit: 2, algorithm: sliding_window, ban_duration: 2m}
      - key: shadow_banned
        shadow_mode: true
        rate_limit: {unit: second, requests_per_unit: 1, ban_duration: 10}
      - key: other
        rate_limit: {unit: hour, requests_per_unit: 100}
"""


@pytest.fixture
def clock(h):
    return h.FakeClock(float(SEVEN_START))


@pytest.fixture
def limiter() -> MemoryLimiter:
    return MemoryLimiter()


@pytest.fixture
def service(h, clock, limiter) -> RateLimitService:
    return RateLimitService(h.config_of(RULES), limiter, clock=clock)


@pytest.fixture
def ask(h, service):
    return h.asker("ext", service)


def status_of(response: Any, index: int = 0) -> tuple[int, int, int]:
    status = response.statuses[index]
    return status.code, status.limit_remaining, status.duration_until_reset.seconds


async def test_a_window_of_seven_seconds_is_aligned_to_the_epoch(ask, clock):
    seen = []
    for offset in (0.0, 2.5, 6.75, 6.75):
        clock.now = SEVEN_START + offset
        seen.append(status_of(await ask(("seven", "a"))))
    assert seen == [(OK, 2, 7), (OK, 1, 5), (OK, 0, 1), (OVER, 0, 1)]
    clock.now = SEVEN_START + 7.0
    assert status_of(await ask(("seven", "a"))) == (OK, 2, 7), "a new window"


async def test_a_window_of_n_units_reports_its_unit(ask):
    seven = (await ask(("seven", "a"))).statuses[0].current_limit
    sixty = (await ask(("sixty", "a"))).statuses[0].current_limit
    assert (seven.name, seven.requests_per_unit, seven.unit) == ("seven", 3, Unit.SECOND)
    assert (sixty.name, sixty.requests_per_unit, sixty.unit) == ("sixty", 2, Unit.MINUTE)


async def test_sixty_seconds_reset_with_the_minute(ask, clock):
    clock.now = MINUTE_START + 45.0
    assert status_of(await ask(("sixty", "a"))) == (OK, 1, 15)


async def test_a_sliding_window_of_five_minutes(ask, clock):
    five = 300
    start = MINUTE_START - MINUTE_START % five
    clock.now = start + 10.0
    assert [status_of(await ask(("five_minutes", "a")))[0] for _ in range(3)] == [OK, OK, OVER]
    clock.now = start + five + 150.0  # half of the previous 2 still counts
    assert status_of(await ask(("five_minutes", "a"))) == (OK, 0, 150)
    assert status_of(await ask(("five_minutes", "a")))[0] == OVER


# -- through the service: bans -------------------------------------------------------------------


async def test_over_limit_bans_the_counter_for_ban_duration_even_in_later_windows(ask, clock):
    start = float(MINUTE_START)
    clock.now = start
    assert [status_of(await ask(("banned", "a")))[0] for _ in range(3)] == [OK, OK, OVER]
    for offset in (1.0, 5.0, 9.75):  # new one-second windows, still banned
        clock.now = start + offset
        assert (await ask(("banned", "a"))).overall_code == OVER, offset
    clock.now = start + 10.0
    assert [status_of(await ask(("banned", "a")))[0] for _ in range(3)] == [OK, OK, OVER]


async def test_a_banned_descriptor_resets_when_its_ban_ends(ask, clock):
    start = float(MINUTE_START)
    clock.now = start
    for _ in range(3):
        await ask(("banned", "a"))
    clock.now = start + 2.5  # a later one-second window: the window would reset in 1 s
    assert status_of(await ask(("banned", "a"))) == (OVER, 0, 8)


async def test_requests_during_a_ban_do_not_extend_it(ask, clock):
    start = float(MINUTE_START)
    clock.now = start
    for _ in range(3):
        await ask(("banned", "a"))
    for step in range(40):  # keeps hammering through the whole ban
        clock.now = start + step / 4
        assert (await ask(("banned", "a"))).overall_code == OVER
    clock.now = start + 10.0
    assert (await ask(("banned", "a"))).overall_code == OK


async def test_a_ban_is_per_counter(ask, clock):
    clock.now = float(MINUTE_START)
    for _ in range(3):
        await ask(("banned", "a"))
    assert (await ask(("banned", "b"))).overall_code == OK
    assert (await ask(("banned", "a"))).overall_code == OVER


async def test_other_descriptors_of_a_banned_request_consume_nothing(ask, clock):
    clock.now = float(MINUTE_START)
    for _ in range(3):
        await ask(("banned", "a"))
    clock.now += 2.0
    for _ in range(5):
        response = await ask(("other", "x"), ("banned", "a"))
        assert [status.code for status in response.statuses] == [OK, OVER]
    assert (await ask(("other", "x"))).statuses[0].limit_remaining == 99


async def test_a_counter_refused_because_of_another_is_not_banned(ask, clock):
    clock.now = float(MINUTE_START)
    for _ in range(2):
        await ask(("banned", "b"))
    refused = await ask(("banned", "a"), ("banned", "b"))
    assert [status.code for status in refused.statuses] == [OK, OVER]
    assert status_of(await ask(("banned", "a")))[:2] == (OK, 1), "a took nothing from the refused request"
    assert status_of(await ask(("banned", "a")))[:2] == (OK, 0), "and is not banned"
    clock.now += 1.0
    assert (await ask(("banned", "b"))).overall_code == OVER, "b is"


async def test_a_token_bucket_ban(ask, clock):
    clock.now = float(MINUTE_START)
    assert [(await ask(("banned_bucket", "a"))).overall_code for _ in range(2)] == [OK, OVER]
    clock.now += 59.75  # the bucket is long full again, but the ban holds
    assert (await ask(("banned_bucket", "a"))).overall_code == OVER
    clock.now += 0.25
    assert (await ask(("banned_bucket", "a"))).overall_code == OK


async def test_a_sliding_window_ban(ask, clock):
    clock.now = float(MINUTE_START)
    assert [(await ask(("banned_sliding", "a"))).overall_code for _ in range(3)] == [OK, OK, OVER]
    clock.now += 119.0
    assert (await ask(("banned_sliding", "a"))).overall_code == OVER
    clock.now += 1.0
    assert (await ask(("banned_sliding", "a"))).overall_code == OK


async def test_a_shadow_rule_with_a_ban_never_refuses(ask, clock):
    clock.now = float(MINUTE_START)
    for _ in range(5):
        response = await ask(("shadow_banned", "a"), ("other", "y"))
        assert response.overall_code == OK
        assert response.statuses[0].code == OK
    assert (await ask(("other", "y"))).statuses[0].limit_remaining == 94


def test_bans_are_bounded_and_never_extended():
    bans = Bans(3)
    bans.ban(("a",), 100.0, 0.0)
    bans.ban(("a",), 200.0, 50.0)
    assert bans.active(("a",), 99.0) and not bans.active(("a",), 100.0), "a running ban is not extended"
    bans.ban(("a",), 300.0, 150.0)
    assert bans.active(("a",), 299.0), "a ban that ran out can be set again"
    for key in "bcd":
        bans.ban((key,), 400.0, 160.0)
    assert len(bans) == 3
    assert not bans.active(("a",), 170.0), "the oldest ban made room"
    assert all(bans.active((key,), 170.0) for key in "bcd")


def test_bans_that_ran_out_are_forgotten_before_live_ones():
    bans = Bans(10_000)
    for index in range(5_000):
        bans.ban((str(index),), 10.0, 0.0)
    for index in range(5_000, 10_000):
        bans.ban((str(index),), 100.0, 20.0)
    assert all(bans.active((str(index),), 50.0) for index in range(5_000, 10_000))
    assert len(bans) < 10_000


def test_a_flood_of_bans_at_the_cap_stays_cheap():
    bans = Bans(1_000)
    calls = 0
    original = bans.expire

    def counted(now: float) -> None:
        nonlocal calls
        calls += 1
        original(now)

    bans.expire = counted  # type: ignore[method-assign]
    for index in range(20_000):
        bans.ban((str(index),), 1e12, 0.0)
    assert len(bans) == 1_000
    assert calls <= 20_000 // 1_000 + 1, "an expiry reads every ban: not one per new ban"


def test_memory_bans_check_before_the_algorithm():
    limiter = MemoryLimiter()
    check = Check(("k",), 1, 1, 1, ban_seconds=5)
    assert [limiter.check_now([check], 100.0).admitted for _ in range(2)] == [True, False]
    decision = limiter.check_now([check._replace(hits=0)], 101.0)
    assert (decision.admitted, decision.over, decision.counts) == (False, (True,), (2,))
    assert limiter.check_now([check], 105.0).admitted


# -- overload: suppress ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("block", "suppress"),
    [
        ("{unit: second, requests_per_unit: 5}", False),
        ("{unit: second, requests_per_unit: 5, overload: refuse}", False),
        ("{unit: second, requests_per_unit: 5, overload: suppress}", True),
        ("{unit: second, requests_per_unit: 5, overload: suppress, algorithm: sliding_window}", True),
    ],
)
def test_overload_option(h, block, suppress):
    assert one_rule(h, block).suppress is suppress


@pytest.mark.parametrize(
    ("block", "message"),
    [
        ("{unit: second, requests_per_unit: 5, overload: drop}", "must be one of refuse, suppress, got 'drop'"),
        ("{unit: second, requests_per_unit: 5, overload: suppress, algorithm: token_bucket}", "not to a token_bucket"),
        ("{unlimited: true, overload: suppress}", "must not be set when unlimited"),
    ],
)
def test_overload_refused_where_it_cannot_apply(h, block, message):
    issues = h.parse_issues(
        f"""
        domain: d
        descriptors:
          - key: k
            rate_limit: {block}
        """
    )
    issue = h.issue_at(issues, "descriptors[0].rate_limit.overload")
    assert message in issue.message and issue.file == FILE and issue.line == 4
