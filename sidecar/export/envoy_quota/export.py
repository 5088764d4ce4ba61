"""``export-envoy-quota``: the ``rate_limit_quota`` filters that put requests in the buckets of quota mode.

Quota mode moves enforcement into Envoy: the ``rate_limit_quota`` filter sorts each
request into a bucket and enforces the bucket's assignment in-process; the sidecar only
assigns (docs/quota.md). So the filter must sort requests exactly as the route
``rate_limits`` of the per-request path describe them: a request lands in the bucket
whose id is the descriptor Envoy's ``ratelimit`` filter would have sent, written by the
bucket id convention (``domain`` plus ``entry.<i>.<key>``). This module reads those
routes from the Envoy config (:mod:`.routes`, on the reader both exporters share,
:mod:`sidecar.export.envoy_routes`) and writes ``bucket_matchers`` (:mod:`.filters`):

- one filter can put a request in one bucket only, so a route sending several
  descriptors needs several filters, and a descriptor sent by several routes stays in one
  filter, so those routes share its bucket as in the sidecar (:mod:`.filters` says how);
- a request matching no entry gets no bucket and passes, as a request sending no
  descriptor passes the ``ratelimit`` filter.

Two shapes of the same buckets (:mod:`.filters`): ``list`` (the filters alone, as printed
without ``--full``: every filter tests the request's host and path) and ``route`` (with
``--full``, which writes the routes too: one filter per descriptor, turned on only on the
routes sending it, so Envoy's router has already chosen and no route test runs per request).

Whatever cannot be translated is listed on stderr (one line each, with the route and action),
never left out silently: a limit left out fails the export (nothing printed on stdout) unless
``--allow-dropped`` accepts the loss; notes (differences) never fail it. ``--check`` refuses an Envoy config whose quota
filter would crash Envoy 1.40 (a token bucket as ``no_assignment_behavior``).
"""

from __future__ import annotations

import argparse
import copy
import shlex
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

from sidecar.config.load import load_config
from sidecar.config.model import DomainConfig
from sidecar.export.envoy_quota import objects
from sidecar.export.envoy_quota.filters import RouteKey, build_filters, keep_reachable, route_filters
from sidecar.export.envoy_quota.objects import Fallback
from sidecar.export.envoy_quota.routes import QuotaRoute, RouteReader
from sidecar.export.envoy_routes import (
    HTTP_CONNECTION_MANAGER,
    RATELIMIT_FILTER,
    filter_domain,
    filter_stage,
    http_managers,
    inline_routes,
    ratelimit_filter,
    read_envoy,
)
from sidecar.export.problems import ExportError, Problem, refusal
from sidecar.export.rules import pick_domain, subtree_rules, where_of

COMMAND = "export-envoy-quota"
DEFAULT_CLUSTER = "rlqs"
QUOTA_FILTER_TYPE = "envoy.extensions.filters.http.rate_limit_quota.v3.RateLimitQuotaFilterConfig"
Shape = Literal["list", "route"]


@dataclass(frozen=True, slots=True)
class QuotaExport:
    """The filters (plain YAML data, in chain order) and what was left out or changed."""

    domain: str
    filters: list[dict[str, Any]]
    problems: tuple[Problem, ...]
    per_request: tuple[RouteKey, ...] = ()
    """``(virtual host, route index)`` of the routes kept on the per-request filter."""
    enabled: Mapping[str, tuple[RouteKey, ...]] | None = None
    """``route`` shape: per filter name, the routes it is turned on for (None: ``list``, on everywhere)."""

    @property
    def dropped(self) -> tuple[Problem, ...]:
        """The limits left out: the command refuses the export unless ``--allow-dropped``."""
        return tuple(problem for problem in self.problems if not problem.exported)


