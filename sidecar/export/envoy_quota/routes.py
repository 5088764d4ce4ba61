"""The Envoy config's routes as the ``rate_limit_quota`` filter sees them: each route's host and
path tests and the descriptors its (and its host's) ``rate_limits`` send, as matcher predicates
and bucket values (:class:`RouteReader`).

Finding the routes and the rules both exporters share are :mod:`sidecar.export.envoy_routes`;
this module writes route matches and actions in the quota filter's terms: a predicate on
request headers (``:authority`` and ``:path`` included) and query parameters and, for each
entry of a descriptor, where the bucket id builder takes its value (a constant, a header, a
query parameter, the client address). An entry from dynamic metadata has alternatives, one per
value the rules name (:mod:`.metadata`), and so has an entry read from a header or query
parameter (its value, the empty value as a constant, left out when absent with
``skip_if_absent``: :func:`read_value`), so one ``rate_limits`` entry may give several
descriptors, never sent together. What has no such terms is named, route and action.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sidecar.config.model import Level
from sidecar.export.envoy_quota import objects
from sidecar.export.envoy_quota.metadata import Alternative, Choices, DynamicRead, expand, fixed, metadata_action
from sidecar.export.envoy_quota.objects import BucketValue, Predicate
from sidecar.export.envoy_routes import (
    PATH_MATCHES,
    RoutedLimits,
    disable_note,
    one_action,
    routed_limits,
    skipped_entry,
    string_match,
)
from sidecar.export.problems import Problem

_STRING_KINDS = ("exact", "prefix", "suffix", "contains", "safe_regex")


@dataclass(frozen=True, slots=True)
class Descriptor:
    """A descriptor one ``rate_limits`` entry of a route sends: its entries and the tests under
    which it is sent. The descriptors of one entry (``where``) are never sent together."""

    where: str
    entries: tuple[tuple[str, BucketValue], ...]
    conditions: tuple[Predicate, ...] = field(compare=False, hash=False)


@dataclass(frozen=True, slots=True)
class QuotaRoute:
    """A route: its host, its path test (None when untranslatable) and the descriptors it sends.

    ``host`` names the virtual host (routes compete for a request only within one host);
    ``host_test`` is the predicate of the requests Envoy gives that host (None: all of them).
    """

    label: str
    path: Predicate | None = field(compare=False, hash=False)
    descriptors: tuple[Descriptor, ...]
    host: str = ""
    host_test: Predicate | None = field(default=None, compare=False, hash=False)
    name: str = ""
    index: int = 0
    per_request: bool = False
    """Chosen to keep the per-request ``ratelimit`` filter: no bucket here, its descriptors in ``kept``."""
    kept: tuple[Descriptor, ...] = ()


@dataclass(slots=True)
class RouteReader:
    """Reads virtual hosts, routes and rate-limit actions as predicates and bucket values.

    ``local_cluster`` is the bootstrap's ``node.cluster`` (what ``source_cluster`` sends), None
    when the config does not say (``--service-cluster`` at run time). ``rules`` is the domain's
    top level: the values an entry from dynamic metadata is tested for are the ones it names.
    """

    origin: str
    stage: int
    local_cluster: str | None = None
    per_request: frozenset[str] = frozenset()
    """Routes that keep the per-request filter: route names or ``HOST:INDEX``."""
    problems: list[Problem] = field(default_factory=list)
    chosen: set[str] = field(default_factory=set)
    """The ``per_request`` selectors that matched a route."""
    routes: list[QuotaRoute] = field(default_factory=list)
    """What :meth:`virtual_hosts` read, when the caller keeps it here."""
    lossy: list[str] = field(default_factory=list)
    """``HOST:INDEX`` of the routes some of whose limits were left out."""
    dropped: int = 0
    rules: Level = field(default_factory=Level)

    def virtual_hosts(self, route_config: Mapping[str, Any]) -> list[QuotaRoute]:
        """Every route of every virtual host, in match order, with the host's test."""
        routes = []
        tests: dict[str, Predicate | None] = {}
        for found in routed_limits(route_config, self.origin, self.problem):
            if found.host.name not in tests:
                tests[found.host.name] = objects.host_predicate(found.host)
            before = self.dropped
            routes.append(self.route(found, tests[found.host.name]))
            if self.dropped > before:
                self.lossy.append(f"{found.host.name}:{found.index}")
        self.report_fallthrough(routes)
        return routes

    def route(self, found: RoutedLimits, host_test: Predicate | None) -> QuotaRoute:
        match = found.route.get("match") or {}
        path, text = self.path_test(match)
        name = str(found.route.get("name") or "")
        chosen = {name, f"{found.host.name}:{found.index}"} & self.per_request
        if chosen:
            self.chosen |= chosen
            kept = self.quietly(found) if path is not None else ()
            return QuotaRoute(found.label, path, (), found.host.name, host_test, name, found.index, True, kept)
        if path is None:
            for where, entry in found.entries:
                skipped = skipped_entry(entry, self.stage)
                if skipped is None or not skipped[1]:
                    self.problem(where, f"the route's {text}; descriptor not exported")
            return QuotaRoute(found.label, None, (), found.host.name, host_test, name, found.index)
        return QuotaRoute(found.label, path, self.descriptors(found), found.host.name, host_test, name, found.index)

    def descriptors(self, found: RoutedLimits) -> tuple[Descriptor, ...]:
        action = found.route.get("route") or {}
        descriptors: list[Descriptor] = []
        for where, entry in found.entries:
            descriptors.extend(self.descriptor(where, entry, found.route, action))
        return tuple(descriptors)

    def quietly(self, found: RoutedLimits) -> tuple[Descriptor, ...]:
        """The descriptors of a route kept on the per-request filter, which sends them all:
        nothing of them is left out, so nothing is reported."""
        before = len(self.problems)
        descriptors = self.descriptors(found)
        del self.problems[before:]
        return descriptors

    def report_fallthrough(self, routes: Sequence[QuotaRoute]) -> None:
        """A route whose match is not translated lets its requests reach the buckets of the later
        routes of its host: reported when some later route there has one."""
        for number, route in enumerate(routes):
            if route.path is not None:
                continue
            later = [other for other in routes[number + 1 :] if other.host == route.host and other.descriptors]
            if later:
                self.problem(
                    f"{self.origin}: {route.label}",
                    f"match not translated; its requests would land in the buckets of {later[0].label}",
                )

    def path_test(self, match: Mapping[str, Any]) -> tuple[Predicate | None, str]:
        """The predicate of a route ``match`` on ``:path`` (and its ``headers`` and
        ``query_parameters``), and a short text."""
        kinds = [kind for kind in PATH_MATCHES if kind in match]
        unsupported = sorted(set(match) - {*PATH_MATCHES, "case_sensitive", "headers", "query_parameters"})
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
        for matcher in match.get("query_parameters") or []:
            test = query_matcher(matcher)
            if isinstance(test, str):
                return None, f"{kind} {text} with {test}"
            tests.append(test)
        return objects.all_of(tests), f"{kind} {text}"

    def descriptor(
        self, where: str, entry: Mapping[str, Any], route: Mapping[str, Any], action: Mapping[str, Any]
    ) -> tuple[Descriptor, ...]:
        """The descriptors one ``rate_limits`` entry sends (several when an action has
        alternatives, one of them per request), or none (reported)."""
        skipped = skipped_entry(entry, self.stage)
        if skipped is not None:
            self.problem(where, *skipped)
            return ()
        items: list[Choices | DynamicRead] = []
        for item in entry.get("actions") or []:
            result = self.action(item, route, action)
            if isinstance(result, str):
                self.problem(where, f"{result}; descriptor not exported")
                return ()
            items.append(result)
        variants = expand(items, self.rules)
        if isinstance(variants, str):
            self.problem(where, f"{variants}; descriptor not exported")
            return ()
        note = disable_note(entry)
        if note is not None and variants:
            self.problem(where, note, True)
        if not variants:
            self.problem(where, nothing_sent(items), True)
        return tuple(Descriptor(where, entries, tests) for entries, tests in variants)

    def action(
        self, item: Mapping[str, Any], route: Mapping[str, Any], route_action: Mapping[str, Any]
    ) -> Choices | DynamicRead | str:
        """One action's alternatives (``(descriptor key, bucket value)`` under tests), or why not."""
        found = one_action(item)
        if isinstance(found, str):
            return found
        kind, body = found
        if kind in ("metadata", "dynamic_metadata"):
            return metadata_action(kind, body, route)
        if kind == "destination_cluster":
            result = destination_cluster(route_action)
        elif kind == "source_cluster":
            if self.local_cluster is None:
                return "action 'source_cluster': the config sets no node.cluster (given at run time)"
            result = "source_cluster", BucketValue(constant=self.local_cluster), ()
        elif kind in _READS:
            return _READS[kind](body)
        elif kind in _ACTIONS:
            result = _ACTIONS[kind](body)
        else:
            return f"action {kind!r}: {_UNTRANSLATABLE.get(kind, 'has no rate_limit_quota translation here')}"
        return result if isinstance(result, str) else fixed(*result)

    def problem(self, where: str, reason: str, exported: bool = False) -> None:
        self.problems.append(Problem(where, reason, exported))
        self.dropped += not exported


