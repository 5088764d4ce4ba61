"""Configs of envoyproxy/ratelimit's documented format: what it accepts loads here, what it
refuses is refused here, and the stricter checks of ours say how to fix the file.

The fixtures are written from the reference's README (the descriptor list and rate
limit definitions, replaces, shadow_mode, detailed_metric, value_to_metric,
share_threshold, wildcards, MERGE_DOMAIN_CONFIG, metadata, units) and its config
loader's documented errors; none is copied from its repository.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from sidecar.config.errors import ConfigError
from sidecar.config.load import LoadOptions, load_config, parse_text
from sidecar.config.match import value_stat_key
from sidecar.limiter.windows import CALENDAR_MONTH, seconds_until_reset, window_start
from tests.conftest import Entry

ACCEPTED = {
    "one limit": """
        domain: mongo_cps
        descriptors:
          - key: database
            value: users
            rate_limit: {unit: second, requests_per_unit: 500}
          - key: database
            value: default
            rate_limit: {unit: second, requests_per_unit: 500}
        """,
    "nested, a key-only default and an allow-listed leaf": """
        domain: messaging
        descriptors:
          - key: message_type
            value: marketing
            descriptors:
              - key: to_number
                rate_limit: {unit: day, requests_per_unit: 5}
          - key: to_number
            rate_limit: {unit: day, requests_per_unit: 100}
          - key: internal
        """,
    "every unit, in any case": """
        domain: units
        descriptors:
          - {key: a, rate_limit: {unit: SECOND, requests_per_unit: 1}}
          - {key: b, rate_limit: {unit: Minute, requests_per_unit: 1}}
          - {key: c, rate_limit: {unit: hour, requests_per_unit: 1}}
          - {key: d, rate_limit: {unit: day, requests_per_unit: 1}}
          - {key: e, rate_limit: {unit: week, requests_per_unit: 1}}
          - {key: f, rate_limit: {unit: month, requests_per_unit: 1}}
          - {key: g, rate_limit: {unit: year, requests_per_unit: 1}}
        """,
    "unlimited, replaces, shadow and quota mode": """
        domain: flags
        descriptors:
          - key: remote_address
            value: 10.0.0.1
            rate_limit: {unlimited: true}
          - key: category
            value: read
            shadow_mode: true
            rate_limit: {name: read, unit: minute, requests_per_unit: 100}
          - key: endpoint
            value: special
            quota_mode: true
            rate_limit:
              unit: minute
              requests_per_unit: 1000
              replaces:
                - name: read
        """,
    "detailed_metric, value_to_metric and metadata": """
        domain: metrics
        descriptors:
          - key: route
            value_to_metric: true
            metadata: {team: search, tier: {level: 2}}
            descriptors:
              - key: http_method
                detailed_metric: true
                rate_limit: {unit: minute, requests_per_unit: 60}
        """,
    "wildcards: trailing, middle, several, shared": """
        domain: wildcards
        descriptors:
          - {key: key1, value: value*, rate_limit: {unit: minute, requests_per_unit: 20}}
          - {key: path, value: /api/*/action, rate_limit: {unit: minute, requests_per_unit: 20}}
          - {key: route, value: /api/*/resource/*/action, rate_limit: {unit: minute, requests_per_unit: 20}}
          - {key: files, value: files/*, share_threshold: true, rate_limit: {unit: hour, requests_per_unit: 10}}
          - {key: nofiles, value: nofiles/*, share_threshold: false, rate_limit: {unit: hour, requests_per_unit: 10}}
        """,
    "a rate limit of 0 and a numeric value": """
        domain: zero
        descriptors:
          - key: status
            value: 500
            rate_limit: {unit: second, requests_per_unit: 0}
        """,
}

REFUSED = {
    "a descriptor without a key": ("domain: d\ndescriptors:\n  - value: v\n", "key: must be a non-empty string"),
    "an empty domain": ("domain: ''\ndescriptors: []\n", "domain: must be a non-empty string"),
    "a duplicate descriptor": (
        "domain: d\ndescriptors:\n  - {key: k, value: v}\n  - {key: k, value: v}\n",
        "duplicate descriptor 'k=v'",
    ),
    "an invalid unit": (
        "domain: d\ndescriptors:\n  - {key: k, rate_limit: {unit: fortnight, requests_per_unit: 1}}\n",
        "invalid unit 'fortnight'",
    ),
    "a unit on an unlimited rule": (
        "domain: d\ndescriptors:\n  - {key: k, rate_limit: {unlimited: true, unit: second}}\n",
        "unit: must not be set when unlimited",
    ),
    "share_threshold without a wildcard": (
        "domain: d\ndescriptors:\n  - {key: k, value: v, share_threshold: true}\n",
        "needs a wildcard value",
    ),
    "an empty replaces name": (
        "domain: d\ndescriptors:\n  - {key: k, rate_limit: {unit: second, requests_per_unit: 1, "
        "replaces: [{name: ''}]}}\n",
        "name: must be a non-empty string",
    ),
    "a rule replacing itself": (
        "domain: d\ndescriptors:\n  - {key: k, rate_limit: {name: a, unit: second, requests_per_unit: 1, "
        "replaces: [{name: a}]}}\n",
        "a rule cannot replace itself",
    ),
    "an unknown key": ("domain: d\ndescriptors:\n  - {key: k, ratelimit: {}}\n", "unknown field"),
    "a list of something else than mappings": ("domain: d\ndescriptors:\n  - 1\n", "must be a mapping"),
    "YAML that does not parse": ("domain: d\ndescriptors: [\n", "invalid YAML"),
}

OURS_ONLY = {
    "replaces naming no rule": (
        "domain: d\ndescriptors:\n  - {key: k, rate_limit: {unit: second, requests_per_unit: 1, "
        "replaces: [{name: x}]}}\n",
        "(fix the name, or remove the entry)",
    ),
    "a missing requests_per_unit": (
        "domain: d\ndescriptors:\n  - {key: k, rate_limit: {unit: second}}\n",
        "write 0 to refuse every request",
    ),
    "requests_per_unit on an unlimited rule": (
        "domain: d\ndescriptors:\n  - {key: k, rate_limit: {unlimited: true, requests_per_unit: 3}}\n",
        "(remove it, or remove unlimited)",
    ),
    "an empty rule name": (
        "domain: d\ndescriptors:\n  - {key: k, rate_limit: {name: '', unit: second, requests_per_unit: 1}}\n",
        "(remove it for no name)",
    ),
    "a misplaced field": ("domain: d\ndescriptors:\n  - {key: k, unit: second}\n", "fix or remove it"),
    "metadata that is not a mapping": (
        "domain: d\ndescriptors:\n  - {key: k, metadata: [1, 2]}\n",
        "must be a mapping, got list (metadata becomes a google.protobuf.Struct)",
    ),
}


@pytest.mark.parametrize("text", ACCEPTED.values(), ids=ACCEPTED.keys())
def test_what_the_reference_accepts_loads(text: str) -> None:
    domain, issues = parse_text(textwrap.dedent(text).lstrip(), "ref.yaml")
    assert issues == [], [str(issue) for issue in issues]
    assert domain is not None


@pytest.mark.parametrize(("text", "fragment"), REFUSED.values(), ids=REFUSED.keys())
def test_what_the_reference_refuses_is_refused(text: str, fragment: str) -> None:
    _, issues = parse_text(text, "ref.yaml")
    assert any(fragment in str(issue) for issue in issues), [str(issue) for issue in issues]


@pytest.mark.parametrize(("text", "hint"), OURS_ONLY.values(), ids=OURS_ONLY.keys())
def test_checks_the_reference_does_not_make_say_how_to_fix_the_file(text: str, hint: str) -> None:
    _, issues = parse_text(text, "ref.yaml")
    assert any(hint in str(issue) for issue in issues), [str(issue) for issue in issues]


# -- MERGE_DOMAIN_CONFIG -------------------------------------------------------------------------


def write(directory: Path, name: str, text: str) -> Path:
    path = directory / name
    path.write_text(textwrap.dedent(text).lstrip())
    return path


MERGE = LoadOptions(merge_domains=True)


def test_one_domain_over_several_files_needs_merging(tmp_path: Path) -> None:
    write(
        tmp_path,
        "a.yaml",
        "domain: shop\ndescriptors:\n  - {key: user, rate_limit: {name: u, unit: minute, requests_per_unit: 5}}\n",
    )
    write(
        tmp_path,
        "b.yaml",
        "domain: shop\ndescriptors:\n  - {key: ip, rate_limit: {unit: minute, requests_per_unit: 9, "
        "replaces: [{name: u}]}}\n",
    )
    plain = tmp_path / "plain"
    plain.mkdir()
    write(plain, "a.yaml", "domain: shop\ndescriptors:\n  - {key: user}\n")
    write(plain, "b.yaml", "domain: shop\ndescriptors:\n  - {key: ip}\n")
    with pytest.raises(ConfigError, match="MERGE_DOMAIN_CONFIG=true"):
        load_config(plain)
    (plain / "a.yaml").unlink()
    (plain / "b.yaml").unlink()
    plain.rmdir()
    # Merged, a replaces may name a rule of another file.
    config = load_config(tmp_path, options=MERGE)
    domain = config.domains["shop"]
    assert sorted(domain.root.defaults) == ["ip", "user"]
    assert [rule.requests_per_unit for rule in domain.rules] == [5, 9]
    assert domain.sources == (str(tmp_path / "a.yaml"), str(tmp_path / "b.yaml"))


def test_a_descriptor_in_two_merged_files_names_both(tmp_path: Path) -> None:
    first = write(
        tmp_path,
        "a.yaml",
        "domain: shop\ndescriptors:\n  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 5}\n",
    )
    second = write(
        tmp_path,
        "b.yaml",
        "domain: shop\ndescriptors:\n  - key: user\n    rate_limit: {unit: hour, requests_per_unit: 50}\n",
    )
    with pytest.raises(ConfigError) as refused:
        load_config(tmp_path, options=MERGE)
    (issue,) = refused.value.issues
    assert issue.file == str(second)
    assert f"duplicate descriptor 'user' in domain 'shop', also in {first}:4" in issue.message  # its rule's line


def test_merged_replaces_must_still_name_a_rule(tmp_path: Path) -> None:
    write(
        tmp_path,
        "a.yaml",
        "domain: shop\ndescriptors:\n  - {key: user, rate_limit: {unit: minute, requests_per_unit: 5}}\n",
    )
    write(
        tmp_path,
        "b.yaml",
        "domain: shop\ndescriptors:\n  - {key: ip, rate_limit: {unit: minute, requests_per_unit: 9, "
        "replaces: [{name: nope}]}}\n",
    )
    with pytest.raises(ConfigError, match="named 'nope'"):
        load_config(tmp_path, options=MERGE)


# -- value_to_metric -----------------------------------------------------------------------------


def stat(text: str, *entries: tuple[str, str]) -> str:
    domain, issues = parse_text(textwrap.dedent(text).lstrip(), "ref.yaml")
    assert domain is not None, [str(issue) for issue in issues]
    return value_stat_key(domain, [Entry(key, value) for key, value in entries])


def test_value_to_metric_puts_request_values_in_the_stat_key() -> None:
    text = """
        domain: example10
        descriptors:
          - key: route
            value_to_metric: true
            descriptors:
              - key: http_method
                value_to_metric: true
                descriptors:
                  - key: subject_id
                    rate_limit: {unit: minute, requests_per_unit: 60}
        """
    key = stat(text, ("route", "api"), ("http_method", "GET"), ("subject_id", "123"))
    assert key == "example10.route_api.http_method_GET.subject_id"


def test_value_to_metric_with_wildcards_and_shared_thresholds() -> None:
    text = """
        domain: w
        descriptors:
          - key: user
            value_to_metric: true
            descriptors:
              - key: action
                value: read*
                value_to_metric: true
                descriptors:
                  - key: resource
                    rate_limit: {unit: minute, requests_per_unit: 100}
          - key: route
            value: api/*
            share_threshold: true
            value_to_metric: true
            descriptors:
              - key: method
                rate_limit: {unit: minute, requests_per_unit: 60}
        """
    assert stat(text, ("user", "alice"), ("action", "readfile"), ("resource", "docs")) == (
        "w.user_alice.action_readfile.resource"
    )
    # share_threshold wins: the pattern, not the value (the values share one counter).
    assert stat(text, ("route", "api/v1"), ("method", "GET")) == "w.route_api/*.method"


# -- calendar months -----------------------------------------------------------------------------


def test_calendar_months_are_opt_in_and_fixed_windows_only() -> None:
    text = "domain: m\ndescriptors:\n  - {key: k, rate_limit: {unit: month, requests_per_unit: 1000}}\n"
    plain, _ = parse_text(text, "m.yaml")
    calendar, _ = parse_text(text, "m.yaml", options=LoadOptions(calendar_months=True))
    assert plain is not None and calendar is not None
    assert plain.rules[0].unit_seconds == 30 * 86_400
    assert calendar.rules[0].unit_seconds == CALENDAR_MONTH
    assert calendar.rules[0].counter_id != plain.rules[0].counter_id
    sliding = (
        "domain: m\ndescriptors:\n  - {key: k, rate_limit: {unit: month, requests_per_unit: 9, "
        "algorithm: sliding_window}}\n"
    )
    _, issues = parse_text(sliding, "m.yaml", options=LoadOptions(calendar_months=True))
    assert any("calendar months (--calendar-months) are fixed windows" in str(issue) for issue in issues)


def test_a_calendar_month_window_is_the_utc_month() -> None:
    february_10 = 1_707_523_200.0  # 2024-02-10T00:00:00Z, a leap year
    assert window_start(february_10, CALENDAR_MONTH) == 1_706_745_600  # 2024-02-01
    assert seconds_until_reset(february_10, CALENDAR_MONTH) == 20 * 86_400  # to 2024-03-01
    december_31 = 1_704_067_199.0  # 2023-12-31T23:59:59Z
    assert seconds_until_reset(december_31, CALENDAR_MONTH) == 1
