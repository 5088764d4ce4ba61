"""``export-envoy-quota``: the ``rate_limit_quota`` filters that put requests in the buckets of quota mode.

Quota mode moves enforcement into Envoy: the ``rate_limit_quota`` filter sorts each
request into a bucket and enforces the bucket's assignment in-process; the sidecar only
assigns (docs/quota.md). So the filter must sort requests exactly as the route
``rate_limits`` of the per-request path describe them: a request lands in the bucket
whose id is the descriptor Envoy's ``ratelimit`` filter would have sent, written by the
bucket id convention (``domain`` plus ``entry.<i>.<key>``). This module reads those
routes from the Envoy config (with the readers of :mod:`sidecar.export.haproxy`) and writes
``bucket_matchers``:

- one filter can put a request in one bucket only, so a route sending several
  descriptors needs several filters. A descriptor sent by several routes is always in the
  same filter, so that its bucket (its counter) is shared by those routes as in the
  sidecar; the filters are few: a greedy colouring of "sent by the same route";
- in a filter, one matcher entry per route sending a descriptor for it: the route's path
  test (``:path``), the tests of its actions (a header present, a ``header_value_match``),
  and "none of the earlier routes that could have taken the request", since Envoy picks the
  first matching route and the matcher list the first matching entry, but an earlier route
  without a bucket here leaves the request to later entries;
- a request matching no entry gets no bucket and passes, as a request sending no
  descriptor passes the ``ratelimit`` filter.

Whatever cannot be translated is listed on stderr (one line each, as ``export-haproxy``
does) and left out, never silently. ``--check`` refuses an Envoy config whose quota
filter would crash Envoy 1.40 (a token bucket as ``no_assignment_behavior``).
"""

from __future__ import annotations

import argparse
import copy
import shlex
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from sidecar.config.load import load_config
from sidecar.config.model import DomainConfig, Level
from sidecar.export.envoy_quota import objects
from sidecar.export.envoy_quota.objects import BucketValue, Fallback, Predicate
from sidecar.export.haproxy.export import pick_domain
from sidecar.export.haproxy.fit import node_limits
from sidecar.export.haproxy.model import Const, ExportError, Fetch, Problem
from sidecar.export.haproxy.plan import candidates
from sidecar.export.haproxy.routes import (
    HTTP_CONNECTION_MANAGER,
    RATELIMIT_FILTER,
    rate_limited_manager,
    read_envoy,
    string_match,
)

COMMAND = "export-envoy-quota"
DEFAULT_CLUSTER = "rlqs"
QUOTA_FILTER_TYPE = "envoy.extensions.filters.http.rate_limit_quota.v3.RateLimitQuotaFilterConfig"
_PATH_MATCHES = ("prefix", "path", "path_separated_prefix", "safe_regex")
_STRING_KINDS = ("exact", "prefix", "suffix", "contains", "safe_regex")


@dataclass(frozen=True, slots=True)
class Descriptor:
    """One ``rate_limits`` entry of a route: its entries and the tests under which it is sent."""

    where: str
    entries: tuple[tuple[str, BucketValue], ...]
    conditions: tuple[Predicate, ...] = field(compare=False, hash=False)


@dataclass(frozen=True, slots=True)
class QuotaRoute:
    """A route: its path test (None when untranslatable) and the descriptors it sends."""

    label: str
    path: Predicate | None = field(compare=False, hash=False)
    descriptors: tuple[Descriptor, ...]


@dataclass(frozen=True, slots=True)
class QuotaExport:
    """The filters (plain YAML data, in chain order) and what was left out or changed."""

    domain: str
    filters: list[dict[str, Any]]
    problems: tuple[Problem, ...]


# ---------------------------------------------------------------- Envoy routes as descriptors