_UNTRANSLATABLE = {
    "masked_remote_address": "a bucket id cannot hold a masked address (no matcher input masks one)",
    "extension": "an extension's descriptor is not known here",
}


def nothing_sent(items: Sequence[Choices | DynamicRead]) -> str:
    """Why a ``rate_limits`` entry whose actions all translate gives no bucket (a note: nothing
    reaching a limit is sent)."""
    if any(not isinstance(item, DynamicRead) and not item for item in items):
        return "the route's metadata holds no string there and the action has no default: Envoy sends no descriptor"
    if any(isinstance(item, DynamicRead) for item in items):
        return "no value its dynamic metadata can take reaches a rule: no bucket (nothing to limit)"
    return "every entry is left out (skip_if_absent): the empty descriptor reaches no rule"


def destination_cluster(route_action: Mapping[str, Any]) -> tuple[str, BucketValue, tuple[Predicate, ...]] | str:
    """Envoy's ``destination_cluster``: the route's cluster, a constant when the route names one."""
    cluster = route_action.get("cluster")
    if isinstance(cluster, str) and cluster:
        return "destination_cluster", BucketValue(constant=cluster), ()
    chosen = "weighted_clusters" if "weighted_clusters" in route_action else "cluster_header or no cluster"
    return f"action 'destination_cluster' on a route with {chosen}: the cluster is chosen per request"


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


