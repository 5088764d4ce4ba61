"""The Envoy config's routes as HAProxy sees them: which descriptors (:class:`Producer`) each
route's ``rate_limits`` send, and the ACLs for its path match and header matchers.

Finding the routes and the rules both exporters share are :mod:`sidecar.export.envoy_routes`;
this module writes route matches and actions as HAProxy ACLs and samples, into :class:`Sources`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from sidecar.export.envoy_routes import (
    RoutedLimits,
    filter_domain,
    filter_stage,
    inline_routes,
    one_action,
    ratelimit_filter,
    read_envoy,
    routed_limits,
    skipped_entry,
    string_match,
)
from sidecar.export.haproxy.model import (
    ADDRESS_LENGTH,
    Condition,
    Const,
    Fetch,
    Producer,
    Route,
    Source,
    Sources,
    Test,
)
from sidecar.export.haproxy.words import full_regex, hint_of, patterns, quote, unquotable
from sidecar.export.hosts import Domain, HostTest, host_tests
from sidecar.export.problems import ExportError, Problem

_HEADER_NAME = re.compile(r"[A-Za-z0-9_.-]+")
_METHODS = re.compile(r"[A-Z]+(?:\|[A-Z]+)*")


def sources_from_envoy(path: Path, overrides: Mapping[str, str]) -> Sources:
    """Routes and descriptors of the Envoy config at ``path``, ``overrides`` replacing key fetches."""
    manager, limiter = ratelimit_filter(read_envoy(path), path)
    domain = filter_domain(limiter, path)
    route_config = inline_routes(manager, path)
    try:
        reader = EnvoyReader(str(path), filter_stage(limiter), overrides)
        routes = reader.virtual_hosts(route_config)
        hosts = host_choice(host_tests(route_config, str(path)))
    except (AttributeError, TypeError, ValueError) as error:
        raise ExportError(f"{path}: not the shape of an Envoy v3 config ({error})") from None
    return Sources(domain, str(path), tuple(routes), tuple(reader.problems), hosts)


_RANK = {"exact": 0, "suffix": 1, "prefix": 2, "any": 3}


def host_choice(tests: Sequence[HostTest]) -> tuple[tuple[int, Test], ...]:
    """How HAProxy picks the virtual host Envoy would: ``(host number, domain test)`` in Envoy's
    order (exact domains, then suffix wildcards longest first, then prefix ones, then ``*``), the
    first that holds setting ``txn.rl_host``; empty when one host takes every request."""
    if len(tests) == 1 and tests[0].everything:
        return ()
    domains = [(number, domain, test.ignore_port) for number, test in enumerate(tests) for domain, _ in test.choices]
    domains.sort(key=lambda item: (_RANK[item[1].kind], -len(item[1].text)))
    return tuple((number, domain_test(domain, ignore_port)) for number, domain, ignore_port in domains)


def domain_test(domain: Domain, ignore_port: bool) -> Test:
    """The ACL of one ``domains`` entry on the Host header (lower-cased; a wildcard stands for
    one character or more; the port optional when Envoy ignores it)."""
    hint = "host_" + (hint_of(str(domain)) if domain.kind != "any" else "any")
    if domain.kind == "any":
        return Test("req.hdr(host) -m found", hint)
    if domain.kind == "exact" and not ignore_port:
        return Test(f"req.hdr(host),lower -m str {patterns([domain.text])}", hint)
    text = re.escape(domain.text)
    rest = "[^:]+" if ignore_port else ".+"
    body = {"exact": text, "suffix": rest + text, "prefix": text + rest}[domain.kind]
    port = "(?::[0-9]*)?" if ignore_port else ""
    return Test(f"req.hdr(host),lower -m reg {quote('^' + body + port + '$')}", hint)


@dataclass(slots=True)
class EnvoyReader:
    """Turns virtual hosts, routes and rate-limit actions into :class:`Route` and :class:`Producer`."""

    origin: str
    stage: int
    overrides: Mapping[str, str]
    problems: list[Problem] = field(default_factory=list)

    def virtual_hosts(self, route_config: Mapping[str, Any]) -> list[Route]:
        """Every route of every virtual host, in match order; with several hosts each route
        also tests its host (``txn.rl_host``, set by :func:`host_choice`)."""
        found = list(routed_limits(route_config, self.origin, self._problem))
        numbers = {name: number for number, name in enumerate(dict.fromkeys(item.host.name for item in found))}
        several = len(numbers) > 1 or any(not item.host.everything for item in found)
        routes: list[Route] = []
        for item in found:
            exported = self.route(item)
            if exported is not None:
                number = numbers[item.host.name]
                host = Test(f"var(txn.rl_host) -m int {number}", f"host{number}") if several else None
                routes.append(replace(exported, host=host))
        return routes

    def route(self, found: RoutedLimits) -> Route | None:
        """One route: its path test and the producers of its ``rate_limits`` (and its host's);
        None (reported) when its match cannot be translated, so the requests it would take go
        on to the later routes."""
        match = found.route.get("match") or {}
        test, text = route_test(match)
        if test is None:
            where = f"{self.origin}: route {found.index}"
            self._problem(where, f"{text}; its requests fall through to later routes in HAProxy")
            return None
        label = found.label
        test = replace(test, hint=hint_of(text))
        producers = []
        for where, entry in found.entries:
            producer = self.producer(where, entry)
            if producer is not None:
                producers.append(producer)
        return Route(label, test, tuple(producers))

    def producer(self, where: str, entry: Mapping[str, Any]) -> Producer | None:
        """The descriptor one ``rate_limits`` entry produces, or None (reported) when it cannot be read."""
        skipped = skipped_entry(entry, self.stage)
        if skipped is not None:
            self._problem(where, *skipped)
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
        found = one_action(action)
        if isinstance(found, str):
            return found
        kind, body = found
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
