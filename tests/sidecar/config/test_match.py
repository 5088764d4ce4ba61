"""The matcher: which rule a descriptor lands on, and which counter it spends."""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.config.load import parse_text
from sidecar.config.match import detailed_stat_key, match_descriptor
from sidecar.config.model import wildcard_matcher


def rule(name: str, requests: int = 1, unit: str = "second") -> str:
    return f"{{name: {name}, unit: {unit}, requests_per_unit: {requests}}}"


def names(domain, *requests: list[tuple[str, str]], entry=None) -> list[str | None]:
    """The name of the rule each request lands on, None when none applies."""
    found = []
    for pairs in requests:
        match = match_descriptor(domain, [entry(key, value) for key, value in pairs])
        found.append(None if match is None else match.rule.name)
    return found


@pytest.fixture(scope="module")
def precedence(h):
    return h.parse_domain(
        f"""
        domain: m
        descriptors:
          - key: k
            rate_limit: {rule("default")}
            descriptors:
              - key: n
                rate_limit: {rule("default.default")}
              - key: n
                value: "v*"
                rate_limit: {rule("default.wild")}
              - key: n
                value: vip
                rate_limit: {rule("default.exact")}
          - key: k
            value: exact
            rate_limit: {rule("exact")}
            descriptors:
              - key: n
                value: vip
                rate_limit: {rule("exact.exact")}
              - key: n
                value: "v*"
                rate_limit: {rule("exact.wild")}
              - key: n
                rate_limit: {rule("exact.default")}
          - key: k
            value: "ex*"
            rate_limit: {rule("wild")}
            descriptors:
              - key: n
                rate_limit: {rule("wild.default")}
              - key: n
                value: vip
                rate_limit: {rule("wild.exact")}
        """
    )


@pytest.mark.parametrize(
    ("pairs", "expected"),
    [
        ([("k", "exact")], "exact"),
        ([("k", "exam")], "wild"),
        ([("k", "ex")], "wild"),
        ([("k", "other")], "default"),
        ([("k", "")], "default"),
        ([("k", "exact"), ("n", "vip")], "exact.exact"),
        ([("k", "exact"), ("n", "very")], "exact.wild"),
        ([("k", "exact"), ("n", "x")], "exact.default"),
        ([("k", "exit"), ("n", "vip")], "wild.exact"),
        ([("k", "exit"), ("n", "very")], "wild.default"),
        ([("k", "zzz"), ("n", "vip")], "default.exact"),
        ([("k", "zzz"), ("n", "very")], "default.wild"),
        ([("k", "zzz"), ("n", "no")], "default.default"),
        ([("other", "exact")], None),
        ([("K", "exact")], None),
        ([("k", "exact"), ("m", "vip")], None),
    ],
)
def test_exact_beats_wildcard_beats_key_only_at_each_level(h, precedence, pairs, expected):
    assert names(precedence, pairs, entry=h.Entry) == [expected]


def test_works_with_protobuf_entries(h, precedence):
    request = h.descriptor(("k", "exact"), ("n", "vip"))
    match = match_descriptor(precedence, request.entries)
    assert match is not None
    assert match.rule.name == "exact.exact"


@pytest.mark.parametrize(
    ("pattern", "value", "expected"),
    [
        ("foo*", "foo", True),
        ("foo*", "foobar", True),
        ("foo*", "fo", False),
        ("foo*", "xfoo", False),
        ("a*b", "ab", True),
        ("a*b", "a--b", True),
        ("a*b", "a\nb", True),
        ("a*b", "abc", False),
        ("a*b", "cab", False),
        ("x*y*z", "xyz", True),
        ("x*y*z", "x1y2z", True),
        ("x*y*z", "xzy", False),
        ("x*y*z", "xyzq", False),
        ("*", "", True),
        ("*", "anything at all", True),
        ("*end", "the end", True),
        ("*end", "ending", False),
        ("a.b*", "a.bc", True),
        ("a.b*", "axbc", False),
        ("(x)*", "(x)y", True),
        ("[a]*b", "[a]b", True),
        ("[a]*b", "ab", False),
        ("a**b", "ab", True),
    ],
)
def test_wildcard_forms(h, pattern, value, expected):
    assert wildcard_matcher(pattern)(value) is expected
    domain = h.parse_domain(
        f"""
        domain: w
        descriptors:
          - key: k
            value: {json.dumps(pattern)}
            rate_limit: {rule("wild")}
        """
    )
    assert names(domain, [("k", value)], entry=h.Entry) == ["wild" if expected else None]