def export_quota(
    domains: Mapping[str, DomainConfig],
    document: Mapping[str, Any],
    origin: Path,
    *,
    cluster: str = DEFAULT_CLUSTER,
    fallback: Fallback = "allow",
    per_request: Collection[str] = (),
    untranslated_per_request: bool = False,
    shape: Shape = "list",
) -> QuotaExport:
    """The quota filters standing for the ``ratelimit`` filter and routes of the Envoy ``document``;
    the routes ``per_request`` names (route names or ``HOST:INDEX``) keep the ``ratelimit``
    filter, and with ``untranslated_per_request`` so does every route with a limit quota mode
    cannot express. ``shape`` ``route`` needs the routes changed too (:func:`quota_document`
    with ``enabled``)."""
    manager, limiter = envoy_parts(document, origin)
    domain_name = filter_domain(limiter, origin)
    domain = pick_domain(domains, domain_name)
    reader = read_routes(document, manager, limiter, origin, per_request, domain=domain)
    if untranslated_per_request and reader.lossy:  # read again, those routes kept per request
        reader = read_routes(document, manager, limiter, origin, [*per_request, *reader.lossy], domain=domain)
    routes = reader.routes
    unknown = sorted(set(per_request) - reader.chosen)
    if unknown:
        known = ", ".join(
            f"{route.host}:{route.index}" + (f" ({route.name})" if route.name else "") for route in routes
        )
        raise ExportError(f"{origin}: --per-request {', '.join(unknown)}: no such route (routes: {known})")
    problems = reader.problems
    problems.extend(counted_apart(routes))
    routes = keep_reachable(domain, routes, problems)
    problems.extend([*filter_differences(limiter, origin, fallback), *rule_refusals(domain)])
    problems.extend(repeated_header_note(routes, origin))
    enabled = None
    if shape == "route":
        chosen = route_filters(domain_name, routes, cluster, fallback)
        filters, enabled = chosen.filters, chosen.enabled
    else:
        filters = build_filters(domain_name, routes, cluster, fallback)
    unique = tuple(dict.fromkeys(problems))
    if not filters:
        raise ExportError(f"{origin}: no route sends a descriptor that could be exported", unique)
    kept = tuple((route.host, route.index) for route in routes if route.per_request)
    return QuotaExport(domain_name, filters, unique, kept, enabled)


def repeated_header_note(routes: Sequence[QuotaRoute], origin: Path) -> list[Problem]:
    """The note for bucket values read from a header, which a request may repeat."""
    if not any(value.header for route in routes for item in route.descriptors for _, value in item.entries):
        return []
    reason = (
        "a header sent twice in one request: the bucket holds both values joined "
        "with ',' where the ratelimit filter sends the first"
    )
    return [Problem(str(origin), reason, True)]


def counted_apart(routes: Sequence[QuotaRoute]) -> list[Problem]:
    """A descriptor sent by a quota route and by a per-request route is counted twice apart
    (Envoy's bucket, the sidecar's counter): each side admits up to the limit, a limit not kept."""
    quota = {item.entries: route for route in routes for item in route.descriptors}
    found = []
    for route in routes:
        for item in route.kept:
            other = quota.get(item.entries)
            if other is not None:
                reason = (
                    f"also sent by {other.label} in quota mode: the two paths count it apart (up to twice the limit)"
                )
                found.append(Problem(item.where, reason))
    return found


def read_routes(
    document: Mapping[str, Any],
    manager: Mapping[str, Any],
    limiter: Mapping[str, Any],
    origin: Path,
    per_request: Collection[str],
    *,
    domain: DomainConfig,
) -> RouteReader:
    """The routes of the manager's inline route config, read (``reader.routes``), and what was
    found; ``domain``'s rules name the values tested for an entry from dynamic metadata."""
    reader = RouteReader(str(origin), filter_stage(limiter), local_cluster(document), frozenset(per_request))
    reader.rules = domain.root
    try:
        reader.routes = reader.virtual_hosts(inline_routes(manager, origin))
    except (AttributeError, TypeError, ValueError) as error:
        raise ExportError(f"{origin}: not the shape of an Envoy v3 config ({error})") from None
    return reader


def local_cluster(document: Mapping[str, Any]) -> str | None:
    """The bootstrap's ``node.cluster``: what ``source_cluster`` sends (None: set at run time)."""
    cluster = (document.get("node") or {}).get("cluster")
    return cluster if isinstance(cluster, str) and cluster else None