def request_headers(body: Mapping[str, Any]) -> Choices | str:
    """Envoy's ``request_headers``: the header's (first) value; absent, no descriptor, or with
    ``skip_if_absent`` the descriptor without this entry."""
    name, key = str(body.get("header_name", "")), str(body.get("descriptor_key", ""))
    if not name or not key:
        return f"request_headers header {name!r} / descriptor_key {key!r} not supported"
    return read_value(
        key,
        BucketValue(header=name),
        lambda kind, text: objects.header_predicate(name, kind, text),
        bool(body.get("skip_if_absent")),
    )


def header_value_match(body: Mapping[str, Any]) -> tuple[str, BucketValue, tuple[Predicate, ...]] | str:
    """Envoy's ``header_value_match``: a constant, sent when all header matchers hold (or, with
    ``expect_match: false``, when they do not all hold)."""
    return _constant_when_all_match(body, "header_value_match", "headers", "header_match", header_matcher)


def query_parameters(body: Mapping[str, Any]) -> Choices | str:
    """Envoy's ``query_parameters``: the parameter's (first, decoded) value; absent, no
    descriptor, or with ``skip_if_absent`` the descriptor without this entry."""
    name, key = str(body.get("query_parameter_name", "")), str(body.get("descriptor_key", ""))
    if not name or not key:
        return f"query_parameters {name!r} / descriptor_key {key!r} not supported"
    return read_value(
        key,
        BucketValue(query=name),
        lambda kind, text: objects.query_predicate(name, kind, text),
        bool(body.get("skip_if_absent")),
    )