def test_wildcard_applies_to_the_value_never_the_key(h):
    domain = h.parse_domain(
        f"""
        domain: w
        descriptors:
          - key: "ke*"
            rate_limit: {rule("literal_key")}
          - key: k
            value: "*"
            rate_limit: {rule("any_value")}
        """
    )
    assert names(
        domain,
        [("key", "x")],
        [("ke", "x")],
        [("ke*", "x")],
        [("k", "x")],
        [("kk", "x")],
        entry=h.Entry,
    ) == [None, None, "literal_key", "any_value", None]


def test_wildcards_are_tried_in_config_order(h):
    first_broad = h.parse_domain(
        f"""
        domain: w
        descriptors:
          - key: k
            value: "a*"
            rate_limit: {rule("broad")}
          - key: k
            value: "ab*"
            rate_limit: {rule("narrow")}
        """
    )
    first_narrow = h.parse_domain(
        f"""
        domain: w
        descriptors:
          - key: k
            value: "ab*"
            rate_limit: {rule("narrow")}
          - key: k
            value: "a*"
            rate_limit: {rule("broad")}
        """
    )
    assert names(first_broad, [("k", "abc")], [("k", "ax")], entry=h.Entry) == ["broad", "broad"]
    assert names(first_narrow, [("k", "abc")], [("k", "ax")], entry=h.Entry) == [
        "narrow",
        "broad",
    ]


def test_a_limit_applies_only_where_the_last_entry_lands_on_a_rule(h):
    domain = h.parse_domain(
        f"""
        domain: d
        descriptors:
          - key: a
            value: x
            descriptors:
              - key: b
                rate_limit: {rule("a.b")}
                descriptors:
                  - key: c
                    descriptors:
                      - key: d
                        rate_limit: {rule("a.b.c.d")}
        """
    )
    assert names(
        domain,
        [("a", "x")],
        [("a", "x"), ("b", "1")],
        [("a", "x"), ("b", "1"), ("c", "2")],
        [("a", "x"), ("b", "1"), ("c", "2"), ("d", "3")],
        [("a", "x"), ("b", "1"), ("c", "2"), ("d", "3"), ("e", "4")],
        [("a", "y"), ("b", "1")],
        [("b", "1")],
        [],
        entry=h.Entry,
    ) == [None, "a.b", None, "a.b.c.d", None, None, None, None]


def test_nested_key_only_defaults(h):
    domain = h.parse_domain(
        f"""
        domain: d
        descriptors:
          - key: a
            descriptors:
              - key: b
                descriptors:
                  - key: c
                    rate_limit: {rule("abc")}
        """
    )
    match = match_descriptor(domain, [h.Entry("a", "1"), h.Entry("b", "2"), h.Entry("c", "3")])
    assert match is not None
    assert match.rule.name == "abc"
    assert match.key == (match.rule.counter_id, "1", "2", "3")


@pytest.fixture(scope="module")
def counting(h):
    return h.parse_domain(
        f"""
        domain: c
        descriptors:
          - key: exact
            value: e
            descriptors:
              - key: user
                rate_limit: {rule("exact_then_key_only")}
              - key: path
                value: "/api/*"
                rate_limit: {rule("exact_then_wildcard")}
              - key: tenant
                value: "t-*"
                share_threshold: true
                rate_limit: {rule("exact_then_shared")}
              - key: fixed
                value: f
                rate_limit: {rule("exact_then_exact")}
          - key: user
            descriptors:
              - key: path
                value: "*"
                descriptors:
                  - key: method
                    value: GET
                    rate_limit: {rule("mixed")}
        """
    )


def counter(domain, entry, *pairs: tuple[str, str]) -> tuple[Any, ...]:
    match = match_descriptor(domain, [entry(key, value) for key, value in pairs])
    assert match is not None
    return match.key


