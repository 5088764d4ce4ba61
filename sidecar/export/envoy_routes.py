"""Reading the Envoy config both exporters start from: which descriptors do requests carry?

The answer is in the HTTP connection manager that runs the ``ratelimit`` filter: its inline
virtual hosts and routes, in match order, and the ``rate_limits`` entries the filter applies
to each route (the route's, then its host's as Envoy decides: :func:`routed_limits`), whose
actions build the descriptors. This module finds those and applies the rules both exporters
share (which host's limits a route gets, the filter's stage, the entry fields read, one
action per item, header matchers' string matches); which requests each host takes is
:mod:`sidecar.export.hosts`. Each exporter translates route matches and actions into its own terms
(:mod:`sidecar.export.haproxy.routes`: HAProxy ACLs; :mod:`sidecar.export.envoy_quota.routes`:
matcher predicates and bucket values).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from sidecar.export.hosts import HostTest, host_tests
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


@dataclass(frozen=True, slots=True)
class RoutedLimits:
    """One route of one virtual host, and the ``rate_limits`` entries the ``ratelimit`` filter
    applies to its requests: ``(where, entry)``, the route's then its host's, in Envoy's order."""

    host: HostTest
    index: int
    route: Mapping[str, Any]
    label: str
    entries: tuple[tuple[str, Mapping[str, Any]], ...]


PATH_MATCHES = ("prefix", "path", "path_separated_prefix", "safe_regex")
"""The route path matches both exporters translate (``path_match_policy`` and the others are not)."""
VH_OPTIONS = ("OVERRIDE", "INCLUDE", "IGNORE")
DISABLED = "DISABLED"
"""``RateLimitPerRoute.vh_rate_limits``: the host's limits apply when the route has none
(the default), always, or never. ``include_vh_rate_limits: true`` on a route means INCLUDE."""


def routed_limits(
    route_config: Mapping[str, Any], origin: str, report: Callable[[str, str], None]
) -> Iterator[RoutedLimits]:
    """Every route of every virtual host, in match order, with the entries applied to it.

    Envoy's ``ratelimit`` filter applies the route's ``rate_limits``, then the virtual host's:
    when the route has none at all (``OVERRIDE``, the default), always (``include_vh_rate_limits``
    or ``INCLUDE``) or never (``IGNORE``), the most specific ``typed_per_filter_config`` of the
    filter (route, then host) choosing. Anything else of that per-route config is reported.
    """
    hosts: Sequence[Mapping[str, Any]] = route_config.get("virtual_hosts") or []
    for host, test in zip(hosts, host_tests(route_config, origin), strict=True):
        host_where = f"{origin}: virtual host {test.name!r}"
        host_limits = list(host.get("rate_limits") or [])
        host_option = vh_option(host, host_where, report)
        for index, route in enumerate(host.get("routes") or []):
            label = route_label(test.name if len(hosts) > 1 else None, index, route)
            action = route.get("route") or {}
            own = [
                (f"{origin}: {label} rate_limits[{n}]", entry)
                for n, entry in enumerate(action.get("rate_limits") or [])
            ]
            option = vh_option(route, f"{origin}: {label}", report) or host_option or "OVERRIDE"
            if action.get("include_vh_rate_limits") and option != DISABLED:
                option = "INCLUDE"
            if option == DISABLED:  # the filter does not run on this route: nothing is sent
                own = []
            inherited = option == "INCLUDE" or (option == "OVERRIDE" and not own)
            if inherited:
                own += [
                    (f"{host_where} rate_limits[{n}] (on route {index})", entry) for n, entry in enumerate(host_limits)
                ]
            yield RoutedLimits(test, index, route, label, tuple(own))


def route_label(host: str | None, index: int, route: Mapping[str, Any]) -> str:
    """How problems name a route: ``route 2 (prefix /api)``, after its host's name when there are several."""
    match = route.get("match") or {}
    kind = next((kind for kind in PATH_MATCHES if kind in match), None)
    value = match.get(kind) if kind else None
    text = f"{kind} {value.get('regex', '') if isinstance(value, Mapping) else value}" if kind else "no path"
    name = f" {route['name']!r}" if route.get("name") else ""
    return (f"virtual host {host!r} " if host is not None else "") + f"route {index}{name} ({text})"


def vh_option(holder: Mapping[str, Any], where: str, report: Callable[[str, str], None]) -> str | None:
    """The ``vh_rate_limits`` of a route's or host's per-route config of the ``ratelimit`` filter;
    ``DISABLED`` when a ``FilterConfig`` turns the filter off there."""
    config = (holder.get("typed_per_filter_config") or {}).get(RATELIMIT_FILTER)
    if config is None:
        return None
    if str(config.get("@type", "")).endswith("config.route.v3.FilterConfig"):
        if config.get("disabled"):
            return DISABLED
        config = config.get("config") or {}
    extra = sorted(set(config) - {"@type", "vh_rate_limits"})
    if extra:
        report(where, f"typed_per_filter_config {RATELIMIT_FILTER}: {', '.join(extra)} not read")
    option = str(config.get("vh_rate_limits", "OVERRIDE"))
    if option not in VH_OPTIONS:
        report(where, f"vh_rate_limits {option!r} is not one of {', '.join(VH_OPTIONS)}")
        return None
    return option


ENTRY_FIELDS = {"actions", "stage", "disable_key"}
"""The fields of a ``rate_limits`` entry the exporters read; ``limit`` (an override from dynamic
metadata), ``hits_addend`` and ``apply_on_stream_done`` change what is counted and are refused."""


def skipped_entry(entry: Mapping[str, Any], stage: int) -> tuple[str, bool] | None:
    """Why a ``rate_limits`` entry sends no descriptor to export, and whether that is only a
    note (an entry of another stage is not applied by this filter either); None to read it."""
    if int(entry.get("stage", 0) or 0) != stage:
        return f"stage {entry.get('stage')}: not applied by the filter (stage {stage})", True
    extra = sorted(set(entry) - ENTRY_FIELDS)
    if extra:
        return f"{', '.join(extra)} not supported; descriptor not exported", False
    return None


def disable_note(entry: Mapping[str, Any]) -> str | None:
    """The difference an entry's ``disable_key`` makes, or None without one."""
    key = entry.get("disable_key")
    if not key:
        return None
    return (
        f"disable_key {key!r}: exported as always on; the runtime key ratelimit.{key}.http_filter_enabled "
        "turns off only the ratelimit filter's descriptor"
    )


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