@dataclass(slots=True)
class RouteReader:
    """Reads virtual hosts, routes and rate-limit actions as predicates and bucket values."""

    origin: str
    stage: int
    problems: list[Problem] = field(default_factory=list)

    def virtual_hosts(self, hosts: Sequence[Mapping[str, Any]]) -> list[QuotaRoute]:
        """Routes of the virtual host for every domain (``*``), in match order; others reported."""
        routes: list[QuotaRoute] = []
        for host in hosts:
            where = f"{self.origin}: virtual host {host.get('name', '?')!r}"
            if "*" not in (host.get("domains") or []):
                self.problem(where, "only the virtual host for every domain ('*') is exported")
                continue
            if host.get("rate_limits"):
                self.problem(where, "virtual host rate_limits are not exported (only route ones)")
            routes.extend(self.route(index, route) for index, route in enumerate(host.get("routes") or []))
        return routes

    def route(self, index: int, route: Mapping[str, Any]) -> QuotaRoute:
        match = route.get("match") or {}
        path, text = self.path_test(match)
        label = f"route {index} ({text})"
        if path is None:
            self.problem(f"{self.origin}: route {index}", f"{text}; its requests may land in later routes' buckets")
            return QuotaRoute(label, None, ())
        action = route.get("route") or {}
        descriptors = []
        for number, entry in enumerate(action.get("rate_limits") or []):
            found = self.descriptor(f"{self.origin}: {label} rate_limits[{number}]", entry, action)
            if found is not None:
                descriptors.append(found)
        return QuotaRoute(label, path, tuple(descriptors))

    def path_test(self, match: Mapping[str, Any]) -> tuple[Predicate | None, str]:
        """The predicate of a route ``match`` on ``:path`` (and its ``headers``), and a short text."""
        kinds = [kind for kind in _PATH_MATCHES if kind in match]
        unsupported = sorted(set(match) - {*_PATH_MATCHES, "case_sensitive", "headers"})
        if unsupported or len(kinds) != 1:
            return None, f"match on {', '.join(unsupported) or 'no path'} is not exported"
        kind = kinds[0]
        value = match[kind]
        text = str((value or {}).get("regex", "")) if kind == "safe_regex" else str(value)
        tests = [path_predicate(kind, text, ignore_case=match.get("case_sensitive") is False)]
        for matcher in match.get("headers") or []:
            test = header_matcher(matcher)
            if isinstance(test, str):
                return None, f"{kind} {text} with {test}"
            tests.append(test)
        return objects.all_of(tests), f"{kind} {text}"

    def descriptor(self, where: str, entry: Mapping[str, Any], action: Mapping[str, Any]) -> Descriptor | None:
        """The descriptor one ``rate_limits`` entry sends, or None (reported)."""
        if int(entry.get("stage", 0) or 0) != self.stage:
            self.problem(where, f"stage {entry.get('stage')}: not applied by the filter (stage {self.stage})", True)
            return None
        extra = sorted(set(entry) - {"actions", "stage"})
        if extra:
            self.problem(where, f"{', '.join(extra)} not supported; descriptor not exported")
            return None
        entries: list[tuple[str, BucketValue]] = []
        conditions: list[Predicate] = []
        for item in entry.get("actions") or []:
            result = self.action(item, action)
            if isinstance(result, str):
                self.problem(where, f"{result}; descriptor not exported")
                return None
            key, value, tests = result
            entries.append((key, value))
            conditions.extend(tests)
        return Descriptor(where, tuple(entries), tuple(conditions)) if entries else None

    def action(
        self, item: Mapping[str, Any], route_action: Mapping[str, Any]
    ) -> tuple[str, BucketValue, tuple[Predicate, ...]] | str:
        """One action as ``(descriptor key, bucket value, tests)``, or why not."""
        if len(item) != 1:
            return f"action {sorted(item)} is not one action"
        kind, body = next(iter(item.items()))
        body = body or {}
        if kind == "destination_cluster" and isinstance(route_action.get("cluster"), str):
            return "destination_cluster", BucketValue(constant=route_action["cluster"]), ()
        translate = _ACTIONS.get(kind)
        if translate is not None:
            return translate(body)
        return f"action {kind!r} has no rate_limit_quota translation here"

    def problem(self, where: str, reason: str, exported: bool = False) -> None:
        self.problems.append(Problem(where, reason, exported))


def remote_address(body: Mapping[str, Any]) -> tuple[str, BucketValue, tuple[Predicate, ...]] | str:
    """Envoy's ``remote_address``: the client address, after ``xff_num_trusted_hops``."""
    return "remote_address", BucketValue(source_ip=True), ()


def generic_key(body: Mapping[str, Any]) -> tuple[str, BucketValue, tuple[Predicate, ...]] | str:
    """Envoy's ``generic_key``: a constant (key ``generic_key`` unless ``descriptor_key`` says)."""
    key = str(body.get("descriptor_key") or "generic_key")
    return key, BucketValue(constant=str(body.get("descriptor_value", ""))), ()


