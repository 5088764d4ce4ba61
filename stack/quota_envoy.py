"""A hand-written quota-mode Envoy for the end-to-end tests, and a sidecar to serve it.

The ``rate_limit_quota`` filter builds each request's bucket id by the convention of
``sidecar/quota/buckets.py``: ``domain`` is ``quota``, ``entry.0.tier`` comes from the
``x-tier`` header and ``entry.1.client`` from ``x-client``. A request without
``x-client`` matches no bucket and passes. ``x-fallback: deny`` picks bucket settings
whose ``no_assignment_behavior`` is DENY_ALL (the others ALLOW_ALL; never a
token bucket there: Envoy 1.40 crashes on one). Routes go to a real upstream:
rate-limit filters do nothing on ``direct_response`` routes.
"""

from __future__ import annotations

import textwrap
import urllib.request
from pathlib import Path
from typing import Any

import yaml
from prometheus_client.parser import text_string_to_metric_families

from stack.envoy import ENVOY_CONFIGS, RATELIMIT_FILTER, ROUTER, ConfiguredEnvoy, bootstrap, cluster
from stack.processes import free_port
from stack.sidecar import SidecarProcess

DOMAIN = "quota"
TYPES = "type.googleapis.com/envoy.extensions.filters."
QUOTA_TYPES = TYPES + "http.rate_limit_quota.v3."
QUOTA_CONFIG = textwrap.dedent(
    """\
    domain: quota
    descriptors:
      - key: tier
        value: second
        descriptors:
          - key: client
            rate_limit: {unit: second, requests_per_unit: 5}
      - key: tier
        value: minute
        descriptors:
          - key: client
            rate_limit: {unit: minute, requests_per_unit: 7}
      - key: tier
        value: free
        descriptors:
          - key: client
            rate_limit: {unlimited: true}
      - key: tier
        value: shadow
        descriptors:
          - key: client
            shadow_mode: true
            rate_limit: {unit: minute, requests_per_unit: 2}
      - key: tier
        value: bucket
        descriptors:
          - key: client
            rate_limit: {unit: second, requests_per_unit: 2, algorithm: token_bucket, burst: 4}
      - key: tier
        value: reload
        descriptors:
          - key: client
            rate_limit: {unit: second, requests_per_unit: 3}
    """
)


def header_input(name: str) -> dict[str, Any]:
    return {
        "name": name,
        "typed_config": {
            "@type": "type.googleapis.com/envoy.type.matcher.v3.HttpRequestHeaderMatchInput",
            "header_name": name,
        },
    }


def bucket_settings(fallback: str) -> dict[str, Any]:
    """Bucket settings building ``{domain, entry.0.tier, entry.1.client}`` from the headers."""
    return {
        "name": "rate_limit_quota",
        "typed_config": {
            "@type": QUOTA_TYPES + "RateLimitQuotaBucketSettings",
            "bucket_id_builder": {
                "bucket_id_builder": {
                    "domain": {"string_value": DOMAIN},
                    "entry.0.tier": {"custom_value": header_input("x-tier")},
                    "entry.1.client": {"custom_value": header_input("x-client")},
                }
            },
            "reporting_interval": "5s",
            "no_assignment_behavior": {"fallback_rate_limit": {"blanket_rule": fallback}},
            "deny_response_settings": {"http_status": {"code": 429}},
        },
    }


def header_present(name: str) -> dict[str, Any]:
    return {
        "single_predicate": {
            "input": header_input(name),
            "value_match": {"safe_regex": {"google_re2": {}, "regex": ".+"}},
        }
    }


def header_is(name: str, value: str) -> dict[str, Any]:
    return {"single_predicate": {"input": header_input(name), "value_match": {"exact": value}}}


