"""The config validator: every error names file, line and path; valid files are accepted."""

from __future__ import annotations

import pytest

from sidecar.config.errors import ConfigError, ConfigIssue
from sidecar.config.load import load_config
from sidecar.config.parse import MAX_DEPTH, MAX_REQUESTS_PER_UNIT
from sidecar.limiter.windows import Unit

FILE = "rules/test.yaml"

# Each case: YAML text, the line and path of the expected issue, a fragment of its message.
# The YAML is dedented; line 1 is the first non-empty line.
ERROR_CASES = {
    "yaml syntax error": (
        """
        domain: d
        descriptors:
          - key: a
            value: [unclosed
          - key: b
        """,
        5,
        "",
        "invalid YAML",
    ),
    "yaml bad indentation": (
        """
        domain: d
        descriptors:
          - key: a
           value: x
        """,
        4,
        "",
        "invalid YAML",
    ),
    "duplicate yaml key": (
        """
        domain: d
        descriptors:
          - key: a
            rate_limit:
              unit: second
              unit: minute
              requests_per_unit: 1
        """,
        6,
        "",
        "duplicate key 'unit' (first on line 5)",
    ),
    "duplicate root key": (
        """
        domain: d
        domain: e
        """,
        2,
        "",
        "duplicate key 'domain' (first on line 1)",
    ),
    "unknown key ratelimit": (
        """
        domain: d
        descriptors:
          - key: a
            ratelimit:
              unit: second
              requests_per_unit: 1
        """,
        4,
        "descriptors[0].ratelimit",
        "unknown field (expected one of descriptors, detailed_metric, key,",
    ),
    "unknown root key": (
        """
        domain: d
        descriptor:
          - key: a
        """,
        2,
        "descriptor",
        "unknown field (expected one of descriptors, domain, metadata)",
    ),
    "unknown key in replaces entry": (
        """
        domain: d
        descriptors:
          - key: a
            rate_limit:
              name: first
              unlimited: true
          - key: b
            rate_limit:
              unit: second
              requests_per_unit: 1
              replaces:
                - name: first
                  nmae: first
        """,
        13,
        "descriptors[1].rate_limit.replaces[0].nmae",
        "unknown field (expected one of name)",
    ),
    "empty domain": (
        """
        domain: ""
        descriptors: []
        """,
        1,
        "domain",
        "must be a non-empty string",
    ),
    "blank domain": (
        """
        descriptors: []
        domain: "   "
        """,
        2,
        "domain",
        "must be a non-empty string",
    ),
    "missing domain": (
        """
        descriptors:
          - key: a
        """,
        1,
        "domain",
        "must be a non-empty string",
    ),
    "domain not a string": (
        """
        domain: [a]
        """,
        1,
        "domain",
        "must be a non-empty string",
    ),
    "empty key": (
        """
        domain: d
        descriptors:
          - key: ""
            rate_limit:
              unit: second
              requests_per_unit: 1
        """,
        3,
        "descriptors[0].key",
        "must be a non-empty string",
    ),
    "missing key": (
        """
        domain: d
        descriptors:
          - value: x
            rate_limit:
              unit: second
              requests_per_unit: 1
        """,
        3,
        "descriptors[0].key",
        "must be a non-empty string",
    ),
    "nested empty key": (
        """
        domain: d
        descriptors:
          - key: a
            descriptors:
              - key: b
              - key: ""
        """,
        6,
        "descriptors[0].descriptors[1].key",
        "must be a non-empty string",
    ),
    "duplicate sibling key and value": (
        """
        domain: d
        descriptors:
          - key: a
            value: x
          - key: b
          - key: a
            value: x
        """,
        6,
        "descriptors[2]",
        "duplicate descriptor 'a=x' (first on line 3)",
    ),
    "duplicate sibling key-only": (
        """
        domain: d
        descriptors:
          - key: a
            descriptors:
              - key: b
              - key: b
        """,
        6,
        "descriptors[0].descriptors[1]",
        "duplicate descriptor 'b' (first on line 5)",
    ),
    "duplicate sibling wildcard": (
        """
        domain: d
        descriptors:
          - key: a
            value: x*
          - key: a
            value: x*
        """,
        5,
        "descriptors[1]",
        "duplicate descriptor 'a=x*' (first on line 3)",
    ),
    "empty value duplicates key-only": (
        """
        domain: d
        descriptors:
          - key: a
          - key: a
            value: ""
        """,
        4,
        "descriptors[1]",
        "duplicate descriptor 'a' (first on line 3)",
    ),
    "bad unit": (
        """
        domain: d
        descriptors:
          - key: a
            rate_limit:
              unit: fortnight
              requests_per_unit: 1
        """,
        5,
        "descriptors[0].rate_limit.unit",
        "invalid unit 'fortnight' (one of second, minute, hour, day, week, month, year)",
    ),
    "unit not a string": (
        """
        domain: d
        descriptors:
          - key: a
            rate_limit:
              requests_per_unit: 1
              unit: 60
        """,
        6,
        "descriptors[0].rate_limit.unit",
        "invalid unit 60",
    ),
    "missing unit": (
        """
        domain: d
        descriptors:
          - key: a
            rate_limit:
              requests_per_unit: 1
        """,
        5,
        "descriptors[0].rate_limit.unit",
        "is required (one of second, minute, hour, day, week, month, year)",
    ),
    "unlimited with a unit": (
        """
        domain: d
        descriptors:
          - key: a
            rate_limit:
              unlimited: true
              unit: second
        """,
        6,
        "descriptors[0].rate_limit.unit",
        "must not be set when unlimited",
    ),
    "unlimited with requests_per_unit": (
        """
        domain: d
        descriptors:
          - key: a
            rate_limit:
              unlimited: true
              requests_per_unit: 5
        """,
        6,
        "descriptors[0].rate_limit.requests_per_unit",
        "must not be set when unlimited",
    ),
    "missing requests_per_unit": (
        """
        domain: d
        descriptors:
          - key: a
            rate_limit:
              unit: second
        """,
        5,
        "descriptors[0].rate_limit.requests_per_unit",
        "is required",
    ),
    "negative requests_per_unit": (
        """
        domain: d
        descriptors:
          - key: a
            rate_limit:
              unit: second
              requests_per_unit: -1
        """,
        6,
        "descriptors[0].rate_limit.requests_per_unit",
        f"must be between 0 and {MAX_REQUESTS_PER_UNIT}, got -1",
    ),
    "too large requests_per_unit": (
        """
        domain: d
        descriptors:
          - key: a
            rate_limit:
              unit: second
              requests_per_unit: 4294967296
        """,
        6,
        "descriptors[0].rate_limit.requests_per_unit",
        f"must be between 0 and {MAX_REQUESTS_PER_UNIT}, got 4294967296",
    ),
    "fractional requests_per_unit": (
        """
        domain: d
        descriptors:
          - key: a
            rate_limit:
              unit: second
              requests_per_unit: 1.5
        """,
        6,
        "descriptors[0].rate_limit.requests_per_unit",
        "must be a whole number, got 1.5",
    ),
    "quoted requests_per_unit": (
        """
        domain: d
        descriptors:
          - key: a
            rate_limit:
              unit: second
              requests_per_unit: "10"
        """,
        6,
        "descriptors[0].rate_limit.requests_per_unit",
        "must be a whole number, got '10'",
    ),
    "boolean requests_per_unit": (
        """
        domain: d
        descriptors:
          - key: a
            rate_limit:
              unit: second
              requests_per_unit: true
        """,
        6,
        "descriptors[0].rate_limit.requests_per_unit",
        "must be a whole number, got True",
    ),
    "empty replaces name": (
        """
        domain: d
        descriptors:
          - key: a
            rate_limit:
              unit: second
              requests_per_unit: 1
              replaces:
                - name: ""
        """,
        8,
        "descriptors[0].rate_limit.replaces[0].name",
        "must be a non-empty string",
    ),
    "rule replacing itself": (
        """
        domain: d
        descriptors:
          - key: a
            rate_limit:
              name: me
              unit: second
              requests_per_unit: 1
              replaces:
                - name: me
        """,
        9,
        "descriptors[0].rate_limit.replaces[0].name",
        "a rule cannot replace itself",
    ),
    "replaces naming no rule": (
        """
        domain: d
        descriptors:
          - key: a
            rate_limit:
              name: first
              unit: second
              requests_per_unit: 1
          - key: b
            rate_limit:
              unit: second
              requests_per_unit: 1
              replaces:
                - name: frist
        """,
        13,
        "descriptors[1].rate_limit.replaces[0].name",
        "no rate_limit in this domain is named 'frist'",
    ),
    "replaces not a list": (
        """
        domain: d
        descriptors:
          - key: a
            rate_limit:
              unit: second
              requests_per_unit: 1
              replaces: other
        """,
        7,
        "descriptors[0].rate_limit.replaces",
        "must be a list of {name: ...} entries",
    ),
    "replaces entry not a mapping": (
        """
        domain: d
        descriptors:
          - key: a
            rate_limit:
              unit: second
              requests_per_unit: 1
              replaces:
                - other
        """,
        7,
        "descriptors[0].rate_limit.replaces[0]",
        "must be a mapping with a 'name'",
    ),
    "empty rule name": (
        """
        domain: d
        descriptors:
          - key: a
            rate_limit:
              name: ""
              unit: second
              requests_per_unit: 1
        """,
        5,
        "descriptors[0].rate_limit.name",
        "must be a non-empty string",
    ),
    "share_threshold without a wildcard": (
        """
        domain: d
        descriptors:
          - key: a
            value: plain
            share_threshold: true
            rate_limit:
              unit: second
              requests_per_unit: 1
        """,
        5,
        "descriptors[0].share_threshold",
        "needs a wildcard value (one containing '*')",
    ),
    "share_threshold on a key-only descriptor": (
        """
        domain: d
        descriptors:
          - key: a
            share_threshold: true
        """,
        4,
        "descriptors[0].share_threshold",
        "needs a wildcard value",
    ),
    "value of the wrong type": (
        """
        domain: d
        descriptors:
          - key: a
            value: [x, y]
        """,
        4,
        "descriptors[0].value",
        "must be a string",
    ),
    "boolean value": (
        """
        domain: d
        descriptors:
          - key: a
            value: true
        """,
        4,
        "descriptors[0].value",
        "must be a string",
    ),
    "descriptors not a list": (
        """
        domain: d
        descriptors:
          key: a
        """,
        2,
        "descriptors",
        "must be a list of descriptors",
    ),
    "descriptor not a mapping": (
        """
        domain: d
        descriptors:
          - a
        """,
        2,
        "descriptors[0]",
        "must be a mapping with a 'key'",
    ),
    "rate_limit not a mapping": (
        """
        domain: d
        descriptors:
          - key: a
            rate_limit: 10/second
        """,
        4,
        "descriptors[0].rate_limit",
        "must be a mapping",
    ),
    "non-mapping document (list)": (
        """
        - domain: d
        """,
        1,
        "",
        "expected a mapping with 'domain' and 'descriptors', got list",
    ),
    "non-mapping document (scalar)": (
        """
        just some text
        """,
        1,
        "",
        "expected a mapping with 'domain' and 'descriptors', got str",
    ),
    "empty file": (
        "",
        1,
        "",
        "expected a mapping with 'domain' and 'descriptors', got an empty file",
    ),
    "comments only": (
        """
        # nothing here yet
        """,
        1,
        "",
        "got an empty file",
    ),
    "two yaml documents": (
        """
        domain: a
        ---
        domain: b
        """,
        2,
        "",
        "invalid YAML",
    ),
}

