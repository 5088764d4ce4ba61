"""The ``route`` shape (``export-envoy-quota --full``): one filter per descriptor, turned on only on
the routes sending it, so no route test runs per request. Each request must get exactly the
buckets the ``list`` shape gives it (itself checked per request in the other tests here, and
both through a real Envoy in ``tests/e2e/test_quota_envoy_corpus.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from sidecar.config import load_config
from sidecar.export.envoy_quota.export import FILTER_CONFIG, QuotaExport, export_quota, quota_document
from stack.envoy import ENVOY_CONFIGS, ingress_manager
from tests.sidecar.export.envoy_quota.test_export import run_cli
from tests.sidecar.export.envoy_quota.test_virtual_hosts import RULES, envoy_config, generic, key
from tests.support.quota_matchers import Request, bucket_value, buckets, holds

FRONT = ENVOY_CONFIGS / "front.yaml"
QUOTA = "envoy.filters.http.rate_limit_quota"


def envoy_route(document: dict[str, Any], request: Request) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """``(virtual host, route)`` Envoy picks for ``request``, for the configs of these tests: exact
    domains or ``*``, ``prefix`` and ``path`` matches."""
    hosts = ingress_manager(document, FRONT)["route_config"]["virtual_hosts"]
    named = [host for host in hosts if request.host.lower() in [domain.lower() for domain in host["domains"]]]
    chosen = named or [host for host in hosts if "*" in host["domains"]]
    if not chosen:
        return None
    path = request.path.partition("?")[0]
    for route in chosen[0]["routes"]:
        match = route["match"]
        if ("prefix" in match and path.startswith(match["prefix"])) or match.get("path") == path:
            return chosen[0], route
    return None


def same(first: list[dict[str, str | None]], second: list[dict[str, str | None]]) -> bool:
    """The same buckets, whatever the filters' order (the two shapes number filters apart)."""
    return sorted(map(repr, first)) == sorted(map(repr, second))


def route_shape_buckets(document: dict[str, Any], request: Request) -> list[dict[str, str | None]]:
    """The buckets of the quota filters that are on for the request's route (a filter off by
    default is on where the route's ``typed_per_filter_config`` turns it on)."""
    picked = envoy_route(document, request)
    if picked is None:
        return []
    configs = picked[1].get("typed_per_filter_config") or {}
    found = []
    for item in ingress_manager(document, FRONT)["http_filters"]:
        if not item["name"].startswith(QUOTA):
            continue
        turned_on = configs.get(item["name"], {}).get("config") == {}
        if item.get("disabled") and not turned_on:
            continue
        matcher = item["typed_config"]["bucket_matchers"]
        entries = (matcher.get("matcher_list") or {}).get("matchers") or []
        chosen = next((entry["on_match"] for entry in entries if holds(entry["predicate"], request)), None)
        chosen = chosen or matcher.get("on_no_match")
        if chosen is not None:
            builder = chosen["action"]["typed_config"]["bucket_id_builder"]["bucket_id_builder"]
            found.append({name: bucket_value(value, request) for name, value in builder.items()})
    return found


def with_service(document: dict[str, Any]) -> dict[str, Any]:
    """``document`` with the ``ratelimit`` filter's cluster, which ``--full`` renames ``rlqs``."""
    manager = ingress_manager(document, FRONT)
    service = {"grpc_service": {"envoy_grpc": {"cluster_name": "ratelimit"}}}
    manager["http_filters"][0]["typed_config"]["rate_limit_service"] = service
    document["static_resources"]["clusters"] = [{"name": "ratelimit"}, {"name": "app"}]
    return document


def both_shapes(domains: Any, document: dict[str, Any]) -> tuple[QuotaExport, dict[str, Any]]:
    """The ``list`` export and the whole config in the ``route`` shape."""
    listed = export_quota(domains, document, FRONT)
    routed = export_quota(domains, document, FRONT, shape="route")
    return listed, quota_document(document, FRONT, routed.filters, "rlqs", enabled=routed.enabled)


def requests() -> list[Request]:
    """Requests over every route of front.yaml, with and without what the conditions test."""
    found = []
    for path in ("/api", "/api/v1?x=1", "/apix", "/login", "/login/form", "/", "/bench", "/other?a"):
        for headers in ({}, {"x-api-key": "k1"}, {":method": "POST"}, {":method": "DELETE", "x-api-key": "k2"}):
            found.append(Request(path, headers=headers, address="10.0.0.7"))
    return found


def test_front_yaml_requests_get_the_same_buckets_in_both_shapes() -> None:
    front = yaml.safe_load(FRONT.read_text())
    listed, full = both_shapes(load_config("examples/config").domains, front)
    for request in requests():
        assert same(route_shape_buckets(full, request), buckets(listed.filters, request)), request


