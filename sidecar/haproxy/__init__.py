"""Export rate-limit rules to HAProxy 2.6 (``export-haproxy``).

The exporter lives in :mod:`sidecar.haproxy.render` for the moment; it is being split into
one module per concept. The names callers import are re-exported here.
"""

from sidecar.haproxy.render import (
    KEY_LENGTH,
    MAX_SLOTS,
    Const,
    ExportError,
    ExportOptions,
    Flavour,
    Producer,
    Route,
    Sources,
    add_export_arguments,
    export,
    header_tests,
    header_value_match,
    patterns,
    quote,
    route_test,
    run_export,
    sources_from_envoy,
    sources_from_flags,
)

__all__ = [
    "KEY_LENGTH",
    "MAX_SLOTS",
    "Const",
    "ExportError",
    "ExportOptions",
    "Flavour",
    "Producer",
    "Route",
    "Sources",
    "add_export_arguments",
    "export",
    "header_tests",
    "header_value_match",
    "patterns",
    "quote",
    "route_test",
    "run_export",
    "sources_from_envoy",
    "sources_from_flags",
]