FLAG_CASES = {
    # flag, where it sits (descriptor or rate_limit block), the line of the flag.
    "shadow_mode": "descriptors[0].shadow_mode",
    "detailed_metric": "descriptors[0].detailed_metric",
    "quota_mode": "descriptors[0].quota_mode",
    "share_threshold": "descriptors[0].share_threshold",
}


def where(issue: ConfigIssue, line: int, path: str) -> str:
    """The prefix ``str(issue)`` must start with: file, line, then the path when there is one."""
    prefix = f"{FILE}:{line}: "
    return prefix + f"{path}: " if path else prefix


@pytest.mark.parametrize(("text", "line", "path", "fragment"), list(ERROR_CASES.values()), ids=list(ERROR_CASES))
def test_error_names_file_line_and_path(h, text, line, path, fragment):
    issues = h.parse_issues(text)
    assert len(issues) == 1, [str(issue) for issue in issues]
    issue = issues[0]
    assert (issue.file, issue.line, issue.path) == (FILE, line, path)
    assert fragment in issue.message
    assert str(issue).startswith(where(issue, line, path))
    assert fragment in str(issue)


def test_typo_requestsperunit_is_named_and_the_real_field_reported_missing(h):
    issues = h.parse_issues(
        """
        domain: d
        descriptors:
          - key: a
            rate_limit:
              unit: second
              requestsperunit: 1
        """
    )
    assert [str(issue) for issue in issues] == [
        f"{FILE}:6: descriptors[0].rate_limit.requestsperunit: unknown field "
        "(expected one of algorithm, ban_duration, burst, count_past_limit, name, overload, replaces, "
        "requests_per_unit, unit, unit_multiplier, unlimited, warn_at): fix or remove it",
        f"{FILE}:5: descriptors[0].rate_limit.requests_per_unit: is required (write 0 to refuse every request, "
        "as a missing one does in envoyproxy/ratelimit)",
    ]


