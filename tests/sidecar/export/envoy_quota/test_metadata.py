"""``export-envoy-quota`` on Envoy's ``metadata`` and ``dynamic_metadata`` rate-limit actions.

A route's metadata is a constant of the route; dynamic metadata can only be tested (Envoy's
input for it feeds the metadata matcher, never a bucket id), so each value the rules name is
a bucket of its own, and the default or the left-out entry is taken when the metadata holds
no string. Each test asks which bucket a request gets (:mod:`tests.support.quota_matchers`
evaluates the matchers as Envoy does), and every refusal names the route and the action.

Through real Envoys, against the per-request path: ``tests/e2e/quota_corpus/metadata``.
"""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from sidecar.config import load_config
from sidecar.export.envoy_quota import metadata
from sidecar.export.envoy_quota.export import QuotaExport, export_quota
from sidecar.export.problems import ExportError
from tests.sidecar.export.envoy_quota.test_virtual_hosts import envoy_config
from tests.support.quota_matchers import Request, buckets

ORIGIN = Path("envoy.yaml")
RULES = """\
domain: t
descriptors:
  - {key: tier, value: gold, rate_limit: {unit: second, requests_per_unit: 5}}
  - {key: tier, value: free, rate_limit: {unit: second, requests_per_unit: 2}}
  - {key: product, value: payments, rate_limit: {unit: second, requests_per_unit: 3}}
  - {key: product, value: other, rate_limit: {unit: second, requests_per_unit: 3}}
  - key: generic_key
    value: api
    rate_limit: {unit: second, requests_per_unit: 10}
    descriptors:
      - {key: plan, value: pro, rate_limit: {unit: second, requests_per_unit: 4}}
      - {key: plan, value: team, rate_limit: {unit: second, requests_per_unit: 4}}
  - {key: generic_key, value: all, rate_limit: {unit: second, requests_per_unit: 10}}
  - {key: user, rate_limit: {unit: second, requests_per_unit: 1}}
  - {key: region, value: "eu*", rate_limit: {unit: second, requests_per_unit: 1}}
  - {key: zone, value: "us*", share_threshold: true, rate_limit: {unit: second, requests_per_unit: 1}}
"""


def export(tmp_path: Path, routes: str, rules: str = RULES) -> QuotaExport:
    path = tmp_path / "rules.yaml"
    path.write_text(rules)
    hosts = yaml.safe_dump([{"name": "backend", "domains": ["*"], "routes": yaml.safe_load(routes)}])
    return export_quota(load_config(str(path)).domains, envoy_config(hosts), ORIGIN)


def dynamic(key: str, field: str, **options: Any) -> dict[str, Any]:
    """A ``metadata`` action reading ``acme.<field>`` of the dynamic metadata."""
    return {"metadata": {"descriptor_key": key, "metadata_key": {"key": "acme", "path": [{"key": field}]}, **options}}