def path_predicate(kind: str, text: str, *, ignore_case: bool) -> Predicate:
    """A route path match as a ``:path`` test. ``:path`` holds the query string, which Envoy's
    route matching ignores: an exact path also matches ``path?query``, a regex is followed by
    an optional ``?query``."""

    def test(string_kind: str, value: str) -> Predicate:
        return objects.header_predicate(":path", string_kind, value, ignore_case=ignore_case)

    if kind == "prefix":
        return test("prefix", text)
    if kind == "path":
        return objects.any_of([test("exact", text), test("prefix", text + "?")])
    if kind == "path_separated_prefix":
        return objects.any_of([test("exact", text), test("prefix", text + "/"), test("prefix", text + "?")])
    return test("safe_regex", f"(?:{text})(?:\\?.*)?")


def header_matcher(matcher: Mapping[str, Any]) -> Predicate | str:
    """An Envoy ``HeaderMatcher`` as a predicate (a missing header never matches, inverted or
    not, as in Envoy), or why not."""
    name = str(matcher.get("name", ""))
    if not name or matcher.get("treat_missing_header_as_empty") or "range_match" in matcher:
        return f"header matcher on {name!r} with range_match or treat_missing_header_as_empty"
    wanted = string_match(matcher)
    invert = bool(matcher.get("invert_match"))
    if not wanted:  # present_match, or no match at all (Envoy: presence)
        present = (matcher.get("present_match", True) is not False) != invert
        test = objects.header_present(name)
        return test if present else objects.negate(test)
    ignore_case = bool(wanted.pop("ignore_case", False))
    if len(wanted) != 1 or next(iter(wanted)) not in _STRING_KINDS:
        return f"header matcher on {name!r}: only {', '.join(_STRING_KINDS)} and present are supported"
    kind, value = next(iter(wanted.items()))
    text = str((value or {}).get("regex", "")) if kind == "safe_regex" else str(value)
    test = objects.header_predicate(name, kind, text, ignore_case=ignore_case)
    return objects.all_of([objects.header_present(name), objects.negate(test)]) if invert else test


def request_headers(body: Mapping[str, Any]) -> tuple[str, BucketValue, tuple[Predicate, ...]] | str:
    """Envoy's ``request_headers``: the header's value; no descriptor when the header is absent."""
    name, key = str(body.get("header_name", "")), str(body.get("descriptor_key", ""))
    if body.get("skip_if_absent"):
        return "request_headers with skip_if_absent is not supported"
    if not name or not key:
        return f"request_headers header {name!r} / descriptor_key {key!r} not supported"
    return key, BucketValue(header=name), (objects.header_present(name),)


def header_value_match(body: Mapping[str, Any]) -> tuple[str, BucketValue, tuple[Predicate, ...]] | str:
    """Envoy's ``header_value_match``: a constant, sent when all header matchers hold (or, with
    ``expect_match: false``, when they do not all hold)."""
    key = str(body.get("descriptor_key") or "header_match")
    tests = []
    for matcher in body.get("headers") or []:
        test = header_matcher(matcher)
        if isinstance(test, str):
            return test
        tests.append(test)
    if not tests:
        return "header_value_match without headers is not supported"
    condition = objects.all_of(tests)
    if body.get("expect_match") is False:
        condition = objects.negate(condition)
    return key, BucketValue(constant=str(body.get("descriptor_value", ""))), (condition,)


# ---------------------------------------------------------------- descriptors onto filters


_ACTIONS = {
    "remote_address": remote_address,
    "generic_key": generic_key,
    "request_headers": request_headers,
    "header_value_match": header_value_match,
}


def reaches_a_rule(level: Level, entries: Sequence[tuple[str, BucketValue]]) -> bool:
    """Whether some value of the request could make the descriptor match a rule of the config."""
    key, value = entries[0]
    source = Const(value.constant) if value.constant is not None else Fetch("")
    for node, _ in candidates(level, key, source):
        if len(entries) == 1 and node_limits(node):
            return True
        if len(entries) > 1 and reaches_a_rule(node.children, entries[1:]):
            return True
    return False


Shape = tuple[tuple[str, BucketValue], ...]