@pytest.mark.parametrize(
    ("pairs", "values"),
    [
        ([("exact", "e"), ("user", "alice")], ("alice",)),
        ([("exact", "e"), ("path", "/api/x")], ("/api/x",)),
        ([("exact", "e"), ("tenant", "t-1")], ()),
        ([("exact", "e"), ("fixed", "f")], ()),
        ([("user", "bob"), ("path", "/p"), ("method", "GET")], ("bob", "/p")),
    ],
)
def test_counter_key_holds_values_of_key_only_and_wildcard_levels(h, counting, pairs, values):
    match = match_descriptor(counting, [h.Entry(key, value) for key, value in pairs])
    assert match is not None
    assert match.key == (match.rule.counter_id, *values)


def test_distinct_values_get_distinct_counters(h, counting):
    def key_of(*pairs):
        return counter(counting, h.Entry, *pairs)

    assert key_of(("exact", "e"), ("user", "alice")) != key_of(("exact", "e"), ("user", "bob"))
    assert key_of(("exact", "e"), ("path", "/api/a")) != key_of(("exact", "e"), ("path", "/api/b"))
    assert key_of(("user", "u"), ("path", "/a"), ("method", "GET")) != key_of(
        ("user", "u"), ("path", "/b"), ("method", "GET")
    )


def test_share_threshold_makes_every_matching_value_share_one_counter(h, counting):
    keys = {counter(counting, h.Entry, ("exact", "e"), ("tenant", f"t-{n}")) for n in range(5)}
    assert len(keys) == 1
    assert match_descriptor(counting, [h.Entry("exact", "e"), h.Entry("tenant", "x-1")]) is None


def test_different_rules_never_share_a_counter(h, counting):
    keys = {
        counter(counting, h.Entry, ("exact", "e"), ("user", "v")),
        counter(counting, h.Entry, ("exact", "e"), ("path", "/api/v")),
        counter(counting, h.Entry, ("exact", "e"), ("tenant", "t-v")),
        counter(counting, h.Entry, ("exact", "e"), ("fixed", "f")),
    }
    assert len(keys) == 4


@pytest.fixture(scope="module")
def two_key_only(h):
    return h.parse_domain(
        f"""
        domain: c
        descriptors:
          - key: a
            descriptors:
              - key: b
                rate_limit: {rule("ab")}
        """
    )


@pytest.mark.parametrize(
    ("left", "right"),
    [
        (("a_b", "c"), ("a", "b_c")),
        (("a:b", "c"), ("a", "b:c")),
        (("a.b", "c"), ("a", "b.c")),
        (("{a}", "b"), ("{a", "}b")),
        (("a\nb", "c"), ("a", "b\nc")),
        (("é", "ü"), ("éü", "")),
        (("", "ab"), ("ab", "")),
        (('a","b', "c"), ("a", 'b","c')),
        (("a\0b", "c"), ("a", "b\0c")),
    ],
)
def test_special_characters_never_make_counters_collide(h, two_key_only, left, right):
    left_key = counter(two_key_only, h.Entry, ("a", left[0]), ("b", left[1]))
    right_key = counter(two_key_only, h.Entry, ("a", right[0]), ("b", right[1]))
    assert left_key != right_key
    assert left_key[1:] == left
    assert right_key[1:] == right


# Property tests ------------------------------------------------------------------


@pytest.fixture(scope="module")
def three_key_only(h):
    return h.parse_domain(
        f"""
        domain: c
        descriptors:
          - key: a
            descriptors:
              - key: b
                descriptors:
                  - key: c
                    rate_limit: {rule("abc")}
        """
    )


KEYS = st.sampled_from(["a", "b", "c"])
VALUES = st.sampled_from(["x", "y", "z", "x y", "1"])


def trees() -> st.SearchStrategy[dict[tuple[str, str], Any]]:
    """Random config trees of exact key/value nodes: {(key, value): (has_rule, children)}."""
    leaf = st.dictionaries(st.tuples(KEYS, VALUES), st.tuples(st.booleans(), st.just({})), max_size=4)
    return st.recursive(
        leaf,
        lambda children: st.dictionaries(st.tuples(KEYS, VALUES), st.tuples(st.booleans(), children), max_size=4),
        max_leaves=12,
    )


