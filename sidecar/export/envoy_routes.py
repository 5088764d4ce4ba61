"""Reading the Envoy config both exporters start from: which descriptors do requests carry?

The answer is in the HTTP connection manager that runs the ``ratelimit`` filter: its inline
routes, in match order, and each route's ``rate_limits`` entries, whose actions build the
descriptors. This module finds those and applies the rules both exporters share (the
virtual host serving every domain, the filter's stage, one action per item, header matchers'
string matches); each exporter translates route matches and actions into its own terms
(:mod:`sidecar.export.haproxy.routes`: HAProxy ACLs; :mod:`sidecar.export.envoy_quota.routes`:
matcher predicates and bucket values).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from sidecar.export.problems import ExportError

RATELIMIT_FILTER = "envoy.filters.http.ratelimit"
HTTP_CONNECTION_MANAGER = "envoy.filters.network.http_connection_manager"

_LEGACY_MATCHES = {
    "exact_match": "exact",
    "prefix_match": "prefix",
    "suffix_match": "suffix",
    "contains_match": "contains",
}


def read_envoy(path: Path) -> dict[str, Any]:
    """The Envoy config as a mapping; :class:`ExportError` when it cannot be read."""
    try:
        document = yaml.safe_load(path.read_text())
    except OSError as error:
        raise ExportError(f"{path}: cannot read: {error.strerror or error}") from None
    except yaml.YAMLError as error:
        raise ExportError(f"{path}: not valid YAML: {str(error).splitlines()[0]}") from None
    if not isinstance(document, dict):
        raise ExportError(f"{path}: not an Envoy config (expected a mapping)")
    return document


def http_managers(document: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
    """The config of every HTTP connection manager of the static listeners."""
    listeners = (document.get("static_resources") or {}).get("listeners") or []
    for listener in listeners:
        for chain in listener.get("filter_chains") or []:
            for network_filter in chain.get("filters") or []:
                manager = network_filter.get("typed_config") or {}
                if network_filter.get("name") == HTTP_CONNECTION_MANAGER or "http_filters" in manager:
                    yield manager


def rate_limited_manager(document: Mapping[str, Any], path: Path) -> tuple[Mapping[str, Any], Mapping[str, Any]]:
    """The one HTTP connection manager with a rate-limit filter, and that filter's config."""
    found = []
    for manager in http_managers(document):
        for http_filter in manager.get("http_filters") or []:
            if http_filter.get("name") == RATELIMIT_FILTER:
                found.append((manager, http_filter.get("typed_config") or {}))
    if len(found) != 1:
        raise ExportError(f"{path}: expected one HTTP listener with {RATELIMIT_FILTER}, found {len(found)}")
    return found[0]


def ratelimit_filter(document: Mapping[str, Any], path: Path) -> tuple[Mapping[str, Any], Mapping[str, Any]]:
    """:func:`rate_limited_manager`, a config of the wrong shape reported as :class:`ExportError`."""
    try:
        return rate_limited_manager(document, path)
    except (AttributeError, TypeError) as error:
        raise ExportError(f"{path}: not the shape of an Envoy v3 config ({error})") from None


def filter_domain(limiter: Mapping[str, Any], path: Path) -> str:
    """The domain the ``ratelimit`` filter sends, which picks the config domain to export."""
    domain = limiter.get("domain")
    if not isinstance(domain, str) or not domain:
        raise ExportError(f"{path}: the {RATELIMIT_FILTER} filter has no domain")
    return domain


def filter_stage(limiter: Mapping[str, Any]) -> int:
    """The filter's stage: it applies only the ``rate_limits`` entries of the same stage."""
    return int(limiter.get("stage", 0) or 0)


def inline_routes(manager: Mapping[str, Any], path: Path) -> Mapping[str, Any]:
    """The manager's inline ``route_config``; routes from RDS are not in the file to read."""
    if "route_config" not in manager:
        raise ExportError(f"{path}: routes come from RDS; only an inline route_config can be read")
    routes: Mapping[str, Any] = manager["route_config"]
    return routes


def served_routes(
    hosts: Sequence[Mapping[str, Any]], origin: str, report: Callable[[str, str], None]
) -> Iterator[tuple[int, Mapping[str, Any]]]:
    """``(index, route)`` of the virtual host serving every domain (``*``), in match order; the
    other hosts, and virtual-host ``rate_limits``, are reported as not exported."""
    for host in hosts:
        where = f"{origin}: virtual host {host.get('name', '?')!r}"
        if "*" not in (host.get("domains") or []):
            report(where, "only the virtual host for every domain ('*') is exported")
            continue
        if host.get("rate_limits"):
            report(where, "virtual host rate_limits are not exported (only route ones)")
        yield from enumerate(host.get("routes") or [])


def skipped_entry(entry: Mapping[str, Any], stage: int) -> tuple[str, bool] | None:
    """Why a route's ``rate_limits`` entry sends no descriptor to export, and whether that is
    only a note (an entry of another stage is not applied by this filter either); None to read it."""
    if int(entry.get("stage", 0) or 0) != stage:
        return f"stage {entry.get('stage')}: not applied by the filter (stage {stage})", True
    extra = sorted(set(entry) - {"actions", "stage"})
    if extra:
        return f"{', '.join(extra)} not supported; descriptor not exported", False
    return None


def one_action(action: Mapping[str, Any]) -> tuple[Any, Mapping[str, Any]] | str:
    """An item of ``actions`` as ``(kind, body)``, or why it is not one action."""
    if len(action) != 1:
        return f"action {sorted(action)} is not one action"
    kind, body = next(iter(action.items()))
    return kind, body or {}


def string_match(matcher: Mapping[str, Any]) -> dict[str, Any]:
    """A header matcher's ``string_match``, with the legacy ``*_match`` fields folded into it."""
    found = dict(matcher.get("string_match") or {})
    for legacy, kind in _LEGACY_MATCHES.items():
        if legacy in matcher:
            found[kind] = matcher[legacy]
    if "safe_regex_match" in matcher:
        found["safe_regex"] = matcher["safe_regex_match"]
    return found