def assign_filters(routes: Sequence[QuotaRoute]) -> dict[Shape, int]:
    """The filter of every descriptor: one per descriptor shape, shared by every route sending
    it; two descriptors sent by one route never share a filter (greedy colouring, in order)."""
    chosen: dict[Shape, int] = {}
    for route in routes:
        for descriptor in route.descriptors:
            if descriptor.entries in chosen:
                continue
            taken = {
                chosen[other.entries]
                for sender in routes
                if any(item.entries == descriptor.entries for item in sender.descriptors)
                for other in sender.descriptors
                if other.entries in chosen
            }
            chosen[descriptor.entries] = next(index for index in range(len(chosen) + 1) if index not in taken)
    return chosen


def filter_matchers(routes: Sequence[QuotaRoute], shapes: Mapping[Shape, int], number: int) -> Iterator[Any]:
    """``(route, descriptor, predicate)`` of filter ``number``'s entries, in route order."""
    earlier: list[Predicate] = []
    """Paths of earlier routes that leave some of their requests without a bucket here."""
    for route in routes:
        if route.path is None:
            continue
        mine = [item for item in route.descriptors if shapes[item.entries] == number]
        descriptor = mine[0] if mine else None
        if descriptor is not None:
            tests = [route.path, *([objects.negate(objects.any_of(earlier))] if earlier else [])]
            yield route, descriptor, objects.all_of([*tests, *descriptor.conditions])
        if descriptor is None or descriptor.conditions:
            earlier.append(route.path)


def build_filters(domain: str, routes: Sequence[QuotaRoute], cluster: str, fallback: Fallback) -> list[dict[str, Any]]:
    """The filters, as YAML data, in the order of their first descriptor."""
    shapes = assign_filters(routes)
    filters = []
    for number in range(max(shapes.values(), default=-1) + 1):
        matchers = [
            objects.field_matcher(predicate, objects.bucket_settings(domain, descriptor.entries, fallback))
            for _, descriptor, predicate in filter_matchers(routes, shapes, number)
        ]
        name = objects.FILTER_NAME if number == 0 else f"{objects.FILTER_NAME}.{number}"
        filters.append(objects.as_yaml_dict(objects.quota_filter(name, domain, cluster, matchers)))
    return filters


def keep_reachable(domain: DomainConfig, routes: Sequence[QuotaRoute], problems: list[Problem]) -> list[QuotaRoute]:
    """Routes without the descriptors that match no rule (reported): a bucket for them would only
    cost Envoy memory and reports, since the service allows what matches no rule."""
    kept = []
    for route in routes:
        descriptors = []
        for descriptor in route.descriptors:
            if reaches_a_rule(domain.root, descriptor.entries):
                descriptors.append(descriptor)
            else:
                problems.append(Problem(descriptor.where, f"matches no rule of domain {domain.name!r}"))
        kept.append(QuotaRoute(route.label, route.path, tuple(descriptors)))
    return kept


def export_quota(
    domains: Mapping[str, DomainConfig],
    document: Mapping[str, Any],
    origin: Path,
    *,
    cluster: str = DEFAULT_CLUSTER,
    fallback: Fallback = "allow",
) -> QuotaExport:
    """The quota filters standing for the ``ratelimit`` filter and routes of the Envoy ``document``."""
    manager, limiter = envoy_parts(document, origin)
    domain_name = limiter.get("domain")
    if not isinstance(domain_name, str) or not domain_name:
        raise ExportError(f"{origin}: the {RATELIMIT_FILTER} filter has no domain")
    domain = pick_domain(domains, domain_name)
    reader = RouteReader(str(origin), int(limiter.get("stage", 0) or 0))
    try:
        routes = reader.virtual_hosts(manager["route_config"].get("virtual_hosts") or [])
    except (AttributeError, TypeError, ValueError) as error:
        raise ExportError(f"{origin}: not the shape of an Envoy v3 config ({error})") from None
    problems = reader.problems
    routes = keep_reachable(domain, routes, problems)
    where = f"{origin}: {RATELIMIT_FILTER}"
    if limiter.get("enable_x_ratelimit_headers"):
        problems.append(Problem(where, "enable_x_ratelimit_headers: the quota filter sends no X-RateLimit headers"))
    if bool(limiter.get("failure_mode_deny")) != (fallback == "deny"):
        flag = "deny" if limiter.get("failure_mode_deny") else "allow"
        problems.append(
            Problem(where, f"failure_mode_deny differs from --no-assignment {fallback} (--no-assignment {flag})", True)
        )
    if any(value.header for route in routes for item in route.descriptors for _, value in item.entries):
        problems.append(
            Problem(
                str(origin),
                "a header sent twice in one request: the bucket holds both values joined "
                "with ',' where the ratelimit filter sends the first",
                True,
            )
        )
    filters = build_filters(domain_name, routes, cluster, fallback)
    if not filters:
        raise ExportError(f"{origin}: no route sends a descriptor that could be exported")
    return QuotaExport(domain_name, filters, tuple(dict.fromkeys(problems)))


