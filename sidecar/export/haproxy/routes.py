"""Reading an Envoy config's routes: which descriptors (:class:`Producer`) each route's
``rate_limits`` send, and the ACLs for its path match and header matchers.

Reusable beyond HAProxy: :func:`read_envoy`, :func:`rate_limited_manager`, :func:`sources_from_envoy`
and :class:`EnvoyReader` turn the routes into :class:`Sources`, whatever is generated from them.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from sidecar.export.haproxy.model import (
    ADDRESS_LENGTH,
    Condition,
    Const,
    ExportError,
    Fetch,
    Problem,
    Producer,
    Route,
    Source,
    Sources,
    Test,
)
from sidecar.export.haproxy.words import full_regex, hint_of, patterns, quote, unquotable

RATELIMIT_FILTER = "envoy.filters.http.ratelimit"
HTTP_CONNECTION_MANAGER = "envoy.filters.network.http_connection_manager"

_HEADER_NAME = re.compile(r"[A-Za-z0-9_.-]+")
_METHODS = re.compile(r"[A-Z]+(?:\|[A-Z]+)*")


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


def _filters(document: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
    listeners = (document.get("static_resources") or {}).get("listeners") or []
    for listener in listeners:
        for chain in listener.get("filter_chains") or []:
            yield from chain.get("filters") or []


def rate_limited_manager(document: Mapping[str, Any], path: Path) -> tuple[Mapping[str, Any], Mapping[str, Any]]:
    """The one HTTP connection manager with a rate-limit filter, and that filter's config."""
    found = []
    for network_filter in _filters(document):
        manager = network_filter.get("typed_config") or {}
        if network_filter.get("name") != HTTP_CONNECTION_MANAGER and "http_filters" not in manager:
            continue
        for http_filter in manager.get("http_filters") or []:
            if http_filter.get("name") == RATELIMIT_FILTER:
                found.append((manager, http_filter.get("typed_config") or {}))
    if len(found) != 1:
        raise ExportError(f"{path}: expected one HTTP listener with {RATELIMIT_FILTER}, found {len(found)}")
    return found[0]


def sources_from_envoy(path: Path, overrides: Mapping[str, str]) -> Sources:
    """Routes and descriptors of the Envoy config at ``path``, ``overrides`` replacing key fetches."""
    document = read_envoy(path)
    try:
        manager, limiter = rate_limited_manager(document, path)
    except (AttributeError, TypeError) as error:
        raise ExportError(f"{path}: not the shape of an Envoy v3 config ({error})") from None
    domain = limiter.get("domain")
    if not isinstance(domain, str) or not domain:
        raise ExportError(f"{path}: the {RATELIMIT_FILTER} filter has no domain")
    if "route_config" not in manager:
        raise ExportError(f"{path}: routes come from RDS; only an inline route_config can be read")
    try:
        reader = EnvoyReader(str(path), int(limiter.get("stage", 0) or 0), overrides)
        routes = reader.virtual_hosts(manager["route_config"].get("virtual_hosts") or [])
    except (AttributeError, TypeError, ValueError) as error:
        raise ExportError(f"{path}: not the shape of an Envoy v3 config ({error})") from None
    return Sources(domain, str(path), tuple(routes), tuple(reader.problems))