def quota_filter() -> dict[str, Any]:
    both = [header_present("x-client"), header_present("x-tier")]
    return {
        "name": "envoy.filters.http.rate_limit_quota",
        "typed_config": {
            "@type": QUOTA_TYPES + "RateLimitQuotaFilterConfig",
            "rlqs_server": {"envoy_grpc": {"cluster_name": "ratelimit"}},
            "domain": DOMAIN,
            "bucket_matchers": {
                "matcher_list": {
                    "matchers": [
                        {
                            "predicate": {"and_matcher": {"predicate": [*both, header_is("x-fallback", "deny")]}},
                            "on_match": {"action": bucket_settings("DENY_ALL")},
                        },
                        {
                            "predicate": {"and_matcher": {"predicate": both}},
                            "on_match": {"action": bucket_settings("ALLOW_ALL")},
                        },
                    ]
                }
            },
        },
    }


def envoy_config(listen: int, admin: int, app: int, sidecar: int) -> dict[str, Any]:
    manager = {
        "@type": TYPES + "network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "ingress",
        "route_config": {
            "virtual_hosts": [
                {"name": "app", "domains": ["*"], "routes": [{"match": {"prefix": "/"}, "route": {"cluster": "app"}}]}
            ]
        },
        "http_filters": [quota_filter(), ROUTER],
    }
    clusters = [cluster("app", app, http2=False), cluster("ratelimit", sidecar, http2=True)]
    return bootstrap(listen, admin, manager, clusters)


class QuotaEnvoy(ConfiguredEnvoy):
    """Real Envoy 1.40 with the quota filter in front of ``app``, calling the sidecar on ``sidecar_port``."""

    def __init__(self, directory: Path, app: int, sidecar_port: int) -> None:
        listen, admin = free_port(), free_port()
        config = envoy_config(listen, admin, app, sidecar_port)
        super().__init__("quota-envoy", config, directory, listen=listen, admin=admin)


SHIPPED_QUOTA = ENVOY_CONFIGS / "quota.yaml"
"""``envoy/quota.yaml``: ``envoy/front.yaml``'s routes and limits in quota mode (``export-envoy-quota``)."""


