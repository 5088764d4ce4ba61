"""``export-envoy-quota`` on the actions whose value is read from the request
(``request_headers``, ``query_parameters``): an empty value, and ``skip_if_absent``.

What Envoy does, checked through Envoy 1.36.4 and 1.40.0: the ``ratelimit`` filter sends
``(key, "")`` for a header or parameter that is present but empty, and with ``skip_if_absent``
leaves an absent one's entry out and sends the rest; the ``rate_limit_quota`` bucket id
builder leaves out a field whose ``custom_value`` reads empty, but keeps a ``string_value`` of
``""``. :mod:`tests.support.quota_matchers` evaluates the matchers so.

Through real Envoys, against the per-request path: ``tests/e2e/quota_corpus/read_values``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from sidecar.export.envoy_quota.metadata import MAX_VARIANTS
from sidecar.export.problems import ExportError
from tests.sidecar.export.envoy_quota.test_metadata import export
from tests.support.quota_matchers import Request, buckets

RULES = """\
domain: t
descriptors:
  - key: generic_key
    value: api
    rate_limit: {unit: second, requests_per_unit: 10}
    descriptors:
      - {key: user, rate_limit: {unit: second, requests_per_unit: 2}}
  - key: user
    rate_limit: {unit: second, requests_per_unit: 1}
    descriptors:
      - {key: generic_key, value: tail, rate_limit: {unit: second, requests_per_unit: 3}}
"""
API = {"generic_key": {"descriptor_value": "api"}}
TAIL = {"generic_key": {"descriptor_value": "tail"}}


def header(**options: object) -> dict[str, object]:
    return {"request_headers": {"header_name": "x-user", "descriptor_key": "user", **options}}


def query(**options: object) -> dict[str, object]:
    return {"query_parameters": {"query_parameter_name": "user", "descriptor_key": "user", **options}}


def routes(*actions: dict[str, object]) -> str:
    return f"[{{match: {{prefix: /}}, route: {{cluster: a, rate_limits: [{{actions: {list(actions)}}}]}}}}]"


def ids(*entries: tuple[str, str]) -> list[dict[str, str | None]]:
    return [{"domain": "t", **{f"entry.{index}.{key}": value for index, (key, value) in enumerate(entries)}}]


def test_an_empty_header_keeps_its_entry_with_the_empty_value(tmp_path: Path) -> None:
    """Regression: the bucket id read the empty header, so Envoy left the entry out: the last
    entry empty gave the shorter descriptor's bucket (another rule), the first an index gap."""
    last = export(tmp_path, routes(API, header()), RULES)
    assert buckets(last.filters, Request(headers={"x-user": ""})) == ids(("generic_key", "api"), ("user", ""))
    assert buckets(last.filters, Request(headers={"x-user": "ann"})) == ids(("generic_key", "api"), ("user", "ann"))
    assert buckets(last.filters, Request()) == []  # absent, no skip_if_absent: nothing sent
    first = export(tmp_path, routes(header(), TAIL), RULES)
    assert buckets(first.filters, Request(headers={"x-user": ""})) == ids(("user", ""), ("generic_key", "tail"))


def test_an_empty_query_parameter_keeps_its_entry_with_the_empty_value(tmp_path: Path) -> None:
    result = export(tmp_path, routes(API, query()), RULES)
    for path in ("/a?user=", "/a?user=&user=bob"):  # the first value, empty
        assert buckets(result.filters, Request(path)) == ids(("generic_key", "api"), ("user", "")), path
    assert buckets(result.filters, Request("/a?user=bob")) == ids(("generic_key", "api"), ("user", "bob"))
    assert buckets(result.filters, Request("/a?other=1")) == []


def test_skip_if_absent_sends_the_rest_of_the_descriptor(tmp_path: Path) -> None:
    for action, present, empty, absent in (
        (header(skip_if_absent=True), Request(headers={"x-user": "ann"}), Request(headers={"x-user": ""}), Request()),
        (query(skip_if_absent=True), Request("/a?user=ann"), Request("/a?user="), Request("/a?page=2")),
    ):
        result = export(tmp_path, routes(API, action), RULES)
        assert result.dropped == (), action
        assert buckets(result.filters, present) == ids(("generic_key", "api"), ("user", "ann")), action
        assert buckets(result.filters, empty) == ids(("generic_key", "api"), ("user", "")), action
        assert buckets(result.filters, absent) == ids(("generic_key", "api")), action


def test_skip_if_absent_alone_sends_nothing_when_absent(tmp_path: Path) -> None:
    result = export(tmp_path, routes(header(skip_if_absent=True)), RULES)
    assert result.dropped == ()
    assert buckets(result.filters, Request()) == []  # the empty descriptor: Envoy sends none
    assert buckets(result.filters, Request(headers={"x-user": "ann"})) == ids(("user", "ann"))


def test_an_empty_value_reaching_no_rule_gives_no_bucket(tmp_path: Path) -> None:
    """``(plan, "")`` reaches no rule (only ``pro`` is limited): no bucket, as the per-request
    path's descriptor matches no rule; the request does not fall to a later route's bucket."""
    rules = RULES + "  - {key: plan, value: pro, rate_limit: {unit: second, requests_per_unit: 1}}\n"
    plan = {"request_headers": {"header_name": "x-plan", "descriptor_key": "plan"}}
    hosts = (
        f"[{{match: {{prefix: /p}}, route: {{cluster: a, rate_limits: [{{actions: [{plan}]}}]}}}},"
        f" {{match: {{prefix: /}}, route: {{cluster: a, rate_limits: [{{actions: [{API}]}}]}}}}]"
    )
    result = export(tmp_path, hosts, rules)
    assert buckets(result.filters, Request("/p", headers={"x-plan": "pro"})) == ids(("plan", "pro"))
    assert buckets(result.filters, Request("/p", headers={"x-plan": ""})) == []
    assert buckets(result.filters, Request("/x", headers={"x-plan": ""})) == ids(("generic_key", "api"))


def test_too_many_read_entries_are_refused_by_name(tmp_path: Path) -> None:
    count = MAX_VARIANTS.bit_length()  # each read entry doubles the alternatives (empty or not)
    actions = [{"request_headers": {"header_name": f"x-{n}", "descriptor_key": f"k{n}"}} for n in range(count)]
    with pytest.raises(ExportError) as refused:
        export(tmp_path, routes(*actions), RULES)
    (problem,) = [str(item) for item in refused.value.reasons]
    assert f"more than {MAX_VARIANTS} combinations" in problem and "route 0" in problem