@dataclass(slots=True)
class EnvoyReader:
    """Turns virtual hosts, routes and rate-limit actions into :class:`Route` and :class:`Producer`."""

    origin: str
    stage: int
    overrides: Mapping[str, str]
    problems: list[Problem] = field(default_factory=list)

    def virtual_hosts(self, hosts: Sequence[Mapping[str, Any]]) -> list[Route]:
        """Routes of the virtual host serving every domain (``*``); others are reported."""
        routes: list[Route] = []
        for host in hosts:
            where = f"{self.origin}: virtual host {host.get('name', '?')!r}"
            if "*" not in (host.get("domains") or []):
                self._problem(where, "only the virtual host for every domain ('*') is exported")
                continue
            if host.get("rate_limits"):
                self._problem(where, "virtual host rate_limits are not exported (only route ones)")
            for index, route in enumerate(host.get("routes") or []):
                exported = self.route(index, route)
                if exported is not None:
                    routes.append(exported)
        return routes

    def route(self, index: int, route: Mapping[str, Any]) -> Route | None:
        """One route: its path test and the producers of its ``rate_limits``; None (reported) when its
        match cannot be translated, so the requests it would take go on to the later routes."""
        match = route.get("match") or {}
        test, text = route_test(match)
        if test is None:
            where = f"{self.origin}: route {index}"
            self._problem(where, f"{text}; its requests fall through to later routes in HAProxy")
            return None
        label = f"route {index} ({text})"
        where = f"{self.origin}: {label}"
        limits = (route.get("route") or {}).get("rate_limits") or []
        test = replace(test, hint=hint_of(text))
        producers = []
        for number, entry in enumerate(limits):
            producer = self.producer(f"{where} rate_limits[{number}]", entry)
            if producer is not None:
                producers.append(producer)
        return Route(label, test, tuple(producers))

    def producer(self, where: str, entry: Mapping[str, Any]) -> Producer | None:
        """The descriptor one ``rate_limits`` entry produces, or None (reported) when it cannot be read."""
        if int(entry.get("stage", 0) or 0) != self.stage:
            self._problem(where, f"stage {entry.get('stage')}: not applied by the filter (stage {self.stage})", True)
            return None
        extra = sorted(set(entry) - {"actions", "stage"})
        if extra:
            self._problem(where, f"{', '.join(extra)} not supported; descriptor not exported")
            return None
        entries: list[tuple[str, Source]] = []
        condition: list[Test] = []
        for action in entry.get("actions") or []:
            result = self.action(action)
            if isinstance(result, str):
                self._problem(where, f"{result}; descriptor not exported")
                return None
            key, source, tests = result
            entries.append((key, source))
            condition.extend(tests)
        return Producer(where, tuple(entries), tuple(condition)) if entries else None

    def action(self, action: Mapping[str, Any]) -> tuple[str, Source, Condition] | str:
        """One action as ``(descriptor key, value source, presence tests)``, or why not."""
        if len(action) != 1:
            return f"action {sorted(action)} is not one action"
        kind, body = next(iter(action.items()))
        body = body or {}
        if kind == "remote_address":
            return "remote_address", self._fetch("remote_address", "src"), ()
        if kind == "generic_key":
            return str(body.get("descriptor_key") or "generic_key"), Const(str(body.get("descriptor_value", ""))), ()
        if kind == "request_headers":
            return self._request_header(body)
        if kind == "header_value_match":
            return header_value_match(body)
        return f"action {kind!r} has no HAProxy translation here"

    def _fetch(self, key: str, default: str) -> Fetch:
        sample = self.overrides.get(key)
        if sample is None:
            return Fetch(default, always=True, max_length=ADDRESS_LENGTH)
        return Fetch(sample)

    def _request_header(self, body: Mapping[str, Any]) -> tuple[str, Source, Condition] | str:
        name = str(body.get("header_name", ""))
        key = str(body.get("descriptor_key", ""))
        if body.get("skip_if_absent"):
            return "request_headers with skip_if_absent is not supported"
        if not _HEADER_NAME.fullmatch(name) or not key:
            return f"request_headers header {name!r} / descriptor_key {key!r} not supported"
        fetch = self.overrides.get(key)
        source = Fetch(fetch or f"req.fhdr({name.lower()},1)")
        return key, source, (Test(f"{source.sample} -m found", f"has_{hint_of(key)}"),)

    def _problem(self, where: str, reason: str, exported: bool = False) -> None:
        self.problems.append(Problem(where, reason, exported))


_ROUTE_MATCHES = ("prefix", "path", "path_separated_prefix", "safe_regex")


def route_test(match: Mapping[str, Any]) -> tuple[Test | None, str]:
    """The ACL for an Envoy route ``match`` and a short text for it; None when it cannot be translated."""
    unsupported = sorted(set(match) - {*_ROUTE_MATCHES, "case_sensitive"})
    kinds = [kind for kind in _ROUTE_MATCHES if kind in match]
    if unsupported or len(kinds) != 1:
        return None, f"match on {', '.join(unsupported) or 'no path'} is not exported"
    kind = kinds[0]
    value = match[kind]
    text = str((value or {}).get("regex", "")) if kind == "safe_regex" else str(value)
    if unquotable(text):
        return None, "a match holding a line break cannot be written into the config"
    flag = "-i " if match.get("case_sensitive") is False else ""
    return Test(path_body(kind, text, flag), "path"), f"{kind} {text}"