@pytest.mark.parametrize("flag", list(FLAG_CASES))
@pytest.mark.parametrize("bad", ['"yes"', "1", "null", "[true]"])
def test_flag_of_wrong_type(h, flag, bad):
    issues = h.parse_issues(
        f"""
        domain: d
        descriptors:
          - key: a
            value: x*
            {flag}: {bad}
        """
    )
    issue = h.issue_at(issues, FLAG_CASES[flag])
    assert issue.line == 5
    assert issue.message == "must be true or false"
    assert str(issue) == f"{FILE}:5: {FLAG_CASES[flag]}: must be true or false"


def test_unlimited_of_wrong_type(h):
    issues = h.parse_issues(
        """
        domain: d
        descriptors:
          - key: a
            rate_limit:
              unlimited: "true"
        """
    )
    issue = h.issue_at(issues, "descriptors[0].rate_limit.unlimited")
    assert (issue.line, issue.message) == (5, "must be true or false")


def test_descriptors_nested_too_deep(h):
    lines = ["domain: d"]
    for depth in range(MAX_DEPTH + 1):
        indent = "  " * (2 * depth)
        lines += [f"{indent}descriptors:", f"{indent}  - key: k{depth}"]
    issues = h.parse_issues("\n".join(lines) + "\n")
    assert len(issues) == 1
    assert issues[0].path.endswith(".descriptors")
    assert issues[0].path.count("descriptors") == MAX_DEPTH + 1
    assert f"nested deeper than {MAX_DEPTH}" in issues[0].message