def filter_differences(limiter: Mapping[str, Any], origin: Path, fallback: Fallback) -> list[Problem]:
    """What the ``ratelimit`` filter does that the quota filters do differently (notes)."""
    where = f"{origin}: {RATELIMIT_FILTER}"
    found = []
    if limiter.get("enable_x_ratelimit_headers"):
        found.append(Problem(where, "enable_x_ratelimit_headers: the quota filter sends no X-RateLimit headers", True))
    if bool(limiter.get("failure_mode_deny")) != (fallback == "deny"):
        flag = "deny" if limiter.get("failure_mode_deny") else "allow"
        found.append(
            Problem(where, f"failure_mode_deny differs from --no-assignment {fallback} (--no-assignment {flag})", True)
        )
    return found


def rule_refusals(domain: DomainConfig) -> list[Problem]:
    """Rules whose behaviour Envoy's token bucket cannot enforce (``overload: suppress``: an
    admission probability per request): each a dropped limit."""
    found = []
    for node in domain.root.nodes():
        for rule in subtree_rules(node):
            if rule.suppress:
                found.append(
                    Problem(
                        where_of(rule),
                        "overload: suppress is not enforced in quota mode (Envoy's bucket admits up to the "
                        "assignment, it draws no admission probability)",
                    )
                )
    return found


def envoy_parts(document: Mapping[str, Any], origin: Path) -> tuple[Mapping[str, Any], Mapping[str, Any]]:
    """The HTTP connection manager with the ``ratelimit`` filter, and that filter's config."""
    manager, limiter = ratelimit_filter(document, origin)
    inline_routes(manager, origin)
    return manager, limiter


# ---------------------------------------------------------------- a whole Envoy config


def quota_document(
    document: Mapping[str, Any],
    origin: Path,
    filters: Sequence[Mapping[str, Any]],
    cluster: str,
    per_request: Collection[RouteKey] = (),
    *,
    enabled: Mapping[str, Collection[RouteKey]] | None = None,
) -> dict[str, Any]:
    """``document`` with its ``ratelimit`` filter replaced by ``filters`` (same place in the chain)
    and the sidecar's cluster renamed ``cluster``: the sidecar serves both services on one port.

    With ``enabled`` (the ``route`` shape: filter name to routes), a filter on fewer than every
    route is off by default (``disabled``) and turned on by those routes (:func:`enable_on_routes`).

    With ``per_request`` routes (``(virtual host, route index)``), the ``ratelimit`` filter stays
    after ``filters`` and its cluster stays too (``cluster`` is added beside it); every other
    route turns the ``ratelimit`` filter off (a ``FilterConfig`` with ``disabled``), so each
    request is limited by one path only.
    """
    copied: dict[str, Any] = copy.deepcopy(dict(document))
    manager, limiter = envoy_parts(copied, origin)
    chain = list(manager["http_filters"])
    place = next(index for index, item in enumerate(chain) if item.get("name") == RATELIMIT_FILTER)
    kept = chain[place : place + 1] if per_request else []
    chain[place : place + 1] = [*(copy.deepcopy(dict(item)) for item in filters), *kept]
    manager["http_filters"] = chain  # type: ignore[index]  # a dict: the copy's own manager
    envoy_grpc = ((limiter.get("rate_limit_service") or {}).get("grpc_service") or {}).get("envoy_grpc") or {}
    old = envoy_grpc.get("cluster_name")
    clusters = (copied.get("static_resources") or {}).get("clusters") or []
    names = [item.get("name") for item in clusters]
    if cluster not in names:
        if old not in names:
            raise ExportError(f"{origin}: no cluster {old!r} of the {RATELIMIT_FILTER} filter to call the sidecar by")
        renamed = copy.deepcopy(clusters[names.index(old)])
        renamed["name"] = cluster
        if "load_assignment" in renamed:
            renamed["load_assignment"]["cluster_name"] = cluster
        if per_request:
            clusters.append(renamed)
        else:
            clusters[names.index(old)] = renamed
    if per_request:
        disable_per_request_filter(manager["route_config"], set(per_request))
    if enabled is not None:
        enable_on_routes(manager["route_config"], chain, enabled)
    return copied