def to_yaml(tree: dict[tuple[str, str], Any]) -> tuple[str, dict[str, int]]:
    """The tree as a config file; each rule's requests_per_unit identifies its node."""
    numbers: dict[str, int] = {}

    def level(nodes, prefix):
        items = []
        for (key, value), (has_rule, children) in nodes.items():
            path = f"{prefix}/{key}={value}"
            item: dict[str, Any] = {"key": key, "value": value}
            if has_rule:
                numbers[path] = len(numbers) + 1
                item["rate_limit"] = {"unit": "minute", "requests_per_unit": numbers[path]}
            if children:
                item["descriptors"] = level(children, path)
            items.append(item)
        return items

    document = {"domain": "random", "descriptors": level(tree, "")}
    return yaml.safe_dump(document), numbers


def reference_match(tree, pairs) -> str | None:
    """Walk exact nodes only; a limit applies only at the node of the last entry."""
    nodes, path = tree, ""
    for index, (key, value) in enumerate(pairs):
        if (key, value) not in nodes:
            return None
        has_rule, children = nodes[(key, value)]
        path = f"{path}/{key}={value}"
        if index == len(pairs) - 1:
            return path if has_rule else None
        nodes = children
    return None


@settings(max_examples=150, deadline=None)
@given(
    tree=trees(),
    requests=st.lists(st.lists(st.tuples(KEYS, VALUES), min_size=1, max_size=4), max_size=10),
)
def test_exact_matching_agrees_with_a_reference(h, tree, requests):
    text, numbers = to_yaml(tree)
    domain, issues = parse_text(text, "random.yaml")
    assert issues == []
    assert domain is not None
    # Also ask for paths that exist in the tree, which random requests rarely hit.
    known = [[tuple(part.split("=", 1)) for part in path.split("/")[1:]] for path in numbers]
    for pairs in [*requests, *known]:
        match = match_descriptor(domain, [h.Entry(key, value) for key, value in pairs])
        expected = reference_match(tree, pairs)
        if expected is None:
            assert match is None
        else:
            assert match is not None
            assert match.rule.requests_per_unit == numbers[expected]
            assert match.key == (match.rule.counter_id,)


@settings(max_examples=300, deadline=None)
@given(
    left=st.lists(st.text(max_size=8), min_size=3, max_size=3),
    right=st.lists(st.text(max_size=8), min_size=3, max_size=3),
)
def test_distinct_values_through_a_key_only_rule_never_share_a_counter(h, three_key_only, left, right):
    domain = three_key_only
    left_key = counter(domain, h.Entry, *zip(("a", "b", "c"), left, strict=True))
    right_key = counter(domain, h.Entry, *zip(("a", "b", "c"), right, strict=True))
    assert (left_key == right_key) == (left == right)


def test_detailed_stat_keys_keep_every_share_threshold_pattern(h):
    """The reference's stat key under ``detailed_metric``: request values, except where an
    entry landed on a ``share_threshold`` wildcard (its pattern), at any depth; an exact
    sibling wins over the wildcard and keeps the value."""
    domain = h.parse_domain(
        f"""
        domain: st
        descriptors:
          - key: user
            value: user/*
            share_threshold: true
            descriptors:
              - key: resource
                value: res/*
                share_threshold: true
                descriptors:
                  - {{key: action, detailed_metric: true, rate_limit: {rule("a")}}}
              - key: resource
                value: res/own
                descriptors:
                  - {{key: action, detailed_metric: true, rate_limit: {rule("b")}}}
        """
    )

    def key(*pairs: tuple[str, str]) -> str:
        return detailed_stat_key(domain, [h.Entry(k, v) for k, v in pairs])

    assert key(("user", "user/alice"), ("resource", "res/file1"), ("action", "read")) == (
        "st.user_user/*.resource_res/*.action_read"
    )
    assert (
        key(("user", "user/bob"), ("resource", "res/own"), ("action", "")) == "st.user_user/*.resource_res/own.action"
    )
