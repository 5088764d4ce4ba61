"""A response-phase cost through a real Envoy: ``apply_on_stream_done`` and ``count_past_limit``.

How an LLM gateway spends a token budget: the request is checked with 0 hits (is any
budget left?), and when the response is done Envoy reports its cost (the tokens the
upstream says it used, in a response header) with ``hits_addend`` taken from a format
string, on a rate limit marked ``apply_on_stream_done``. A 1,200-token answer against
1,000 per hour must count, so the next request of that user is refused. Without
``count_past_limit`` the report is refused as over the limit and adds nothing, and the
budget never runs out: the control route shows that difference.

Envoy 1.40 takes ``hits_addend`` (a number, or a format string such as
``%RESP(x-tokens)%`` or ``%DYNAMIC_METADATA(...)%``) from the rate limits of the filter's
own config or of a route's ``RateLimitPerRoute``, not from the route table's
``RouteAction.rate_limits``: the routes here use ``RateLimitPerRoute``. A refused request
is a local reply without the header: Envoy logs "Invalid hits_addend" and reports nothing.
"""

from __future__ import annotations

import http.server
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from stack.envoy import EnvoyPorts, EnvoyProcess
from stack.processes import process_group
from stack.sidecar import SidecarProcess
from tests.support.envoys import COUNTING_TIMEOUT, Session

pytestmark = [pytest.mark.envoy, pytest.mark.slow]

RULES = textwrap.dedent(
    """\
    domain: llm
    descriptors:
      - key: generic_key
        value: tokens
        descriptors:
          - key: user
            rate_limit: {unit: hour, requests_per_unit: 1000, count_past_limit: true}
      - key: generic_key
        value: plain
        descriptors:
          - key: user
            rate_limit: {unit: hour, requests_per_unit: 1000}
    """
)


def route(prefix: str, value: str) -> dict[str, Any]:
    """A route checking the user's budget with 0 hits, then charging the response's tokens when it is done."""
    actions = [
        {"generic_key": {"descriptor_value": value}},
        {"request_headers": {"header_name": "x-user", "descriptor_key": "user"}},
    ]
    # Per-route filter config (RateLimitPerRoute.rate_limits): Envoy 1.40 reads hits_addend
    # there, not in the route table's RouteAction.rate_limits.
    per_route = {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimitPerRoute",
        "rate_limits": [
            {"actions": actions, "hits_addend": {"number": 0}},
            {"actions": actions, "apply_on_stream_done": True, "hits_addend": {"format": "%RESP(x-tokens)%"}},
        ],
    }
    return {
        "match": {"prefix": prefix},
        "route": {"cluster": "app"},
        "typed_per_filter_config": {"envoy.filters.http.ratelimit": per_route},
    }


def endpoint(name: str) -> dict[str, Any]:
    address = {"socket_address": {"address": "127.0.0.1", "port_value": 0}}
    return {"cluster_name": name, "endpoints": [{"lb_endpoints": [{"endpoint": {"address": address}}]}]}


HTTP2 = {
    "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
        "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
        "explicit_http_config": {"http2_protocol_options": {}},
    }
}
MANAGER = {
    "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
    "stat_prefix": "ingress",
    "route_config": {
        "virtual_hosts": [{"name": "app", "domains": ["*"], "routes": [route("/plain", "plain"), route("/", "tokens")]}]
    },
    "http_filters": [
        {
            "name": "envoy.filters.http.ratelimit",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimit",
                "domain": "llm",
                "failure_mode_deny": True,
                "timeout": "1s",
                "rate_limit_service": {
                    "transport_api_version": "V3",
                    "grpc_service": {"envoy_grpc": {"cluster_name": "ratelimit"}},
                },
            },
        },
        {
            "name": "envoy.filters.http.router",
            "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"},
        },
    ],
}
ENVOY = {
    "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}}},
    "static_resources": {
        "listeners": [
            {
                "name": "ingress",
                "address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}},
                "filter_chains": [
                    {"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": MANAGER}]}
                ],
            }
        ],
        "clusters": [
            {"name": "app", "type": "STATIC", "load_assignment": endpoint("app")},
            {
                "name": "ratelimit",
                "type": "STATIC",
                "typed_extension_protocol_options": HTTP2,
                "load_assignment": endpoint("ratelimit"),
            },
        ],
    },
}


class TokenApp(http.server.BaseHTTPRequestHandler):
    """An upstream that says how many tokens its answer cost: the request's ``x-cost``."""

    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        body = b"answer\n"
        self.send_response(200)
        self.send_header("x-tokens", self.headers.get("x-cost", "1"))
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EnvoyProcess, SidecarProcess]]:
    directory = tmp_path_factory.mktemp("response-cost")
    rules = directory / "rules.yaml"
    rules.write_text(RULES)
    template = directory / "envoy-template.yaml"
    template.write_text(yaml.safe_dump(ENVOY))
    app = http.server.ThreadingHTTPServer(("127.0.0.1", 0), TokenApp)
    threading.Thread(target=app.serve_forever, daemon=True).start()
    try:
        with process_group() as group:
            sidecar = group.start_ready(lambda: SidecarProcess("sidecar", ["--config", str(rules)], directory))
            ports = EnvoyPorts.free(app=app.server_address[1], ratelimit=sidecar.port)
            envoy = group.start(
                EnvoyProcess("envoy", Path(template), ports, directory, timeout_seconds=COUNTING_TIMEOUT)
            )
            envoy.wait_ready()
            yield envoy, sidecar
            assert envoy.alive(), envoy.log_tail()
    finally:
        app.shutdown()


def statuses(envoy: EnvoyProcess, path: str, user: str, costs: list[int]) -> list[int]:
    """Send one request per cost, letting each stream-done report land before the next request."""
    session = Session(envoy.url)
    seen = []
    try:
        for cost in costs:
            seen.append(session.send(path, {"x-user": user, "x-cost": str(cost)}).status)
            time.sleep(0.3)  # the report is sent when the stream is done, after the client has its answer
    finally:
        session.close()
    return seen


def test_an_over_budget_response_refuses_the_next_request(gateway: tuple[EnvoyProcess, SidecarProcess]) -> None:
    envoy, _ = gateway
    user = f"alice-{time.time_ns()}"
    # 400 + 500 fit; the third answer costs 1,200 (total 2,100): it is served (it was
    # admitted with 0 hits) and counted, and every request after it is refused.
    assert statuses(envoy, "/chat", user, [400, 500, 1200, 1, 1]) == [200, 200, 200, 429, 429]


def test_without_count_past_limit_the_budget_never_runs_out(gateway: tuple[EnvoyProcess, SidecarProcess]) -> None:
    envoy, _ = gateway
    user = f"bob-{time.time_ns()}"
    assert statuses(envoy, "/plain", user, [400, 500, 1200, 1, 1]) == [200] * 5