FILTER_CONFIG = "type.googleapis.com/envoy.config.route.v3.FilterConfig"


def disable_per_request_filter(route_config: Mapping[str, Any], per_request: set[tuple[str, int]]) -> None:
    """Turn the ``ratelimit`` filter off on every route not in ``per_request`` (in place)."""
    for key, route in route_table(route_config).items():
        if key not in per_request:
            configs = route.setdefault("typed_per_filter_config", {})
            configs[RATELIMIT_FILTER] = {"@type": FILTER_CONFIG, "disabled": True}


def route_table(route_config: Mapping[str, Any]) -> dict[RouteKey, dict[str, Any]]:
    """Every route by ``(virtual host, index)``, each its own object (in place: a route written
    once and aliased in YAML under several hosts is copied, so a change to one stays there)."""
    table: dict[RouteKey, dict[str, Any]] = {}
    seen: set[int] = set()
    for number, host in enumerate(route_config.get("virtual_hosts") or []):
        routes = host.get("routes") or []
        for index in range(len(routes)):
            if id(routes[index]) in seen:
                routes[index] = dict(routes[index])
            seen.add(id(routes[index]))
            table[(str(host.get("name", number)), index)] = routes[index]
    return table


def enable_on_routes(
    route_config: Mapping[str, Any], chain: Sequence[dict[str, Any]], enabled: Mapping[str, Collection[RouteKey]]
) -> None:
    """Each filter of ``enabled`` on its routes only (in place): ``disabled`` in ``chain`` and a
    ``FilterConfig`` with an empty ``config`` on each of its routes (Envoy's "on here"), unless
    those are every route of ``route_config``. The router picks the route before the filter
    chain is made, so the filter runs on exactly the requests of those routes."""
    routes = route_table(route_config)
    for item in chain:
        wanted = enabled.get(str(item.get("name")))
        if wanted is None or set(wanted) == set(routes):
            continue
        item["disabled"] = True
        for key in wanted:
            configs = routes[key].setdefault("typed_per_filter_config", {})
            configs[item["name"]] = {"@type": FILTER_CONFIG, "config": {}}


# ---------------------------------------------------------------- the crash check


def quota_filters(document: Mapping[str, Any]) -> Iterator[tuple[str, Mapping[str, Any]]]:
    """``(name, typed_config)`` of every ``rate_limit_quota`` filter of the listeners."""
    for manager in http_managers(document):
        for http_filter in manager.get("http_filters") or []:
            typed = http_filter.get("typed_config") or {}
            if str(typed.get("@type", "")).endswith(QUOTA_FILTER_TYPE):
                yield str(http_filter.get("name", "?")), typed


def check_quota_filters(document: Mapping[str, Any], origin: str) -> list[str]:
    """Why Envoy 1.40 would crash on this config's quota filters (empty: none found)."""
    errors = []
    for name, typed in quota_filters(document):
        for where in objects.token_bucket_fallbacks(typed):
            errors.append(
                f"{origin}: filter {name!r}: {where} is a token_bucket; Envoy 1.40 crashes on the second "
                "request of such a bucket: use blanket_rule ALLOW_ALL or DENY_ALL"
            )
    return errors


# ---------------------------------------------------------------- command line


@dataclass(frozen=True, slots=True)
class QuotaOutput:
    """What the command prints: ``text`` on stdout, ``problems`` on stderr, and whether it failed."""

    text: str
    problems: tuple[str, ...]
    failed: bool = False


def command_line(arguments: argparse.Namespace) -> str:
    """The command reproducing the output, for its first comment."""
    words = ["ratelimit-sidecar", COMMAND, arguments.config, "--envoy", arguments.envoy]
    if arguments.cluster != DEFAULT_CLUSTER:
        words += ["--cluster", arguments.cluster]
    if arguments.no_assignment != "allow":
        words += ["--no-assignment", arguments.no_assignment]
    if arguments.full:
        words.append("--full")
    for route in arguments.per_request or ():
        words += ["--per-request", route]
    if arguments.per_request_untranslated:
        words.append("--per-request-untranslated")
    if arguments.allow_dropped:
        words.append("--allow-dropped")
    return shlex.join(words)