def read_value(key: str, value: BucketValue, test: Callable[[str, str], Predicate], skip: bool) -> Choices:
    """The alternatives of an entry whose value is read from the request (a header, a query
    parameter): the value itself when it is not empty; the constant ``""`` when it is empty,
    since the bucket id builder leaves out a field whose read value is empty (Envoy 1.36.4 and
    1.40.0: the entry would vanish, shifting the descriptor onto another rule or none) while
    the ``ratelimit`` filter sends ``(key, "")``, and a ``string_value`` of ``""`` is kept;
    absent, the entry left out (``skip_if_absent``: the rest is sent) or no descriptor."""
    found = [
        Alternative((key, value), (test("safe_regex", "(?s).+"),)),
        Alternative((key, BucketValue(constant="")), (test("exact", ""),)),
    ]
    if skip:
        found.append(Alternative(None, (objects.negate(test("safe_regex", "(?s).*")),)))
    return tuple(found)


def query_matcher(matcher: Mapping[str, Any]) -> Predicate | str:
    """An Envoy ``QueryParameterMatcher`` (a route's or ``query_parameter_value_match``'s) as a
    predicate, or why not."""
    name = str(matcher.get("name", ""))
    wanted = dict(matcher.get("string_match") or {})
    if not name:
        return "query parameter matcher without a name"
    if not wanted:  # present_match, or no match (Envoy: presence)
        return objects.query_present(name)
    ignore_case = bool(wanted.pop("ignore_case", False))
    if len(wanted) != 1 or next(iter(wanted)) not in _STRING_KINDS:
        return f"query parameter matcher on {name!r}: only {', '.join(_STRING_KINDS)} and present are supported"
    kind, value = next(iter(wanted.items()))
    text = str((value or {}).get("regex", "")) if kind == "safe_regex" else str(value)
    return objects.query_predicate(name, kind, text, ignore_case=ignore_case)


def query_parameter_value_match(body: Mapping[str, Any]) -> tuple[str, BucketValue, tuple[Predicate, ...]] | str:
    """Envoy's ``query_parameter_value_match``: a constant, sent when all parameter matchers hold
    (or, with ``expect_match: false``, when they do not all hold)."""
    return _constant_when_all_match(
        body, "query_parameter_value_match", "query_parameters", "query_match", query_matcher
    )


def _constant_when_all_match(
    body: Mapping[str, Any],
    action: str,
    field: str,
    default_key: str,
    predicate: Callable[[Mapping[str, Any]], Predicate | str],
) -> tuple[str, BucketValue, tuple[Predicate, ...]] | str:
    """The ``*_value_match`` actions: ``descriptor_value`` under ``descriptor_key`` (Envoy's
    default key when absent), sent when every matcher of ``field`` holds, or, with
    ``expect_match: false``, when they do not all hold; or why not."""
    tests = []
    for matcher in body.get(field) or []:
        test = predicate(matcher)
        if isinstance(test, str):
            return test
        tests.append(test)
    if not tests:
        return f"{action} without {field} is not supported"
    condition = objects.all_of(tests)
    if body.get("expect_match") is False:
        condition = objects.negate(condition)
    key = str(body.get("descriptor_key") or default_key)
    return key, BucketValue(constant=str(body.get("descriptor_value", ""))), (condition,)


_ACTIONS = {
    "remote_address": remote_address,
    "generic_key": generic_key,
    "header_value_match": header_value_match,
    "query_parameter_value_match": query_parameter_value_match,
}
_READS = {"request_headers": request_headers, "query_parameters": query_parameters}
"""The actions whose entry is read from the request: alternatives (:func:`read_value`)."""