def envoy_parts(document: Mapping[str, Any], origin: Path) -> tuple[Mapping[str, Any], Mapping[str, Any]]:
    """The HTTP connection manager with the ``ratelimit`` filter, and that filter's config."""
    try:
        manager, limiter = rate_limited_manager(document, origin)
    except (AttributeError, TypeError) as error:
        raise ExportError(f"{origin}: not the shape of an Envoy v3 config ({error})") from None
    if "route_config" not in manager:
        raise ExportError(f"{origin}: routes come from RDS; only an inline route_config can be read")
    return manager, limiter


# ---------------------------------------------------------------- a whole Envoy config


def quota_document(
    document: Mapping[str, Any], origin: Path, filters: Sequence[Mapping[str, Any]], cluster: str
) -> dict[str, Any]:
    """``document`` with its ``ratelimit`` filter replaced by ``filters`` (same place in the chain)
    and the sidecar's cluster renamed ``cluster``: the sidecar serves both services on one port."""
    copied: dict[str, Any] = copy.deepcopy(dict(document))
    manager, limiter = envoy_parts(copied, origin)
    chain = list(manager["http_filters"])
    place = next(index for index, item in enumerate(chain) if item.get("name") == RATELIMIT_FILTER)
    chain[place : place + 1] = [copy.deepcopy(dict(item)) for item in filters]
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
        clusters[names.index(old)] = renamed
    return copied


# ---------------------------------------------------------------- the crash check


def quota_filters(document: Mapping[str, Any]) -> Iterator[tuple[str, Mapping[str, Any]]]:
    """``(name, typed_config)`` of every ``rate_limit_quota`` filter of the listeners."""
    listeners = (document.get("static_resources") or {}).get("listeners") or []
    for listener in listeners:
        for chain in listener.get("filter_chains") or []:
            for network_filter in chain.get("filters") or []:
                manager = network_filter.get("typed_config") or {}
                if network_filter.get("name") != HTTP_CONNECTION_MANAGER and "http_filters" not in manager:
                    continue
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
    return shlex.join(words)


def header(arguments: argparse.Namespace, export: QuotaExport) -> str:
    fallback = "ALLOW_ALL" if arguments.no_assignment == "allow" else "DENY_ALL"
    lines = [
        f"Generated by `{command_line(arguments)}`: do not edit.",
        f"Quota mode for domain {export.domain!r}: Envoy enforces each bucket's assignment in-process, the sidecar",
        f"on cluster {arguments.cluster!r} assigns them on one RLQS stream per filter (docs/quota-envoy.md).",
        f"{len(export.filters)} filter(s): one request has at most one bucket per filter. Before its first assignment",
        f"a bucket is {fallback}; an expired one is {fallback} for {objects.EXPIRED_FALLBACK_SECONDS} s,",
        "then abandoned (a new request re-creates it).",
        f"reporting_interval {objects.REPORTING_SECONDS}s: Envoy 1.40 reports every 5 s whatever is set.",
    ]
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
    config = load_config(arguments.config)
    export = export_quota(config.domains, document, origin, cluster=arguments.cluster, fallback=arguments.no_assignment)
    body: Any = export.filters
    if arguments.full:
        body = quota_document(document, origin, export.filters, arguments.cluster)
    errors = check_quota_filters({"static_resources": {"listeners": [_as_listener(export.filters)]}}, "output")
    if errors:  # never print a config that would crash Envoy
        raise ExportError("; ".join(errors))
    text = header(arguments, export) + yaml.safe_dump(body, sort_keys=False, width=120)
    return QuotaOutput(text, tuple(str(problem) for problem in export.problems))


def _as_listener(filters: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    manager = {"name": HTTP_CONNECTION_MANAGER, "typed_config": {"http_filters": list(filters)}}
    return {"filter_chains": [{"filters": [manager]}]}