def path_body(kind: str, value: str, flag: str) -> str:
    """The ACL body for one kind of Envoy path match (Envoy ignores the query string in all of them)."""
    if kind == "prefix":
        return f"path_beg {flag}{patterns([value])}"
    if kind == "path":
        return f"path -m str {flag}{patterns([value])}"
    regex = full_regex(value) if kind == "safe_regex" else "^" + re.escape(value) + "(?:/.*)?$"
    return f"path -m reg {flag}{quote(regex)}"


def header_value_match(body: Mapping[str, Any]) -> tuple[str, Source, Condition] | str:
    """Envoy's ``header_value_match``: a constant entry present when every header matcher holds."""
    key = str(body.get("descriptor_key") or "header_match")
    value = str(body.get("descriptor_value", ""))
    tests: list[Test] = []
    for matcher in body.get("headers") or []:
        result = header_tests(matcher, hint_of(value))
        if isinstance(result, str):
            return result
        tests.extend(result)
    if not tests:
        return "header_value_match without headers is not supported"
    if body.get("expect_match") is False:
        if len(tests) != 1:
            return "header_value_match with expect_match false on several tests is not supported"
        tests = [tests[0].negate()]
    return key, Const(value), tuple(tests)


def header_sample(name: str) -> tuple[str, bool] | None:
    """The sample for a header in a matcher and whether it is on every request."""
    if name == ":method":
        return "method", True
    if name == ":path":
        return "pathq", True
    if name == ":authority":
        return "req.fhdr(host,1)", False
    if _HEADER_NAME.fullmatch(name):
        return f"req.fhdr({name.lower()},1)", False
    return None


_STRING_MATCHES = {"exact": "str", "prefix": "beg", "suffix": "end", "contains": "sub"}
_LEGACY_MATCHES = {
    "exact_match": "exact",
    "prefix_match": "prefix",
    "suffix_match": "suffix",
    "contains_match": "contains",
}


def header_tests(matcher: Mapping[str, Any], hint: str) -> Condition | str:
    """The tests one Envoy ``HeaderMatcher`` stands for (a missing header never matches)."""
    name = str(matcher.get("name", ""))
    sample = header_sample(name)
    if sample is None:
        return f"header matcher on {name!r} is not supported"
    fetch, always = sample
    found = Test(f"{fetch} -m found", f"has_{hint_of(name)}")
    body = match_body(fetch, matcher)
    if body is None:
        return f"header matcher on {name!r}: only exact, prefix, suffix, contains, safe_regex and present are supported"
    if body == "present":
        present = (matcher.get("present_match", True) is not False) != bool(matcher.get("invert_match"))
        return (found if present else found.negate(),)
    test = Test(body, hint)
    if matcher.get("invert_match"):
        test = test.negate()
        return (test,) if always else (found, test)
    return (test,)


def string_match(matcher: Mapping[str, Any]) -> dict[str, Any]:
    """A header matcher's ``string_match``, with the legacy ``*_match`` fields folded into it."""
    found = dict(matcher.get("string_match") or {})
    for legacy, kind in _LEGACY_MATCHES.items():
        if legacy in matcher:
            found[kind] = matcher[legacy]
    if "safe_regex_match" in matcher:
        found["safe_regex"] = matcher["safe_regex_match"]
    return found


def match_body(fetch: str, matcher: Mapping[str, Any]) -> str | None:
    """The ACL body of a header matcher's value test, ``"present"``, or None when unsupported."""
    wanted = string_match(matcher)
    if "present_match" in matcher and not wanted:
        return "present"
    flag = "-i " if wanted.pop("ignore_case", False) else ""
    if len(wanted) != 1:
        return None
    kind, value = next(iter(wanted.items()))
    text = str((value or {}).get("regex", "")) if kind == "safe_regex" else str(value)
    if unquotable(text) or kind not in {*_STRING_MATCHES, "safe_regex"}:
        return None
    if kind in _STRING_MATCHES:
        return f"{fetch} -m {_STRING_MATCHES[kind]} {flag}{patterns([text])}"
    if fetch == "method" and not flag and _METHODS.fullmatch(text):
        return f"method -m str {' '.join(text.split('|'))}"
    return f"{fetch} -m reg {flag}{quote(full_regex(text))}"