def route(prefix: str, *entries: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    limits = [{"actions": actions} for actions in entries]
    return {"match": {"prefix": prefix}, "route": {"cluster": "app", "rate_limits": limits}, **extra}


def routes(*items: dict[str, Any]) -> str:
    return yaml.safe_dump(list(items))


def at(path: str = "/", **values: Any) -> Request:
    """A request whose dynamic metadata holds ``acme: values``."""
    return Request(path, metadata={"acme": values} if values else {})


def bucket(**entries: str) -> dict[str, str | None]:
    return {"domain": "t", **{f"entry.{index}.{key}": value for index, (key, value) in enumerate(entries.items())}}


def test_each_named_value_is_a_bucket_and_absent_takes_the_default(tmp_path: Path) -> None:
    result = export(tmp_path, routes(route("/", [dynamic("tier", "tier", default_value="free")])))
    assert result.dropped == ()
    assert len(result.filters) == 1  # the alternatives of one entry share a filter
    assert buckets(result.filters, at(tier="gold")) == [bucket(tier="gold")]
    assert buckets(result.filters, at()) == [bucket(tier="free")]
    assert buckets(result.filters, at(tier="free")) == [bucket(tier="free")]
    # Envoy's action reads a string only: a number or "" there is absent, the default is sent.
    assert buckets(result.filters, at(tier=7)) == [bucket(tier="free")]
    assert buckets(result.filters, at(tier="")) == [bucket(tier="free")]
    # A value no rule names matches no rule: the service would allow it, no bucket is needed.
    assert buckets(result.filters, at(tier="bronze")) == []


def test_absent_without_a_default_sends_no_descriptor(tmp_path: Path) -> None:
    """Envoy's action returns false: the whole descriptor is not sent (the other entries too)."""
    action = {"generic_key": {"descriptor_value": "api"}}
    result = export(tmp_path, routes(route("/", [action, dynamic("plan", "plan")])))
    assert buckets(result.filters, at(plan="pro")) == [bucket(generic_key="api", plan="pro")]
    assert buckets(result.filters, at(plan="team")) == [bucket(generic_key="api", plan="team")]
    assert buckets(result.filters, at()) == []
    assert buckets(result.filters, at(plan={"nested": "pro"})) == []


def test_skip_if_absent_sends_the_descriptor_without_the_entry(tmp_path: Path) -> None:
    action = {"generic_key": {"descriptor_value": "api"}}
    result = export(tmp_path, routes(route("/", [action, dynamic("plan", "plan", skip_if_absent=True)])))
    assert result.dropped == ()
    assert buckets(result.filters, at(plan="pro")) == [bucket(generic_key="api", plan="pro")]
    assert buckets(result.filters, at()) == [bucket(generic_key="api")]
    # A value the rules do not name under generic_key api: a descriptor no rule matches.
    assert buckets(result.filters, at(plan="basic")) == []


def test_the_values_named_depend_on_the_entries_before(tmp_path: Path) -> None:
    """``plan`` is named under ``generic_key api`` only: under ``all`` it reaches no rule."""
    entries = [{"generic_key": {"descriptor_value": "all"}}, dynamic("plan", "plan", skip_if_absent=True)]
    result = export(tmp_path, routes(route("/", entries)))
    assert buckets(result.filters, at(plan="pro")) == []
    assert buckets(result.filters, at()) == [bucket(generic_key="all")]


def test_the_deprecated_dynamic_metadata_action_reads_the_same(tmp_path: Path) -> None:
    action = {"dynamic_metadata": dynamic("tier", "tier", default_value="free")["metadata"]}
    result = export(tmp_path, routes(route("/", [action])))
    assert buckets(result.filters, at(tier="gold")) == [bucket(tier="gold")]
    assert buckets(result.filters, at()) == [bucket(tier="free")]
    skip = {"dynamic_metadata": dynamic("tier", "tier", skip_if_absent=True)["metadata"]}
    refused = export(tmp_path, routes(route("/", [skip], name="late"), route("/x", [action])))
    assert [str(item) for item in refused.dropped] == [
        "not exported: envoy.yaml: route 0 'late' (prefix /) rate_limits[0]: action 'dynamic_metadata': skip_if_absent "
        "not supported; descriptor not exported"
    ]


def test_route_metadata_is_a_constant_of_the_route(tmp_path: Path) -> None:
    product = {"descriptor_key": "product", "metadata_key": {"key": "acme", "path": [{"key": "product"}]}}
    entry = {"metadata": {**product, "source": "ROUTE_ENTRY", "default_value": "other"}}
    tagged = {"filter_metadata": {"acme": {"product": "payments"}}}
    result = export(
        tmp_path,
        routes(
            route("/pay", [entry], metadata=tagged),
            route("/count", [entry], metadata={"filter_metadata": {"acme": {"product": 3}}}),
            route("/", [entry]),
        ),
    )
    assert result.dropped == ()
    assert buckets(result.filters, Request("/pay")) == [bucket(product="payments")]
    assert buckets(result.filters, Request("/count")) == [bucket(product="other")]  # a number: absent
    assert buckets(result.filters, Request("/")) == [bucket(product="other")]
    # Dynamic metadata of the same name is not the route's.
    assert buckets(result.filters, at("/", product="payments")) == [bucket(product="other")]


def test_route_metadata_absent_skips_the_entry_or_sends_nothing(tmp_path: Path) -> None:
    product = {"descriptor_key": "product", "metadata_key": {"key": "acme", "path": [{"key": "product"}]}}
    api = {"generic_key": {"descriptor_value": "api"}}
    skipped = {"metadata": {**product, "source": "ROUTE_ENTRY", "skip_if_absent": True}}
    result = export(
        tmp_path, routes(route("/a", [api, skipped]), route("/", [{"metadata": {**product, "source": "ROUTE_ENTRY"}}]))
    )
    assert buckets(result.filters, Request("/a")) == [bucket(generic_key="api")]
    assert buckets(result.filters, Request("/")) == []
    assert "note: envoy.yaml: route 1 (prefix /) rate_limits[0]: the route's metadata holds no string there" in [
        str(item).partition(" and")[0] for item in result.problems
    ]


def test_dynamic_metadata_no_rule_names_gives_no_bucket_and_a_note(tmp_path: Path) -> None:
    result = export(tmp_path, routes(route("/", [dynamic("colour", "colour")]), route("/x", [dynamic("tier", "tier")])))
    assert result.dropped == ()
    assert buckets(result.filters, at(colour="red")) == []
    reason = "no value its dynamic metadata can take reaches a rule: no bucket (nothing to limit)"
    assert [item.reason for item in result.problems if item.where.endswith("route 0 (prefix /) rate_limits[0]")] == [
        reason
    ]


def test_a_request_of_an_earlier_metadata_route_never_takes_a_later_routes_bucket(tmp_path: Path) -> None:
    result = export(
        tmp_path,
        routes(route("/pay", [dynamic("tier", "tier")]), route("/", [{"generic_key": {"descriptor_value": "all"}}])),
    )
    assert buckets(result.filters, at("/pay", tier="gold")) == [bucket(tier="gold")]
    assert buckets(result.filters, at("/pay", tier="bronze")) == []
    assert buckets(result.filters, at("/pay")) == []
    assert buckets(result.filters, at("/home", tier="gold")) == [bucket(generic_key="all")]


def routed(result: QuotaExport, index: int, request: Request) -> list[dict[str, str | None]]:
    """The buckets of a request of route ``index`` in the ``route`` shape: only the filters on there."""
    on = [item for item in result.filters if ("backend", index) in (result.enabled or {})[item["name"]]]
    return buckets(on, request)


def test_the_route_shape_puts_one_entrys_alternatives_in_one_filter(tmp_path: Path) -> None:
    path = tmp_path / "rules.yaml"
    path.write_text(RULES)
    hosts = routes(route("/", [dynamic("tier", "tier", default_value="free")]))
    document = envoy_config(yaml.safe_dump([{"name": "backend", "domains": ["*"], "routes": yaml.safe_load(hosts)}]))
    result = export_quota(load_config(str(path)).domains, document, ORIGIN, shape="route")
    assert len(result.filters) == 1
    assert routed(result, 0, at(tier="gold")) == [bucket(tier="gold")]
    assert routed(result, 0, at()) == [bucket(tier="free")]
    assert routed(result, 0, at(tier="bronze")) == []


def test_the_route_shape_keeps_alternatives_apart_when_another_route_sends_one_alone(tmp_path: Path) -> None:
    """/fixed sends ``tier free`` always (route metadata): the alternatives of / cannot share its
    filter, and / must not take /fixed's bucket without its condition."""
    path = tmp_path / "rules.yaml"
    path.write_text(RULES)
    tier = {"descriptor_key": "tier", "metadata_key": {"key": "acme", "path": [{"key": "tier"}]}}
    fixed = {"metadata": {**tier, "source": "ROUTE_ENTRY", "default_value": "free"}}
    hosts = routes(route("/fixed", [fixed]), route("/", [dynamic("tier", "tier", default_value="free")]))
    document = envoy_config(yaml.safe_dump([{"name": "backend", "domains": ["*"], "routes": yaml.safe_load(hosts)}]))
    result = export_quota(load_config(str(path)).domains, document, ORIGIN, shape="route")
    assert len(result.filters) == 2
    assert routed(result, 0, at("/fixed", tier="gold")) == [bucket(tier="free")]
    assert routed(result, 1, at("/x", tier="gold")) == [bucket(tier="gold")]
    assert routed(result, 1, at("/x")) == [bucket(tier="free")]
    assert routed(result, 1, at("/x", tier="bronze")) == []


@pytest.mark.parametrize(
    ("action", "reason"),
    [
        (
            dynamic("user", "user"),
            "rules.yaml:14: t.user counts each value apart",
        ),
        (
            dynamic("region", "region", default_value="eu-west"),
            "(dynamic metadata acme.region): the wildcard 'eu*' rule ",
        ),
        (dynamic("zone", "zone"), "rules.yaml:16: t.zone_us* shares a limit among values, and"),
        (
            {"metadata": {"descriptor_key": "tier"}},
            "action 'metadata': descriptor_key and metadata_key.key are required",
        ),
        (
            {"metadata": {"descriptor_key": "tier", "metadata_key": {"key": "acme", "path": []}}},
            "action 'metadata': metadata_key.path must be one or more {key: NAME} segments",
        ),
        (dynamic("tier", "tier", source="UPSTREAM"), "source one of DYNAMIC, ROUTE_ENTRY"),
        (dynamic("tier", "tier", default_value=3), "action 'metadata': default_value must be a string"),
        (dynamic("tier", "tier", hits="1"), "action 'metadata': hits not supported"),
    ],
)
def test_what_cannot_be_exact_is_refused_by_route_and_action(
    tmp_path: Path, action: dict[str, Any], reason: str
) -> None:
    result = export(
        tmp_path, routes(route("/", [action]), route("/x", [dynamic("tier", "tier", default_value="free")]))
    )
    (problem,) = result.dropped
    assert str(problem).startswith("not exported: envoy.yaml: route 0 (prefix /) rate_limits[0]: "), problem
    assert reason in str(problem)
    assert str(problem).endswith("; descriptor not exported")


def test_the_key_only_refusal_says_why_and_where(tmp_path: Path) -> None:
    result = export(tmp_path, routes(route("/", [dynamic("user", "user")]), route("/x", [dynamic("tier", "tier")])))
    (problem,) = result.dropped
    assert "counts each value apart" in str(problem)
    assert "a bucket id cannot take a value from dynamic metadata" in str(problem)


def test_a_route_metadata_date_is_refused(tmp_path: Path) -> None:
    entry = {
        "metadata": {
            "descriptor_key": "product",
            "metadata_key": {"key": "acme", "path": [{"key": "p"}]},
            "source": "ROUTE_ENTRY",
        }
    }
    dated = {"filter_metadata": {"acme": {"p": datetime.date(2026, 1, 2)}}}
    result = export(tmp_path, routes(route("/", [entry], metadata=dated), route("/x", [dynamic("tier", "tier")])))
    assert [str(item) for item in result.dropped] == [
        "not exported: envoy.yaml: route 0 (prefix /) rate_limits[0]: action 'metadata' (route metadata acme.p): "
        "a YAML date: write it quoted; descriptor not exported"
    ]


def test_too_many_combinations_are_refused(tmp_path: Path) -> None:
    nested = "domain: t\ndescriptors:\n" + "".join(
        f"  - key: a\n    value: a{a}\n    descriptors:\n"
        + "".join(
            f"      - key: b\n        value: b{b}\n        descriptors:\n"
            + "".join(
                f"          - {{key: c, value: c{c}, rate_limit: {{unit: second, requests_per_unit: 1}}}}\n"
                for c in range(5)
            )
            for b in range(5)
        )
        for a in range(5)
    )
    deep = [dynamic("a", "a"), dynamic("b", "b"), dynamic("c", "c")]
    with pytest.raises(ExportError) as refused:
        export(tmp_path, routes(route("/", deep)), nested)
    assert f"more than {metadata.MAX_VARIANTS} combinations" in str(refused.value.reasons)