def test_one_filter_per_descriptor_on_only_on_the_routes_sending_it() -> None:
    front = yaml.safe_load(FRONT.read_text())
    _, full = both_shapes(load_config("examples/config").domains, front)
    manager = ingress_manager(full, FRONT)
    chain = manager["http_filters"]
    assert [item["name"] for item in chain] == [QUOTA, *(f"{QUOTA}.{n}" for n in range(1, 5)), chain[-1]["name"]]
    # Sent by every route: on everywhere, nothing tested (the remote address; the writes test :method).
    assert "disabled" not in chain[0] and "disabled" not in chain[3]
    assert set(chain[0]["typed_config"]["bucket_matchers"]) == {"on_no_match"}
    (write,) = chain[3]["typed_config"]["bucket_matchers"]["matcher_list"]["matchers"]
    assert write["predicate"]["single_predicate"]["input"]["typed_config"]["header_name"] == ":method"
    # Sent by one route: off by default, turned on by that route only, no path test.
    api, login, catch_all = manager["route_config"]["virtual_hosts"][0]["routes"]
    on = {"@type": FILTER_CONFIG, "config": {}}
    assert api["typed_per_filter_config"] == {f"{QUOTA}.1": on, f"{QUOTA}.2": on}
    assert login["typed_per_filter_config"] == {f"{QUOTA}.4": on}
    assert "typed_per_filter_config" not in catch_all
    assert [chain[n].get("disabled") for n in (1, 2, 4)] == [True, True, True]
    assert "path" not in yaml.safe_dump(chain[2]["typed_config"]["bucket_matchers"])  # x-api-key present only


HOSTS = f"""\
- name: api
  domains: [api.example.com]
  rate_limits: {key("vh")}
  routes:
    - &shared {{match: {{prefix: /}}, route: {{cluster: app}}}}
- name: rest
  domains: ["*"]
  routes:
    - *shared
"""


def test_a_route_aliased_under_two_hosts_is_turned_on_only_where_it_sends(tmp_path: Path) -> None:
    """YAML makes an aliased route one object: the host with the limit must not turn the
    filter on for the other host's requests."""
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES)
    document = with_service(envoy_config(HOSTS))
    listed, full = both_shapes(load_config(str(rules)).domains, document)
    api, rest = ingress_manager(full, FRONT)["route_config"]["virtual_hosts"]
    assert api["routes"][0]["typed_per_filter_config"] == {QUOTA: {"@type": FILTER_CONFIG, "config": {}}}
    assert "typed_per_filter_config" not in rest["routes"][0]
    for host in ("api.example.com", "other.example.com"):
        request = Request("/x", host=host)
        assert same(route_shape_buckets(full, request), buckets(listed.filters, request))
    assert route_shape_buckets(full, Request("/x", host="api.example.com")) == [generic("vh")]


def method_limit(method: str) -> str:
    match = f"{{name: ':method', string_match: {{exact: {method}}}}}"
    return (
        f"[{{actions: [{{header_value_match: {{descriptor_value: gold, descriptor_key: tier, headers: [{match}]}}}}]}}]"
    )


def test_a_descriptor_sent_under_different_conditions_keeps_its_route_tests(tmp_path: Path) -> None:
    """``tier gold`` on POST to /a and on PUT to anything else: one bucket, so one filter, which
    must tell the two routes apart (the route tests of the list shape)."""
    hosts = f"""\
    - name: app
      domains: ["*"]
      routes:
        - {{match: {{prefix: /a}}, route: {{cluster: app, rate_limits: {method_limit("POST")}}}}}
        - {{match: {{prefix: /}}, route: {{cluster: app, rate_limits: {method_limit("PUT")}}}}}
    """
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES)
    listed, full = both_shapes(load_config(str(rules)).domains, with_service(envoy_config(hosts)))
    (only,) = [item for item in ingress_manager(full, FRONT)["http_filters"] if item["name"].startswith(QUOTA)]
    assert "disabled" not in only
    assert len(only["typed_config"]["bucket_matchers"]["matcher_list"]["matchers"]) == 2
    gold = {"domain": "t", "entry.0.tier": "gold"}
    for path, method, expected in [
        ("/a", "POST", [gold]),
        ("/a", "PUT", []),
        ("/b", "PUT", [gold]),
        ("/b", "POST", []),
    ]:
        request = Request(path, headers={":method": method})
        assert route_shape_buckets(full, request) == buckets(listed.filters, request) == expected, (path, method)


def test_full_writes_the_route_shape_and_the_filters_alone_the_list_shape(tmp_path: Path) -> None:
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES)
    envoy = tmp_path / "envoy.yaml"
    envoy.write_text(yaml.safe_dump(with_service(envoy_config(HOSTS))))
    code, out, err = run_cli("export-envoy-quota", str(rules), "--envoy", str(envoy), "--full")
    assert code == 0, err
    assert "(`route` shape)" in out
    assert "config: {}" in out
    code, out, err = run_cli("export-envoy-quota", str(rules), "--envoy", str(envoy))
    assert code == 0, err
    assert "(`list` shape; --full writes the `route` shape)" in out
    assert "matcher_list" in out and "disabled" not in out
