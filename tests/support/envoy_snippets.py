"""A minimal Envoy config around given routes, for the HAProxy exporter's tests (unit and integration).

The exporter reads route ``rate_limits`` actions from an Envoy config to learn where
each descriptor entry comes from; these tests need only a listener, the rate-limit
filter of one domain and the routes under test.
"""

from __future__ import annotations

import textwrap


def minimal_envoy_config(routes: str, domain: str = "t") -> str:
    """One listener, the rate-limit filter of ``domain``, and ``routes`` (YAML list text)."""
    indented = textwrap.indent(textwrap.dedent(routes).strip(), " " * 24)
    return textwrap.dedent(
        """\
        static_resources:
          listeners:
            - name: ingress
              filter_chains:
                - filters:
                    - name: envoy.filters.network.http_connection_manager
                      typed_config:
                        route_config:
                          virtual_hosts:
                            - name: app
                              domains: ["*"]
                              routes:
        {routes}
                        http_filters:
                          - name: envoy.filters.http.ratelimit
                            typed_config: {{domain: {domain}}}
        """
    ).format(routes=indented, domain=domain)


EXTENSIONS_ROUTES = """\
- match: {prefix: "/login"}
  route:
    rate_limits:
      - actions: [{remote_address: {}}]
      - actions: [{request_headers: {header_name: x-user, descriptor_key: login_user}}]
- match: {prefix: "/upload"}
  route:
    rate_limits:
      - actions: [{remote_address: {}}]
      - actions: [{generic_key: {descriptor_value: uploads}}]
- match: {prefix: "/"}
  route:
    rate_limits:
      - actions: [{remote_address: {}}]
      - actions: [{request_headers: {header_name: x-api-key, descriptor_key: api_key}}]
"""
"""Envoy routes for ``examples/extensions``: a login route (address, user), an upload
route (address, the uploads bucket) and the rest (address, API key), each within
HAProxy's three trackers."""
EXTENSION_FLAGS = (
    "--fetch",
    "api_key=req.fhdr(x-api-key,1)",
    "--fetch",
    "login_user=req.fhdr(x-user,1)",
    "--when",
    "generic_key=uploads",
    "path_beg /upload",
)
"""``export-haproxy`` flags for ``examples/extensions`` without an Envoy config: where
each descriptor key's value comes from, and on which path the uploads bucket applies."""
