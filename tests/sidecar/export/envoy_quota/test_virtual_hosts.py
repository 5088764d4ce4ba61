"""``export-envoy-quota`` on what users write: several virtual hosts, virtual-host ``rate_limits``,
``include_vh_rate_limits``, per-route ``vh_rate_limits``, ``disable_key``, and the actions the
bucket matchers can express. Each test asks which bucket a request gets from the exported
filters (:mod:`tests.support.quota_matchers` evaluates them as Envoy does), so a bucket on the
wrong host is a failure whatever the predicate's spelling.

Through a real Envoy, against the per-request path: ``tests/e2e/test_quota_envoy_corpus.py``.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml

from sidecar.config import load_config
from sidecar.export.envoy_quota.export import QuotaExport, export_quota
from sidecar.export.problems import ExportError
from tests.support.quota_matchers import Request, buckets

ORIGIN = Path("envoy.yaml")
RULES = """\
domain: t
descriptors:
  - {key: generic_key, value: vh, rate_limit: {unit: second, requests_per_unit: 2}}
  - {key: generic_key, value: api, rate_limit: {unit: second, requests_per_unit: 5}}
  - {key: generic_key, value: web, rate_limit: {unit: second, requests_per_unit: 5}}
  - {key: generic_key, value: wild, rate_limit: {unit: second, requests_per_unit: 5}}
  - {key: generic_key, value: prefix, rate_limit: {unit: second, requests_per_unit: 5}}
  - {key: remote_address, rate_limit: {unit: second, requests_per_unit: 20}}
  - {key: user, rate_limit: {unit: second, requests_per_unit: 20}}
  - {key: tier, value: gold, rate_limit: {unit: second, requests_per_unit: 20}}
  - {key: query_match, value: debug, rate_limit: {unit: second, requests_per_unit: 1}}
  - {key: destination_cluster, rate_limit: {unit: second, requests_per_unit: 20}}
  - {key: source_cluster, value: front, rate_limit: {unit: second, requests_per_unit: 20}}
"""


def envoy_config(hosts: str, *, top: str = "", node: str = "") -> dict[str, Any]:
    """An Envoy config whose ``route_config`` holds ``hosts`` (YAML list text) and ``top``."""
    route_config = yaml.safe_load(textwrap.dedent(top) or "{}") or {}
    route_config["virtual_hosts"] = yaml.safe_load(textwrap.dedent(hosts))
    manager = {
        "route_config": route_config,
        "http_filters": [{"name": "envoy.filters.http.ratelimit", "typed_config": {"domain": "t"}}],
    }
    document: dict[str, Any] = {
        "static_resources": {
            "listeners": [
                {
                    "name": "ingress",
                    "filter_chains": [
                        {
                            "filters": [
                                {"name": "envoy.filters.network.http_connection_manager", "typed_config": manager}
                            ]
                        }
                    ],
                }
            ]
        }
    }
    if node:
        document["node"] = {"cluster": node}
    return document


def export(tmp_path: Path, hosts: str, **options: str) -> QuotaExport:
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES)
    return export_quota(load_config(str(rules)).domains, envoy_config(hosts, **options), ORIGIN)


def generic(value: str) -> dict[str, str | None]:
    return {"domain": "t", "entry.0.generic_key": value}


def key(value: str) -> str:
    return f"[{{actions: [{{generic_key: {{descriptor_value: {value}}}}}]}}]"


NAMED_AND_CATCH_ALL = f"""\
- name: api
  domains: [api.example.com]
  routes: [{{match: {{prefix: /}}, route: {{cluster: app}}}}]
- name: rest
  domains: ["*"]
  routes: [{{match: {{prefix: /}}, route: {{cluster: app, rate_limits: {key("vh")}}}}}]