def render_shipped(template: Path, listen: int, admin: int, app: int, rlqs: int) -> dict[str, Any]:
    """``template`` (a shipped quota-mode config) with the ``ingress`` listener, the admin
    listener and the ``app`` and ``rlqs`` clusters on 127.0.0.1 at the given ports; the
    routes and filters are kept as a user deploys them."""
    config: dict[str, Any] = yaml.safe_load(template.read_text())
    config["admin"]["address"]["socket_address"] = {"address": "127.0.0.1", "port_value": admin}
    resources = config["static_resources"]
    (ingress,) = [item for item in resources["listeners"] if item["name"] == "ingress"]
    ingress["address"]["socket_address"] = {"address": "127.0.0.1", "port_value": listen}
    for item in resources["clusters"]:
        port = {"app": app, "rlqs": rlqs}.get(item["name"])
        if port is not None:
            endpoint = item["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
            endpoint["address"]["socket_address"] = {"address": "127.0.0.1", "port_value": port}
    return config


class ShippedQuotaEnvoy(ConfiguredEnvoy):
    """Real Envoy running ``envoy/quota.yaml`` (rendered on free ports) in front of ``app``,
    with its RLQS stream to the sidecar on ``sidecar_port`` (the demo's quota-mode Envoy)."""

    def __init__(self, name: str, directory: Path, app: int, sidecar_port: int, listen: int = 0) -> None:
        listen, admin = listen or free_port(), free_port()
        config = render_shipped(SHIPPED_QUOTA, listen, admin, app, sidecar_port)
        super().__init__(name, config, directory, listen=listen, admin=admin)


def quota_sidecar(directory: Path, config_dir: Path, *flags: str, port: int = 0) -> SidecarProcess:
    """``python -m sidecar serve`` on ``config_dir``, quota flags given, short TTL by default."""
    return SidecarProcess("quota-sidecar", ["--config", str(config_dir), *flags], directory, port=port)


RELOADED_CONFIG = QUOTA_CONFIG.replace(
    "rate_limit: {unit: second, requests_per_unit: 3}",
    "rate_limit: {unit: second, unit_multiplier: 10, requests_per_unit: 3}",
)
"""The ``reload`` tier's limit with only the fill seconds changed (3 per 1 s -> 3 per 10 s)."""


def http_get(url: str, timeout: float = 2.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as reply:
        return str(reply.read().decode())


def metrics(sidecar: SidecarProcess) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = http_get(sidecar.metrics_url + "/metrics")
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for {pid}")


# ---------------------------------------------------------------- any user config, on local ports

SIDECAR_CLUSTERS = ("ratelimit", "rlqs")
"""Cluster names that reach the sidecar when a config names its cluster so (the ``ratelimit``
filter's own cluster and the exporter's default ``rlqs`` are found from the config too)."""


PER_REQUEST_TIMEOUT = "2s"
"""The ``ratelimit`` filter's ``timeout`` in a rendered user config (:func:`render_local`)."""


def http_filters(config: dict[str, Any]) -> list[dict[str, Any]]:
    """Every HTTP filter of every listener's connection managers (the config's own objects)."""
    return [
        item
        for listener in config["static_resources"]["listeners"]
        for chain in listener.get("filter_chains") or []
        for network in chain.get("filters") or []
        for item in (network.get("typed_config") or {}).get("http_filters") or []
    ]


def sidecar_clusters(config: dict[str, Any]) -> set[str]:
    """The clusters of the config's rate-limit filters: ``ratelimit``'s ``rate_limit_service``
    and every ``rate_limit_quota`` filter's ``rlqs_server``."""
    found = set()
    for item in http_filters(config):
        typed = item.get("typed_config") or {}
        service = (typed.get("rate_limit_service") or {}).get("grpc_service") or typed.get("rlqs_server")
        name = ((service or {}).get("envoy_grpc") or {}).get("cluster_name")
        if name:
            found.add(str(name))
    return found


def render_local(config: dict[str, Any], listen: int, admin: int, app: int, sidecar: int) -> dict[str, Any]:
    """A user's config (as Envoy's docs write one: one listener, upstreams by DNS name) on
    127.0.0.1: the listener on ``listen``, the admin on ``admin``, the rate-limit filters'
    clusters on the sidecar (HTTP/2) and every other cluster on the ``app`` upstream, the
    ``ratelimit`` filter's ``timeout`` set to :data:`PER_REQUEST_TIMEOUT`. Routes, virtual
    hosts and the rest of the filters are kept as written."""
    rendered: dict[str, Any] = yaml.safe_load(yaml.safe_dump(config))
    rendered["admin"] = {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin}}}
    resources = rendered["static_resources"]
    (listener,) = resources["listeners"]
    listener["address"] = {"socket_address": {"address": "127.0.0.1", "port_value": listen}}
    to_sidecar = sidecar_clusters(rendered)
    for item in http_filters(rendered):
        if item.get("name") == RATELIMIT_FILTER:
            # Envoy's default is 20 ms, then the filter fails open: on a loaded test machine a
            # late answer would admit a request the limit refuses. The limits are what is tested.
            item["typed_config"]["timeout"] = PER_REQUEST_TIMEOUT
    resources["clusters"] = [
        cluster(item["name"], sidecar if item["name"] in to_sidecar else app, http2=item["name"] in to_sidecar)
        for item in resources.get("clusters") or []
    ]
    return rendered


class LocalEnvoy(ConfiguredEnvoy):
    """Real Envoy running a user's config rendered by :func:`render_local`."""

    def __init__(self, name: str, config: dict[str, Any], directory: Path, app: int, sidecar_port: int) -> None:
        listen, admin = free_port(), free_port()
        super().__init__(
            name, render_local(config, listen, admin, app, sidecar_port), directory, listen=listen, admin=admin
        )