def header(arguments: argparse.Namespace, export: QuotaExport) -> str:
    fallback = "ALLOW_ALL" if arguments.no_assignment == "allow" else "DENY_ALL"
    lines = [
        f"Generated by `{command_line(arguments)}`: do not edit.",
        f"Quota mode for domain {export.domain!r}: Envoy enforces each bucket's assignment in-process, the sidecar",
        f"on cluster {arguments.cluster!r} assigns them on one RLQS stream per Envoy, which the filters share",
        "(same cluster and domain: one stream on Envoy 1.36.4 and 1.40.0 alike; docs/quota-envoy.md).",
        f"{len(export.filters)} filter(s): one request has at most one bucket per filter. Before its first assignment",
        f"a bucket is {fallback}; an expired one is {fallback} for {objects.EXPIRED_FALLBACK_SECONDS} s,",
        "then abandoned (a new request re-creates it).",
        f"reporting_interval {objects.REPORTING_SECONDS}s: Envoy 1.40 reports every 5 s whatever is set.",
    ]
    if export.enabled is not None:
        lines.append("One filter per descriptor, on only on the routes sending it (typed_per_filter_config):")
        lines.append("the router has chosen the route, so no filter tests the route per request (`route` shape).")
    else:
        lines.append("Each filter tests the request's host and path (`list` shape; --full writes the `route` shape).")
    if export.per_request:
        kept = ", ".join(f"{host}:{index}" for host, index in export.per_request)
        lines.append(f"Routes kept on the per-request {RATELIMIT_FILTER} filter (off on every other route): {kept}")
    if export.problems:
        lines.append("Not exported or exported with a difference:")
        lines.extend(f"  {problem}" for problem in export.problems)
    return "".join(f"# {line}\n" for line in lines)


def run_quota_export(arguments: argparse.Namespace) -> QuotaOutput:
    """``export-envoy-quota``: load, read the Envoy config, export (or only check with ``--check``).

    Raises :class:`ConfigError` for a bad descriptor config and :class:`ExportError` for the rest.
    """
    origin = Path(arguments.envoy)
    document = read_envoy(origin)
    if arguments.check:
        errors = check_quota_filters(document, str(origin))
        count = sum(1 for _ in quota_filters(document))
        return QuotaOutput("" if errors else f"{origin}: {count} rate_limit_quota filter(s) checked: OK\n",
                           tuple(errors), bool(errors))  # fmt: skip
    if not arguments.config:
        raise ExportError("a descriptor config is required (only --check works without one)")
    if (arguments.per_request or arguments.per_request_untranslated) and not arguments.full:
        raise ExportError("--per-request changes the routes too: it needs --full")
    config = load_config(arguments.config)
    export = export_quota(
        config.domains,
        document,
        origin,
        cluster=arguments.cluster,
        fallback=arguments.no_assignment,
        per_request=arguments.per_request or (),
        untranslated_per_request=arguments.per_request_untranslated,
        shape="route" if arguments.full else "list",
    )
    if export.dropped and not arguments.allow_dropped:
        last = refusal(COMMAND, len(export.dropped))
        return QuotaOutput("", (*(str(problem) for problem in export.problems), last), True)
    body: Any = export.filters
    if arguments.full:
        body = quota_document(
            document, origin, export.filters, arguments.cluster, export.per_request, enabled=export.enabled
        )
    errors = check_quota_filters({"static_resources": {"listeners": [_as_listener(export.filters)]}}, "output")
    if errors:  # never print a config that would crash Envoy
        raise ExportError("; ".join(errors))
    text = header(arguments, export) + yaml.safe_dump(body, sort_keys=False, width=120)
    return QuotaOutput(text, tuple(str(problem) for problem in export.problems))


def _as_listener(filters: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    manager = {"name": HTTP_CONNECTION_MANAGER, "typed_config": {"http_filters": list(filters)}}
    return {"filter_chains": [{"filters": [manager]}]}