"""


def test_a_catch_all_hosts_bucket_never_takes_a_named_hosts_requests(tmp_path: Path) -> None:
    """The issue-29 bug: the catch-all's matchers tested only ``:path``, so its 2/s bucket
    limited api.example.com, to which the per-request path sends no descriptor."""
    result = export(tmp_path, NAMED_AND_CATCH_ALL)
    assert buckets(result.filters, Request(host="api.example.com")) == []
    assert buckets(result.filters, Request(host="API.Example.COM")) == []  # Envoy lower-cases the host
    assert buckets(result.filters, Request(host="www.example.com")) == [generic("vh")]
    # Without ignore_port_in_host_matching a port makes the exact domain miss: '*' takes it.
    assert buckets(result.filters, Request(host="api.example.com:8080")) == [generic("vh")]
    assert result.dropped == ()


def test_each_host_gets_its_own_buckets_and_routes_compete_only_within_a_host(tmp_path: Path) -> None:
    hosts = f"""\
    - name: api
      domains: [api.example.com]
      routes:
        - {{match: {{prefix: /health}}, route: {{cluster: app}}}}
        - {{match: {{prefix: /}}, route: {{cluster: app, rate_limits: {key("api")}}}}}
    - name: web
      domains: [www.example.com, example.com]
      routes: [{{match: {{prefix: /}}, route: {{cluster: app, rate_limits: {key("web")}}}}}]
    """
    result = export(tmp_path, hosts)
    assert buckets(result.filters, Request("/x", "api.example.com")) == [generic("api")]
    assert buckets(result.filters, Request("/health", "api.example.com")) == []
    assert buckets(result.filters, Request("/health", "example.com")) == [generic("web")]
    assert buckets(result.filters, Request("/", "other.org")) == []  # no host: Envoy answers 404


def test_domains_rank_as_in_envoy_exact_then_longest_suffix_then_prefix_then_any(tmp_path: Path) -> None:
    hosts = "\n".join(
        f"- {{name: {name}, domains: [{domain!r}], routes: [{{match: {{prefix: /}}, route: {{cluster: a, rate_limits: "
        f"{key(value)}}}}}]}}"
        for name, domain, value in (
            ("exact", "api.example.com", "api"),
            ("suffix", "*.example.com", "wild"),
            ("prefix", "api.*", "prefix"),
            ("any", "*", "vh"),
        )
    )
    result = export(tmp_path, hosts)
    expected = {
        "api.example.com": "api",
        "x.example.com": "wild",
        "api.other.org": "prefix",
        "example.com": "vh",  # a wildcard stands for one character or more
        ".example.com": "vh",
        "api.": "vh",
        "other.org": "vh",
    }
    for host, value in expected.items():
        assert buckets(result.filters, Request(host=host)) == [generic(value)], host


def test_ignore_port_in_host_matching(tmp_path: Path) -> None:
    result = export(tmp_path, NAMED_AND_CATCH_ALL, top="ignore_port_in_host_matching: true")
    assert buckets(result.filters, Request(host="api.example.com:8080")) == []
    assert buckets(result.filters, Request(host="www.example.com:8080")) == [generic("vh")]


def test_virtual_host_rate_limits_apply_as_envoy_applies_them(tmp_path: Path) -> None:
    """By default a host's rate_limits apply to routes without any of their own;
    include_vh_rate_limits and a per-route vh_rate_limits INCLUDE add them, IGNORE drops them,
    a FilterConfig disabling the ratelimit filter sends nothing at all."""
    per_route = "type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimitPerRoute"
    disabled = "type.googleapis.com/envoy.config.route.v3.FilterConfig"
    hosts = f"""\
    - name: api
      domains: ["*"]
      rate_limits: [{{actions: [{{remote_address: {{}}}}]}}]
      routes:
        - {{match: {{prefix: /own}}, route: {{cluster: a, rate_limits: {key("api")}}}}}
        - {{match: {{prefix: /both}}, route: {{cluster: a, include_vh_rate_limits: true, rate_limits: {key("web")}}}}}
        - match: {{prefix: /include}}
          route: {{cluster: a, rate_limits: {key("wild")}}}
          typed_per_filter_config:
            envoy.filters.http.ratelimit: {{"@type": {per_route}, vh_rate_limits: INCLUDE}}
        - match: {{prefix: /ignore}}
          route: {{cluster: a}}
          typed_per_filter_config:
            envoy.filters.http.ratelimit: {{"@type": {per_route}, vh_rate_limits: IGNORE}}
        - match: {{prefix: /off}}
          route: {{cluster: a, rate_limits: {key("vh")}}}
          typed_per_filter_config:
            envoy.filters.http.ratelimit: {{"@type": {disabled}, disabled: true}}
        - {{match: {{prefix: /}}, route: {{cluster: a}}}}
    """
    result = export(tmp_path, hosts)
    address = {"domain": "t", "entry.0.remote_address": "10.0.0.7"}

    def sent(path: str) -> list[dict[str, str | None]]:
        found = buckets(result.filters, Request(path, address="10.0.0.7"))
        return sorted(found, key=str)

    assert sent("/own") == [generic("api")]
    assert sent("/both") == sorted([generic("web"), address], key=str)
    assert sent("/include") == sorted([generic("wild"), address], key=str)
    assert sent("/ignore") == []
    assert sent("/off") == []
    assert sent("/other") == [address]
    assert result.dropped == ()


def test_query_parameters_in_routes_and_actions(tmp_path: Path) -> None:
    hosts = """\
    - name: app
      domains: ["*"]
      routes:
        - match: {prefix: /, query_parameters: [{name: tier, string_match: {exact: gold}}]}
          route:
            cluster: a
            rate_limits:
              - actions: [{generic_key: {descriptor_key: tier, descriptor_value: gold}}]
              - actions: [{query_parameters: {query_parameter_name: user, descriptor_key: user}}]
        - match: {prefix: /}
          route:
            cluster: a
            rate_limits:
              - actions:
                  - query_parameter_value_match:
                      descriptor_value: debug
                      query_parameters: [{name: debug, present_match: true}]
    """
    result = export(tmp_path, hosts)
    tier = {"domain": "t", "entry.0.tier": "gold"}
    assert sorted(buckets(result.filters, Request("/a?tier=gold&user=ann")), key=str) == sorted(
        [tier, {"domain": "t", "entry.0.user": "ann"}], key=str
    )
    assert buckets(result.filters, Request("/a?tier=gold")) == [tier]  # no user: that descriptor is not sent
    assert buckets(result.filters, Request("/a?debug=1")) == [{"domain": "t", "entry.0.query_match": "debug"}]
    assert buckets(result.filters, Request("/a?tier=silver")) == []


def test_cluster_actions_are_constants_when_the_config_says_them(tmp_path: Path) -> None:
    hosts = """\
    - name: app
      domains: ["*"]
      routes:
        - match: {prefix: /w}
          route:
            weighted_clusters: {clusters: [{name: a, weight: 1}, {name: b, weight: 1}]}
            rate_limits: [{actions: [{destination_cluster: {}}]}]
        - match: {prefix: /}
          route:
            cluster: backend
            rate_limits:
              - actions: [{destination_cluster: {}}]
              - actions: [{source_cluster: {}}]
    """
    result = export(tmp_path, hosts, node="front")
    assert sorted(buckets(result.filters, Request("/x")), key=str) == sorted(
        [{"domain": "t", "entry.0.destination_cluster": "backend"}, {"domain": "t", "entry.0.source_cluster": "front"}],
        key=str,
    )
    (dropped,) = result.dropped
    assert "route 0 (prefix /w) rate_limits[0]" in str(dropped)
    assert "destination_cluster' on a route with weighted_clusters" in str(dropped)
    without_node = export(tmp_path, hosts)
    assert any("source_cluster': the config sets no node.cluster" in str(item) for item in without_node.dropped)


def test_disable_key_is_exported_with_a_note_and_other_stages_are_noted(tmp_path: Path) -> None:
    hosts = """\
    - name: app
      domains: ["*"]
      routes:
        - match: {prefix: /}
          route:
            cluster: a
            rate_limits:
              - {disable_key: vh_off, actions: [{generic_key: {descriptor_value: vh}}]}
              - {stage: 2, actions: [{generic_key: {descriptor_value: api}}]}
    """
    result = export(tmp_path, hosts)
    assert buckets(result.filters, Request()) == [generic("vh")]
    assert result.dropped == ()
    notes = [str(problem) for problem in result.problems]
    assert any("disable_key 'vh_off': exported as always on" in line for line in notes), notes
    assert any("stage 2: not applied by the filter (stage 0)" in line for line in notes), notes


def test_overload_suppress_rules_are_refused_by_name(tmp_path: Path) -> None:
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES.replace("requests_per_unit: 2}", "requests_per_unit: 2, overload: suppress}"))
    document = envoy_config(NAMED_AND_CATCH_ALL)
    result = export_quota(load_config(str(rules)).domains, document, ORIGIN)
    (dropped,) = result.dropped
    assert "generic_key_vh" in str(dropped)
    assert "overload: suppress is not enforced in quota mode" in str(dropped)


def test_two_hosts_with_one_domain_is_refused_as_envoy_refuses_it(tmp_path: Path) -> None:
    hosts = """\
    - {name: a, domains: [x.org], routes: [{match: {prefix: /}, route: {cluster: a}}]}
    - {name: b, domains: [X.org], routes: [{match: {prefix: /}, route: {cluster: a}}]}
    """
    with pytest.raises(ExportError, match=r"domain 'x\.org' is in virtual hosts 'a' and 'b'"):
        export(tmp_path, hosts)


def test_a_host_without_domains_is_refused_as_envoy_refuses_it(tmp_path: Path) -> None:
    hosts = "- {name: a, domains: [], routes: [{match: {prefix: /}, route: {cluster: a}}]}"
    with pytest.raises(ExportError, match="virtual host 'a' has no domains"):
        export(tmp_path, hosts)


def envoy_picks(hosts: list[list[str]], authority: str) -> int | None:
    """Envoy's virtual host choice, written from its documented order: exact, then the
    longest suffix wildcard, then the longest prefix wildcard, then '*' (wildcards need a character)."""
    host = authority.lower()
    owner = {domain.lower(): number for number, domains in enumerate(hosts) for domain in domains}
    if host in owner:
        return owner[host]
    suffixes = sorted((d for d in owner if d.startswith("*") and d != "*"), key=len, reverse=True)
    for domain in suffixes:
        if len(host) > len(domain) - 1 and host.endswith(domain[1:]):
            return owner[domain]
    prefixes = sorted((d for d in owner if d.endswith("*") and d != "*"), key=len, reverse=True)
    for domain in prefixes:
        if len(host) > len(domain) - 1 and host.startswith(domain[:-1]):
            return owner[domain]
    return owner.get("*")


@pytest.mark.parametrize(
    "hosts",
    [
        [["a.example.com"], ["*.example.com"], ["*"]],
        [["*"], ["*.com", "a.*"], ["*.example.com"], ["a.example.com", "b.org"]],
        [["a.*"], ["a.b.*"], ["*.b.example.com"]],
        [["x.org", "*"], ["*.x.org"]],
    ],
)
def test_the_bucket_of_a_request_is_its_envoy_hosts_bucket(tmp_path: Path, hosts: list[list[str]]) -> None:
    """Each host's route sends a descriptor naming the host; every authority gets the bucket of
    the host Envoy picks, and only that one (none when no host takes it)."""
    rules = tmp_path / "rules.yaml"
    rules.write_text(
        "domain: t\ndescriptors:\n"
        + "".join(
            f"  - {{key: generic_key, value: h{n}, rate_limit: {{unit: second, requests_per_unit: 1}}}}\n"
            for n in range(len(hosts))
        )
    )
    listed = "\n".join(
        f"- {{name: h{n}, domains: {domains!r}, routes: [{{match: {{prefix: /}}, route: {{cluster: a, rate_limits: "
        f"{key(f'h{n}')}}}}}]}}"
        for n, domains in enumerate(hosts)
    )
    filters = export_quota(load_config(str(rules)).domains, envoy_config(listed), ORIGIN).filters
    authorities = [
        "a.example.com", "A.EXAMPLE.com", "b.example.com", "example.com", ".example.com", "a.b.example.com",
        "x.b.example.com", "a.", "a.b.", "a.org", "b.org", "x.org", "y.x.org", "com", "q.com", "other",
        "a.example.com:80",
    ]  # fmt: skip
    for authority in authorities:
        picked = envoy_picks(hosts, authority)
        expected = [] if picked is None else [generic(f"h{picked}")]
        assert buckets(filters, Request(host=authority)) == expected, authority