def test_every_issue_is_listed_not_just_the_first(h):
    issues = h.parse_issues(
        """
        domain: ""
        descriptors:
          - key: a
            ratelimit: {}
          - key: ""
            rate_limit:
              unit: fortnight
              requests_per_unit: -3
              replaces:
                - name: nobody
          - key: c
            value: plain
            share_threshold: true
            shadow_mode: "no"
        """
    )
    assert {(issue.line, issue.path) for issue in issues} == {
        (1, "domain"),
        (4, "descriptors[0].ratelimit"),
        (5, "descriptors[1].key"),
        (7, "descriptors[1].rate_limit.unit"),
        (8, "descriptors[1].rate_limit.requests_per_unit"),
        (10, "descriptors[1].rate_limit.replaces[0].name"),
        (13, "descriptors[2].share_threshold"),
        (14, "descriptors[2].shadow_mode"),
    }
    assert all(issue.file == FILE for issue in issues)


def test_config_error_lists_every_issue(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("domain: d\ndescriptors:\n  - key: ''\n  - key: b\n    ratelimit: {}\n")
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    issues = caught.value.issues
    assert [(issue.line, issue.path) for issue in issues] == [
        (3, "descriptors[0].key"),
        (5, "descriptors[1].ratelimit"),
    ]
    assert all(issue.file == str(path) for issue in issues)
    message = str(caught.value)
    assert message.startswith(f"invalid rate limit config: {path}:3: descriptors[0].key: ")
    assert message.endswith("(and 1 more)")


def test_config_issue_str_without_line_or_path():
    assert str(ConfigIssue("f.yaml", 0, "", "boom")) == "f.yaml: boom"
    assert str(ConfigIssue("f.yaml", 3, "", "boom")) == "f.yaml:3: boom"
    assert str(ConfigIssue("f.yaml", 0, "domain", "boom")) == "f.yaml: domain: boom"
    assert str(ConfigError([])) == "invalid rate limit config: no issues"


ENVOY_STYLE = """
    # In the format of envoyproxy/ratelimit's README.
    domain: edge_proxy_per_ip
    descriptors:
      - key: remote_address
        rate_limit:
          unit: second
          requests_per_unit: 10

      - key: remote_address
        value: 50.0.0.5
        rate_limit:
          unit: second
          requests_per_unit: 25

      - key: database
        value: users
        detailed_metric: true
        rate_limit:
          name: users_db
          unit: second
          requests_per_unit: 500

      - key: to_cluster
        value: "*"
        share_threshold: true
        rate_limit:
          unit: minute
          requests_per_unit: 100

      - key: client_id
        value: foo
        descriptors:
          - key: path
            value: /foo/bar
            rate_limit:
              unit: second
              requests_per_unit: 0
          - key: path
            value: /foo/*
            shadow_mode: true
            rate_limit:
              unit: hour
              requests_per_unit: 2
          - key: path
            quota_mode: true
            rate_limit:
              unit: day
              requests_per_unit: 4294967295
              replaces:
                - name: users_db

      - key: internal
        rate_limit:
          unlimited: true
          name: internal_unlimited
"""


def test_envoy_style_file_is_accepted(h):
    domain = h.parse_domain(ENVOY_STYLE)
    assert domain.name == "edge_proxy_per_ip"
    assert domain.source == FILE
    rules = {rule.stat_key: rule for rule in domain.rules}
    assert set(rules) == {
        "edge_proxy_per_ip.remote_address",
        "edge_proxy_per_ip.remote_address_50.0.0.5",
        "edge_proxy_per_ip.database_users",
        "edge_proxy_per_ip.to_cluster_*",
        "edge_proxy_per_ip.client_id_foo.path_/foo/bar",
        "edge_proxy_per_ip.client_id_foo.path_/foo/*",
        "edge_proxy_per_ip.client_id_foo.path",
        "edge_proxy_per_ip.internal",
    }
    users = rules["edge_proxy_per_ip.database_users"]
    assert (users.name, users.requests_per_unit, users.unit, users.detailed_metric) == (
        "users_db",
        500,
        Unit.SECOND,
        True,
    )
    assert users.source == f"{FILE}:19"
    assert rules["edge_proxy_per_ip.client_id_foo.path_/foo/bar"].requests_per_unit == 0
    assert rules["edge_proxy_per_ip.client_id_foo.path_/foo/*"].shadow_mode
    quota = rules["edge_proxy_per_ip.client_id_foo.path"]
    assert quota.quota_mode
    assert quota.requests_per_unit == MAX_REQUESTS_PER_UNIT
    assert quota.replaces == frozenset({"users_db"})
    assert quota.unit_seconds == 86_400
    internal = rules["edge_proxy_per_ip.internal"]
    assert (internal.unlimited, internal.unit, internal.unit_seconds) == (True, None, 0)
    assert len({rule.counter_id for rule in domain.rules}) == len(domain.rules)


def test_example_config_is_valid():
    config = load_config("examples/config/demo.yaml")
    assert set(config.domains) == {"demo"}
    assert config.summary() == ["domain 'demo' (examples/config/demo.yaml): 7 rules, 6 limited, 1 unlimited"]


@pytest.mark.parametrize(
    ("written", "unit"),
    [
        ("second", Unit.SECOND),
        ("SECOND", Unit.SECOND),
        ("Minute", Unit.MINUTE),
        ("hOuR", Unit.HOUR),
        ("day", Unit.DAY),
        ("Week", Unit.WEEK),
        ("MONTH", Unit.MONTH),
        ("year", Unit.YEAR),
    ],
)
def test_units_are_case_insensitive(h, written, unit):
    domain = h.parse_domain(
        f"""
        domain: d
        descriptors:
          - key: a
            rate_limit:
              unit: {written}
              requests_per_unit: 1
        """
    )
    assert domain.rules[0].unit is unit


def test_metadata_is_free_form_at_root_and_descriptor(h):
    domain = h.parse_domain(
        """
        domain: d
        metadata:
          owner: team-a
          anything: [1, {nested: true}]
        descriptors:
          - key: a
            metadata:
              ticket: RL-1
              unknown_fields_are_fine_here: {x: 1}
            rate_limit:
              unit: second
              requests_per_unit: 1
        """
    )
    assert len(domain.rules) == 1


@pytest.mark.parametrize(
    ("written", "value"),
    [
        ("30", "30"),
        ("0", "0"),
        ('"007"', "007"),
        # Numbers are kept as written, not as YAML 1.1 would compute them.
        ("010", "010"),
        ("0x1F", "0x1F"),
        ("1_000", "1_000"),
        ("12:30", "12:30"),
        ("+5", "+5"),
    ],
)
def test_numeric_value_is_read_as_text(h, written, value):
    domain = h.parse_domain(
        f"""
        domain: d
        descriptors:
          - key: port
            value: {written}
            rate_limit:
              unit: second
              requests_per_unit: 1
        """
    )
    assert (("port", value)) in domain.root.exact
    assert domain.rules[0].stat_key == f"d.port_{value}"


def test_empty_domain_file_without_descriptors_is_valid(h):
    domain = h.parse_domain("domain: only_a_name\n")
    assert domain.rules == ()
    assert domain.root.nodes() == []


def test_replaces_may_name_a_rule_defined_later(h):
    domain = h.parse_domain(
        """
        domain: d
        descriptors:
          - key: a
            rate_limit:
              unit: second
              requests_per_unit: 1
              replaces:
                - name: later
          - key: b
            rate_limit:
              name: later
              unit: second
              requests_per_unit: 1
        """
    )
    assert domain.rules[0].replaces == frozenset({"later"})


def test_same_value_under_different_keys_is_not_a_duplicate(h):
    domain = h.parse_domain(
        """
        domain: d
        descriptors:
          - key: a
            value: x
          - key: b
            value: x
          - key: a
          - key: a
            value: x*
        """
    )
    assert len(domain.root.nodes()) == 4
