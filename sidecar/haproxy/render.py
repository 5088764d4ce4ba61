"""Export rate-limit rules to HAProxy 2.6: stick tables, ``track-sc`` rules and 429 denials.

Some pods run HAProxy rather than Envoy, and the comparison harness runs both, so
the same limits must be enforceable by HAProxy alone. The descriptor config does not
say how a request becomes descriptors: the proxy decides that. So the exporter reads
the Envoy config's route ``rate_limits`` (``--envoy``) and replays them as HAProxy
rules; without Envoy, ``--fetch``/``--when`` flags say where each key's value comes
from. Whatever cannot be translated faithfully is listed on stderr with the reason:
a rule is never left out silently.

Two flavours:

``fixed``
    The sidecar's windows exactly: the key of a counter carries the window number
    (``date`` divided by the window length), so counts restart at the same wall-clock
    boundaries as in every sidecar replica.
``sliding``
    HAProxy's own rate counters (``gpc_rate`` over the window length): a rate over
    the last period, which HAProxy estimates from the current period's count plus the
    previous one's weighted by the part of the period still to come. Not clock-aligned:
    no burst of twice the limit across a boundary, but the estimate assumes the previous
    period's hits were spread evenly, so after a quiet period a burst followed by a flood
    can pass close to twice the limit in one window-long span (measured: 36 in one second
    at 20/s, ``loadtest/compare.py``), and the counts are not the sidecar's.

Both count *admitted* requests only (``sc-inc-gpc`` after every check, never
``http_req_rate``, which also counts the requests it denies: a client flooding
above the limit would never get through again), and a request is all-or-nothing like
in the sidecar: every check runs before any counter is incremented, so a request
refused by one limit spends nothing from the others.

The config extensions: a window of ``unit_multiplier`` units is just another window
length (its own table); every limit of a ``rate_limits`` node is one more rule (a slot,
and a tracker when its window differs); a ``sliding_window`` rule of the fixed flavour
adds the previous clock window's weighted count (``table_gpc`` on the previous window's
key), which is the sidecar's estimate, where ``gpc_rate`` would start its periods at an
entry's first count; a ``ban_duration`` is the ban's end in a ``gpt`` slot of a bans
table keyed without the window, written by the request that goes over (its own tracker)
and read with ``table_gpt``. A ``token_bucket`` has no HAProxy 2.6 counterpart and is
listed.
"""

from __future__ import annotations

import argparse
import re
import shlex
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import yaml

from sidecar.config.load import load_config
from sidecar.config.model import UNIT_BY_SECONDS, DescriptorNode, DomainConfig, Level, RateLimitRule
from sidecar.limiter.algorithms import Algorithm

Flavour = Literal["fixed", "sliding"]
FLAVOURS: tuple[Flavour, ...] = ("fixed", "sliding")
TRACKERS = 3
"""HAProxy 2.6 tracks at most sc0..sc2 per request (``MAX_SESS_STKCTR``, a build-time constant)."""
MAX_SLOTS = 100
"""A ``gpc``/``gpc_rate`` array holds at most 100 counters: the rules of one window length share a
table, one slot each, so an entry (one key) holds every such rule's count and needs one tracker."""
KEY_LENGTH = 64
"""``len`` of every table's string keys. An IP address or a typical API key fits with the
window number and stays readable in ``show table``; a longer key is replaced by a hash,
since HAProxy would silently truncate it and let two keys share a counter."""
HASH_BYTES = 16
"""Long keys become the first 128 bits of their SHA-256, in hex (32 characters, no ``:``,
so never equal to a raw key, which always holds one). A cryptographic hash, because a
client who can choose a value must not be able to land on someone else's counter, which
``xxh64`` with its public seed would not prevent."""
MAX_TIMER_SECONDS = (2**31 - 1) // 1000
"""HAProxy refuses an ``expire`` or a rate period longer than 2^31 - 1 ms (~24.8 days)."""
DEFAULT_TABLE_SIZE = "1m"
RATELIMIT_FILTER = "envoy.filters.http.ratelimit"
HTTP_CONNECTION_MANAGER = "envoy.filters.network.http_connection_manager"
FLAGS_ROUTE = "all requests"
"""The one route of an export from flags: every descriptor may come with any request."""
ADDRESS_LENGTH = 45
"""Longest text form of an IPv6 address (with an embedded IPv4 one)."""

_SAFE_WORD = re.compile(r"[A-Za-z0-9_.:/@%+=^~-]+")
_SAFE_CONSTANT = re.compile(r"[A-Za-z0-9_.:/@=+~-]+")
"""Constants that may appear inside ``concat(...)`` without a second level of quoting."""
_HEADER_NAME = re.compile(r"[A-Za-z0-9_.-]+")
_METHODS = re.compile(r"[A-Z]+(?:\|[A-Z]+)*")


class ExportError(Exception):
    """The inputs cannot be exported at all (unreadable Envoy config, unknown domain, bad flag)."""


# ---------------------------------------------------------------- what the proxy sends


@dataclass(frozen=True, slots=True)
class Fetch:
    """An entry value HAProxy reads from the request, as a sample expression (``src``)."""

    sample: str
    always: bool = False
    """Present on every request (the client address): no presence test needed."""
    max_length: int | None = None
    """A known bound on the value's length: keys that surely fit skip the hashing step."""


@dataclass(frozen=True, slots=True)
class Const:
    """An entry value fixed by the proxy config (Envoy's ``generic_key``)."""

    value: str


Source = Fetch | Const


@dataclass(frozen=True, slots=True)
class Test:
    """One ACL: ``body`` is everything after the ACL's name; ``hint`` helps name it."""

    body: str
    hint: str
    negated: bool = False

    def negate(self) -> Test:
        """The same ACL, used with ``!``."""
        return replace(self, negated=not self.negated)


Condition = tuple[Test, ...]
"""All tests must hold (HAProxy's ``if a b c``)."""


@dataclass(frozen=True, slots=True)
class Producer:
    """A descriptor the proxy sends whenever ``condition`` holds: one Envoy ``rate_limits`` entry."""

    origin: str
    entries: tuple[tuple[str, Source], ...]
    condition: Condition = ()


@dataclass(frozen=True, slots=True)
class Route:
    """Requests a route takes (``match``; None takes all) and the descriptors it sends for them."""

    label: str
    match: Test | None
    producers: tuple[Producer, ...]


@dataclass(frozen=True, slots=True)
class Problem:
    """Something not exported (``exported=False``) or exported with a difference (a note)."""

    where: str
    reason: str
    exported: bool = False

    def __str__(self) -> str:
        return f"{'note' if self.exported else 'not exported'}: {self.where}: {self.reason}"


@dataclass(frozen=True, slots=True)
class Sources:
    """Everything known about the requests: the domain, the routes in match order, problems."""

    domain: str
    origin: str
    routes: tuple[Route, ...]
    problems: tuple[Problem, ...] = ()


# ---------------------------------------------------------------- HAProxy words


def quote(word: str) -> str:
    """One config word, single-quoted when needed (no ``$`` expansion, no escapes inside)."""
    if _SAFE_WORD.fullmatch(word) and not word.startswith("-"):
        return word
    return "'" + word.replace("'", "'\\''") + "'"


def patterns(values: Sequence[str]) -> str:
    """ACL patterns; ``--`` first when one could be taken for a flag."""
    words = " ".join(quote(value) for value in values)
    return f"-- {words}" if any(value.startswith("-") for value in values) else words


_LINE_BREAKS = re.compile(r"[\x00\n\r]")
_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")


def unquotable(value: str) -> bool:
    """True when ``value`` cannot be written into a config line (nor be read from an HTTP request)."""
    return _LINE_BREAKS.search(value) is not None


def printable(text: str) -> str:
    """``text`` for a comment line: control characters escaped, so a value cannot end the comment."""
    return _CONTROL.sub(lambda found: f"\\x{ord(found.group()):02x}", text)


def full_regex(regex: str) -> str:
    """Envoy's RE2 matches the whole value; PCRE needs anchors for that."""
    return f"^(?:{regex})$"


def wildcard_test(sample: str, pattern: str, hint: str) -> Test:
    """The ACL for a config value with ``*`` wildcards, as :func:`wildcard_matcher` reads it."""
    if pattern.endswith("*") and pattern.count("*") == 1:
        return Test(f"{sample} -m beg {patterns([pattern[:-1]])}", hint)
    regex = "(?s)^" + ".*".join(re.escape(part) for part in pattern.split("*")) + "$"
    return Test(f"{sample} -m reg {quote(regex)}", hint)


def hint_of(text: str) -> str:
    """A fragment of an ACL name from any text."""
    return re.sub(r"[^a-z0-9]+", "_", text.lower()).strip("_")[:32] or "x"


# ---------------------------------------------------------------- Envoy routes as producers


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


# ---------------------------------------------------------------- flags instead of Envoy


def sources_from_flags(
    domain: DomainConfig, fetches: Mapping[str, str], whens: Mapping[tuple[str, str], str]
) -> Sources:
    """Descriptors read off the config tree itself: a key's value from ``--fetch``, a constant's presence
    from ``--when``; every path down to a rule is assumed sent on every request whose tests hold."""
    fetch_of = {"remote_address": "src", **fetches}
    shapes: dict[tuple[tuple[str, Source], ...], Condition] = {}
    order = {id(rule): index for index, rule in enumerate(domain.rules)}
    first: dict[tuple[tuple[str, Source], ...], int] = {}
    """The config position of the first rule each shape reaches: producers keep the config's order."""
    problems: list[Problem] = []

    def visit(level: Level, path: tuple[tuple[str, Source], ...], condition: Condition) -> None:
        for node in level.nodes():
            step = flag_step(node, fetch_of, whens)
            if isinstance(step, str):
                problems.extend(Problem(where_of(rule), step) for rule in subtree_rules(node))
                continue
            (key, source), tests = step
            here, held = (*path, (key, source)), (*condition, *tests)
            if node.rule is not None:
                shapes.setdefault(here, held)
                first[here] = min(first.get(here, len(order)), order[id(node.rule)])
            visit(node.children, here, held)

    visit(domain.root, (), ())
    producers = tuple(
        Producer("flags", entries, condition)
        for entries, condition in sorted(shapes.items(), key=lambda item: first[item[0]])
    )
    return Sources(domain.name, "--fetch/--when flags", (Route(FLAGS_ROUTE, None, producers),), tuple(problems))


def flag_step(
    node: DescriptorNode, fetch_of: Mapping[str, str], whens: Mapping[tuple[str, str], str]
) -> tuple[tuple[str, Source], Condition] | str:
    """A tree node's entry as the flags describe it, or why it cannot be produced."""
    sample = fetch_of.get(node.key)
    if sample is not None:
        source = Fetch(sample, always=sample == "src", max_length=ADDRESS_LENGTH if sample == "src" else None)
        presence = () if source.always else (Test(f"{sample} -m found", f"has_{hint_of(node.key)}"),)
        return (node.key, source), presence
    if node.value is not None and node.wildcard is None:
        acl = whens.get((node.key, node.value))
        if acl is not None:
            return (node.key, Const(node.value)), (Test(acl, f"when_{hint_of(node.value)}"),)
        return f"no --when {node.key}={node.value} says when HAProxy sends it (or --fetch {node.key}=SAMPLE)"
    return f"no --fetch {node.key}=SAMPLE says where HAProxy reads the {node.key!r} value"


def node_limits(node: DescriptorNode) -> tuple[RateLimitRule, ...]:
    """The limits of a node: its ``rate_limit`` (or first ``rate_limits`` entry), then the others."""
    return () if node.rule is None else (node.rule, *node.more)


def subtree_rules(node: DescriptorNode) -> Iterator[RateLimitRule]:
    """Every rule at or below ``node``."""
    yield from node_limits(node)
    for child in node.children.nodes():
        yield from subtree_rules(child)


def where_of(rule: RateLimitRule) -> str:
    """How problems name a rule: its file and line, stat key and name, and which of a node's
    ``rate_limits`` it is (several can share a line and a stat key)."""
    name = f" ({rule.name})" if rule.name else ""
    entry = f" {rule.where.rsplit('.', 1)[-1]}" if ".rate_limits[" in rule.where else ""
    return f"{rule.source}: {rule.stat_key}{name}{entry}"


# ---------------------------------------------------------------- descriptors onto rules


@dataclass(frozen=True, slots=True)
class Target:
    """A rule one producer's descriptor lands on, with the tests selecting that branch of the tree."""

    rule: RateLimitRule
    route: int
    condition: Condition
    """The producer's presence tests and the branch tests (not the route's)."""
    key: tuple[Source, ...]
    """The values that make the counter key, as :func:`match_descriptor` collects them."""


def targets_of(domain: DomainConfig, route: int, producer: Producer) -> list[Target]:
    """Every rule the producer's descriptor can land on, replaying the match walk with unknown values."""
    found: list[Target] = []
    last = len(producer.entries) - 1

    def walk(level: Level, index: int, condition: Condition, key: tuple[Source, ...]) -> None:
        name, source = producer.entries[index]
        for node, tests in candidates(level, name, source):
            held = (*condition, *tests)
            values = (*key, source) if node.counts_each_value else key
            if index < last:
                walk(node.children, index + 1, held, values)
            else:
                # Every limit of the node (``rate_limits``): each its own counter, checked together.
                found.extend(Target(rule, route, held, values) for rule in node_limits(node))

    walk(domain.root, 0, producer.condition, ())
    return found


def candidates(level: Level, key: str, source: Source) -> list[tuple[DescriptorNode, Condition]]:
    """The nodes an entry can land on and the tests for each: exact value, then wildcards in order,
    then the key-only default, as :func:`find_node` picks them."""
    if isinstance(source, Const):
        node = level.exact.get((key, source.value))
        if node is None:
            node = next((n for n in level.wildcards.get(key, ()) if n.wildcard and n.wildcard(source.value)), None)
        node = node or level.defaults.get(key)
        return [] if node is None else [(node, ())]
    earlier: list[Test] = []
    found: list[tuple[DescriptorNode, Condition]] = []
    exact = [node for (name, value), node in level.exact.items() if name == key and not unquotable(value)]
    for node in exact:
        test = Test(f"{source.sample} -m str {patterns([node.value or ''])}", hint_of(f"{key}_is_{node.value}"))
        found.append((node, (test,)))
        earlier.append(test.negate())
    for node in level.wildcards.get(key, ()):
        if unquotable(node.value or ""):
            continue
        test = wildcard_test(source.sample, node.value or "", hint_of(f"{key}_like_{node.value}"))
        found.append((node, (*earlier, test)))
        earlier.append(test.negate())
    default = level.defaults.get(key)
    if default is not None:
        found.append((default, tuple(earlier)))
    return found


def window_text(rule: RateLimitRule) -> str:
    """``unit minute``, or ``unit minute x 5 (300 s)`` for a window of several units."""
    unit = rule.unit.name.lower() if rule.unit else "?"
    if rule.unit_multiplier == 1:
        return f"unit {unit}"
    return f"unit {unit} x {rule.unit_multiplier} ({rule.unit_seconds} s)"


def rate_of(rule: RateLimitRule) -> str:
    """``20/second``, or ``5/5 minutes`` for a window of several units."""
    unit = rule.unit.name.lower() if rule.unit else "?"
    per = f"{rule.unit_multiplier} {unit}s" if rule.unit_multiplier > 1 else unit
    return f"{rule.requests_per_unit}/{per}"


def keeps_previous_window(rule: RateLimitRule, flavour: Flavour) -> bool:
    """Whether the rule's table must keep an entry one window past its end: every rate of the
    sliding flavour, and a ``sliding_window`` rule of the fixed flavour (which reads the
    previous window's count)."""
    return flavour == "sliding" or rule.algorithm is Algorithm.SLIDING_WINDOW


def rule_problem(rule: RateLimitRule, flavour: Flavour) -> str | None:
    """Why a rule cannot be exported in ``flavour`` at all, or None."""
    if rule.unlimited:
        return None
    if rule.quota_mode:
        return "quota_mode (reject only when every quota descriptor is over) is not exported"
    if rule.algorithm is Algorithm.TOKEN_BUCKET:
        return (
            f"algorithm token_bucket (burst {rule.burst}, refilled at {rate_of(rule)}): HAProxy 2.6 has no token "
            "bucket (its stick tables count hits per period; nothing refills over time), and no window admits "
            "the same requests"
        )
    unit = rule.unit_seconds
    needed = 2 * unit + 1 if keeps_previous_window(rule, flavour) else unit + 1
    if needed > MAX_TIMER_SECONDS:
        if flavour == "sliding":
            what = "a sliding window needs a rate period and expire"
        elif rule.algorithm is Algorithm.SLIDING_WINDOW:
            what = "a sliding_window rule keeps the previous window: it needs a table expire"
        else:
            what = "a fixed window needs a table expire"
        return (
            f"{window_text(rule)}: {what} of {needed} s; HAProxy 2.6 allows at most {MAX_TIMER_SECONDS} s (~24.8 days)"
        )
    return None


def ban_problem(rule: RateLimitRule) -> str | None:
    """Why a rule's ``ban_duration`` cannot be exported (the limit itself still is), or None."""
    needed = rule.ban_seconds + 1
    if needed > MAX_TIMER_SECONDS:
        return (
            f"ban_duration {rule.ban_seconds} s not exported (the limit is): a ban is kept in a table whose expire "
            f"would be {needed} s; HAProxy 2.6 allows at most {MAX_TIMER_SECONDS} s (~24.8 days)"
        )
    return None


def slot_problem(taken: set[int], rule_id: int) -> str | None:
    """Take a slot in the table of the rule's window length, or say why there is none left."""
    if rule_id not in taken and len(taken) >= MAX_SLOTS:
        return f"more than {MAX_SLOTS} rules with this window: a HAProxy gpc array holds {MAX_SLOTS} counters"
    taken.add(rule_id)
    return None


def source_problem(source: Source) -> str | None:
    """Why a key part cannot be written into a ``concat`` argument, or None."""
    if isinstance(source, Const) and not _SAFE_CONSTANT.fullmatch(source.value):
        return f"constant value {source.value!r} in the counter key needs quoting the exporter does not do"
    return None


# ---------------------------------------------------------------- the plan


@dataclass(frozen=True, slots=True)
class ExportOptions:
    """How to export: flavour, table size, optional peers section, the command for the header."""

    flavour: Flavour = "fixed"
    table_size: str = DEFAULT_TABLE_SIZE
    peers: str | None = None
    command: str = ""


@dataclass(frozen=True, slots=True)
class Table:
    """One stick table per window length; each rule with that window owns one counter slot.

    The bans table (``seconds`` 0) holds one ``gpt`` slot per rule with a ``ban_duration``.
    """

    name: str
    seconds: int
    rules: tuple[int, ...]
    """Rule ids in slot order."""
    keeps_previous: bool = False
    """Entries live one window past their end (rates, or a sliding_window rule reading the previous window)."""

    def slot(self, rule_id: int) -> int:
        return self.rules.index(rule_id)


GroupKey = tuple[int, tuple[Source, ...]]
"""``(window seconds, key parts)``: targets with equal group keys share one table entry and tracker."""
BanKey = tuple[Source, ...]
"""The key parts of a ban entry: no window, since a ban outlives windows."""


@dataclass(frozen=True, slots=True)
class Placed:
    """A target that made it into the output: its rule id, tracker and conditions."""

    target: Target
    rule_id: int
    tracker: int
    group: int
    condition: Condition
    """The target's condition and, for a replaceable rule, the 'not replaced' test; no route test."""
    ban: tuple[int | None, int] | None = None
    """``(tracker, ban group)`` of the rule's ban entry, when its ``ban_duration`` is exported; the
    tracker that starts a ban is None on a route with none left (it only enforces running bans)."""


@dataclass(frozen=True, slots=True)
class Merged:
    """What the output says about one rule on one tracker: the routes are folded into ``condition``."""

    rule: RateLimitRule
    rule_id: int
    tracker: int
    group: int
    condition: Condition
    ban: tuple[int | None, int] | None = None


@dataclass(frozen=True, slots=True)
class Export:
    """The result: the config fragment and every problem found on the way."""

    text: str
    problems: tuple[Problem, ...]


class Planner:
    """Decides tables, trackers and conditions; :class:`Renderer` writes them out."""

    def __init__(self, domain: DomainConfig, sources: Sources, options: ExportOptions) -> None:
        self.domain = domain
        self.sources = sources
        self.options = options
        self.rule_ids = {id(rule): index for index, rule in enumerate(domain.rules)}
        self.problems: list[Problem] = list(sources.problems)
        self.targets = [
            target
            for route_index, route in enumerate(sources.routes)
            for producer in route.producers
            for target in targets_of(domain, route_index, producer)
        ]
        self.replacers = self._replacers()
        self.groups: list[GroupKey] = []
        self.ban_groups: list[BanKey] = []
        self.banned: tuple[int, ...] = ()
        """Rule ids whose ban is exported, in gpt slot order."""
        self.placed = self._place()
        self.tables = self._tables()
        self.bans = self._bans_table()
        self._report_unreached()

    def rule_id(self, rule: RateLimitRule) -> int:
        return self.rule_ids[id(rule)]

    def route_test(self, routes: Iterable[int]) -> Condition:
        """The test that the request took one of ``routes``: one ACL, as its patterns are alternatives."""
        chosen = sorted(set(routes))
        if all(route.match is None for route in self.sources.routes):
            return ()
        if len(chosen) == len(self.sources.routes):
            return (Test("var(txn.rl_route) -m found", "routed"),)
        numbers = " ".join(map(str, chosen))
        return (Test(f"var(txn.rl_route) -m int {numbers}", "route" + "_".join(map(str, chosen))),)

    def base_condition(self, target: Target) -> Condition:
        return (*self.route_test([target.route]), *target.condition)

    def merged(self) -> list[Merged]:
        """Placed targets that differ only by route, as one item with a test for all their routes."""
        routes: dict[tuple[int, int, int, Condition, tuple[int | None, int] | None], list[int]] = {}
        for item in self.placed:
            key = (item.rule_id, item.tracker, item.group, item.condition, item.ban)
            routes.setdefault(key, []).append(item.target.route)
        return [
            Merged(self.domain.rules[rule_id], rule_id, tracker, group, (*self.route_test(on), *condition), ban)
            for (rule_id, tracker, group, condition, ban), on in routes.items()
        ]

    def _replacers(self) -> dict[str, list[Target]]:
        """For each replaced rule name, the targets whose rule replaces it (the sidecar drops replaced
        limits from the whole request, whether the replacing rule is itself enforced or not)."""
        replacers: dict[str, list[Target]] = {}
        for target in self.targets:
            for name in sorted(target.rule.replaces):
                replacers.setdefault(name, []).append(target)
        return replacers

    def replaced_test(self, rule: RateLimitRule) -> Condition:
        if rule.name is None or rule.name not in self.replacers:
            return ()
        index = sorted(self.replacers).index(rule.name)
        return (Test(f"var(txn.rl_replaced{index}) -m found", f"replaced{index}", negated=True),)

    def _place(self) -> list[Placed]:
        """Give each exportable target its group and tracker, per route in descriptor order.

        Shadow rules come last: when a route runs out of trackers, a rule that only reports
        loses its counter rather than one that enforces a limit.
        """
        placed: list[Placed] = []
        refused: set[int] = set()
        trackers: dict[int, dict[tuple[str, int], int]] = {}
        """Per route: ("count", group) or ("ban", ban group) -> tracker, in order of first use."""
        slots: dict[int, set[int]] = {}
        """Per window length: the rules with a slot in its table."""
        for target in sorted(self.targets, key=lambda target: target.rule.shadow_mode):
            rule = target.rule
            rule_id = self.rule_id(rule)
            if rule.unlimited:
                continue
            reason = (
                rule_problem(rule, self.options.flavour)
                or next(filter(None, map(source_problem, target.key)), None)
                or slot_problem(slots.setdefault(rule.unit_seconds, set()), rule_id)
            )
            if reason is not None:
                if rule_id not in refused:
                    refused.add(rule_id)
                    self.problems.append(Problem(where_of(rule), reason))
                continue
            group = self._group((rule.unit_seconds, target.key))
            on_route = trackers.setdefault(target.route, {})
            tracker = on_route.setdefault(("count", group), len(on_route))
            if tracker >= TRACKERS:
                self._tracker_problem(target)
                continue
            condition = (*target.condition, *self.replaced_test(rule))
            placed.append(Placed(target, rule_id, tracker, group, condition))
        placed = self._place_bans(placed, trackers)
        self._note_differences(placed)
        return placed

    def _place_bans(self, placed: list[Placed], trackers: dict[int, dict[tuple[str, int], int]]) -> list[Placed]:
        """Give each placed rule with a ``ban_duration`` its ban entry, and the tracker that starts a ban.

        After every counter has its tracker: a route short of trackers loses a ban rather than a
        limit. Reading a ban needs no tracker (``table_gpt``), so such a route still refuses a
        client banned through another route; when no route can start the rule's ban, it is not
        exported. A ban entry is keyed by the values alone (a ban outlives the windows), one
        ``gpt`` slot per rule, so rules with the same values share an entry and a tracker.
        """
        keys: list[BanKey] = []
        chosen: list[tuple[Placed, int | None, int | None]] = []
        """Each item with its ban tracker (None: read only) and key index, or no ban at all."""
        starts: set[int] = set()
        for item in placed:
            rule = item.target.rule
            reason = ban_problem(rule) if rule.ban_seconds else None
            if not rule.ban_seconds or reason is not None:
                if reason is not None:
                    self._note_once(rule, reason)
                chosen.append((item, None, None))
                continue
            if item.target.key not in keys:
                keys.append(item.target.key)
            index = keys.index(item.target.key)
            on_route = trackers.setdefault(item.target.route, {})
            tracker = on_route.get(("ban", index))
            if tracker is None and len(on_route) < TRACKERS:
                tracker = on_route[("ban", index)] = len(on_route)
            if tracker is not None:
                starts.add(item.rule_id)
            chosen.append((item, tracker, index))
        banned = sorted(starts)[:MAX_SLOTS]
        result: list[Placed] = []
        for item, tracker, key in chosen:
            rule = item.target.rule
            if key is None:  # no ban, or one that cannot be exported at all
                result.append(item)
                continue
            if item.rule_id not in banned:
                why = (
                    f"more than {MAX_SLOTS} rules with a ban, and a HAProxy gpt array holds {MAX_SLOTS}"
                    if item.rule_id in starts
                    else f"starting a ban needs a stick counter beyond sc{TRACKERS - 1} for its entry (keyed by "
                    "the values, without the window) on every route that reaches it"
                )
                self._note_once(rule, f"ban_duration not exported (the limit is): {why}")
                result.append(item)
                continue
            if tracker is None:
                label = self.sources.routes[item.target.route].label
                self._note_once(
                    rule,
                    f"on {label}: a running ban is enforced, but no ban starts here: that needs a stick counter "
                    f"beyond sc{TRACKERS - 1} for the ban entry (keyed by the values, without the window)",
                )
            result.append(replace(item, ban=(tracker, self._ban_group(keys[key]))))
        self.banned = tuple(banned)
        return result

    def _note_once(self, rule: RateLimitRule, reason: str) -> None:
        problem = Problem(where_of(rule), reason, exported=True)
        if problem not in self.problems:
            self.problems.append(problem)

    def _group(self, key: GroupKey) -> int:
        if key not in self.groups:
            self.groups.append(key)
        return self.groups.index(key)

    def _ban_group(self, key: BanKey) -> int:
        if key not in self.ban_groups:
            self.ban_groups.append(key)
        return self.ban_groups.index(key)

    def _tracker_problem(self, target: Target) -> None:
        label = self.sources.routes[target.route].label
        reason = (
            f"on {label}: needs a stick counter beyond sc{TRACKERS - 1}; HAProxy 2.6 tracks "
            f"sc0..sc{TRACKERS - 1} per request (rules sharing key values and window share one)"
        )
        if label == FLAGS_ROUTE:
            reason += "; Envoy routes (--envoy) keep descriptors of different routes apart"
        self.problems.append(Problem(where_of(target.rule), reason))

    def _note_differences(self, placed: Sequence[Placed]) -> None:
        """Notes for rules exported with a documented difference: shadow mode, soft limits, bans,
        repeated descriptors."""
        seen: dict[tuple[int, int, tuple[Source, ...]], int] = {}
        for item in placed:
            slot = (item.target.route, item.rule_id, item.target.key)
            seen[slot] = seen.get(slot, 0) + 1
        noted: set[int] = set()
        soft_noted: set[int] = set()
        ban_noted: set[int] = set()
        for item in placed:
            rule = item.target.rule
            if rule.shadow_mode and item.rule_id not in noted:
                noted.add(item.rule_id)
                self.problems.append(
                    Problem(
                        where_of(rule),
                        "shadow_mode: counted like the sidecar but never denied; a request over it "
                        f"gets /r{item.rule_id} in the txn.rl_shadow variable (log it with %[var(txn.rl_shadow)])",
                        exported=True,
                    )
                )
            if rule.warn_at is not None and item.rule_id not in soft_noted:
                soft_noted.add(item.rule_id)
                self.problems.append(
                    Problem(
                        where_of(rule),
                        f"warn_at {rule.warn_at:g}: the limit is exported, the soft limit is not "
                        "(HAProxy sends no warning header)",
                        exported=True,
                    )
                )
            if item.ban is not None and item.rule_id not in ban_noted:
                ban_noted.add(item.rule_id)
                self.problems.append(
                    Problem(
                        where_of(rule),
                        f"ban_duration {rule.ban_seconds} s: set by the request that goes over, never extended, "
                        "kept as its end in whole Unix seconds rounded up (it can last up to 1 s longer than "
                        "in the sidecar)",
                        exported=True,
                    )
                )
        for (route, rule_id, _), count in seen.items():
            if count > 1:
                rule = self.domain.rules[rule_id]
                label = self.sources.routes[route].label
                self.problems.append(
                    Problem(
                        where_of(rule),
                        f"on {label}: {count} descriptors may land on it; HAProxy checks for room for one hit, "
                        f"the sidecar for {count} (the limit can be passed by {count - 1})",
                        exported=True,
                    )
                )

    def _tables(self) -> list[Table]:
        by_window: dict[int, list[int]] = {}
        for item in self.placed:
            ids = by_window.setdefault(item.target.rule.unit_seconds, [])
            if item.rule_id not in ids:
                ids.append(item.rule_id)
        name = self._table_prefix()
        tables = []
        for seconds in sorted(by_window):
            rule_ids = tuple(sorted(by_window[seconds]))
            unit = UNIT_BY_SECONDS.get(seconds)
            label = unit.name.lower() if unit is not None else f"{seconds}s"
            keeps = any(keeps_previous_window(self.domain.rules[i], self.options.flavour) for i in rule_ids)
            tables.append(Table(f"{name}_{label}", seconds, rule_ids, keeps))
        return tables

    def _bans_table(self) -> Table | None:
        """The table of ban ends, one ``gpt`` slot per rule whose ban is exported."""
        if not self.banned:
            return None
        return Table(f"{self._table_prefix()}_bans", 0, self.banned)

    def _table_prefix(self) -> str:
        return f"rl_{re.sub(r'[^A-Za-z0-9_.-]', '_', self.domain.name)}_{self.options.flavour}"

    def table_of(self, rule_id: int) -> Table:
        return next(table for table in self.tables if rule_id in table.rules)

    def _report_unreached(self) -> None:
        reached = {self.rule_id(target.rule) for target in self.targets}
        reported = {problem.where for problem in self.problems}
        for index, rule in enumerate(self.domain.rules):
            if index in reached or where_of(rule) in reported:
                continue
            reason = f"no descriptor that {self.sources.origin} sends lands on it (nothing to enforce)"
            if unquotable(rule.stat_key):
                reason = "its path holds a value with a line break: no config line (and no HTTP request) carries it"
            self.problems.append(Problem(where_of(rule), reason))


# ---------------------------------------------------------------- rendering


class AclNames:
    """Named ACLs, one per distinct body, so patterns from configs never sit inside ``{ }``."""

    def __init__(self) -> None:
        self.names: dict[str, str] = {}

    def name(self, test: Test) -> str:
        name = self.names.get(test.body)
        if name is None:
            taken = set(self.names.values())
            name = f"rl_{test.hint}"
            suffix = 1
            while name in taken:
                suffix += 1
                name = f"rl_{test.hint}_{suffix}"
            self.names[test.body] = name
        return name

    def condition(self, condition: Iterable[Test]) -> str:
        return " ".join(("!" if test.negated else "") + self.name(test) for test in condition)

    def lines(self) -> list[str]:
        return [f"acl {name} {body}" for body, name in self.names.items()]


class Renderer:
    """Writes a :class:`Planner`'s decisions as HAProxy config lines, in the order HAProxy runs them."""

    def __init__(self, plan: Planner) -> None:
        self.plan = plan
        self.options = plan.options
        self.fixed = plan.options.flavour == "fixed"
        self.acls = AclNames()
        self.values: list[str] = []
        self.lengths: set[int] = set()
        self.merged = plan.merged()
        self.estimated = [item for item in self.merged if self.fixed and is_sliding(item.rule)]
        """Fixed flavour: sliding_window rules, whose count adds the previous window's weighted share."""
        self.banning = [item for item in self.merged if item.ban is not None]
        """Rules whose running bans are enforced; those with a tracker also start them."""

    def render(self) -> str:
        """The whole fragment: frontend lines (indented), then one backend per table."""
        body = [
            *self._routing(),
            *self._replacements(),
            *self._keys(),
            *self._tracking(),
            *self._estimates(),
            *self._bans(),
            *self._checks(),
            *self._counting(),
        ]
        acls = self.acls.lines()
        frontend = [*self._header(), *(["# ACLs"] if acls else []), *acls, *body]
        lines = [f"    {printable(line)}" if line else "" for line in frontend]
        for table in self.plan.tables:
            lines.extend(["", f"backend {table.name}", f"    {self._stick_table(table)}"])
        if self.plan.bans is not None:
            lines.extend(["", f"backend {self.plan.bans.name}", f"    {self._bans_stick_table(self.plan.bans)}"])
        return "\n".join(lines) + "\n"

    def _header(self) -> list[str]:
        plan = self.plan
        kind = (
            "fixed windows aligned to the clock (the key holds date / window), counted in gpc slots"
            if self.fixed
            else "HAProxy rates over the last window length (gpc_rate), not clock-aligned"
        )
        lines = [
            f"# ---- generated by: {self.options.command}" if self.options.command else "# ---- generated",
            f"# domain {plan.domain.name!r} from {plan.domain.source}, descriptors from {plan.sources.origin}",
            f"# flavour {self.options.flavour}: {kind}.",
            "# Counts admitted requests only: every check runs before any counter moves.",
            "# Uses sc0..sc2 and txn.rl_* variables; exact with nbthread 1 (threads may race check and count).",
            *self._extension_notes(),
            "# Rules (id: stat key, limit, where counted):",
        ]
        for index, rule in enumerate(plan.domain.rules):
            lines.append(f"#   r{index}: {self._rule_summary(index, rule)}")
        return lines

    def _extension_notes(self) -> list[str]:
        """Header lines for the extensions the exported rules use (none for a plain config)."""
        rules = [item.rule for item in self.merged]
        lines = []
        if any(".rate_limits[" in rule.where for rule in rules):
            lines += [
                "# rate_limits (several limits on one descriptor): each limit has its own slot and is checked",
                "# with the others before anything is counted: a request refused by one spends none of them.",
            ]
        if any(is_sliding(rule) for rule in rules):
            if self.fixed:
                lines += [
                    "# sliding_window rules, even in this flavour, as the sidecar computes them: the current",
                    "# clock window's count plus the previous window's (read with table_gpc) times the share of",
                    "# it the sliding window still covers (millisecond clock), rounded down. Not gpc_rate, whose",
                    "# periods start at an entry's first count rather than at clock boundaries.",
                ]
            else:
                lines += [
                    "# sliding_window rules: gpc_rate is the sidecar's estimate (current period plus the previous",
                    "# one weighted by the share still covered, rounded down), but its periods start at an",
                    "# entry's first count rather than at clock boundaries.",
                ]
        if self.banning:
            assert self.plan.bans is not None
            lines += [
                "# ban_duration: the request that goes over a limit writes when its ban ends (Unix seconds,",
                f"# rounded up) into the rule's gpt slot in {self.plan.bans.name}, keyed by the values without",
                "# the window; every request on it is refused until then. Never extended: a banned request",
                "# does not start a new ban.",
            ]
        return lines

    def _rule_summary(self, index: int, rule: RateLimitRule) -> str:
        name = f" ({rule.name})" if rule.name else ""
        if ".rate_limits[" in rule.where:
            name += f" {rule.where.rsplit('.', 1)[-1]}"
        if rule.unlimited:
            return f"{rule.stat_key}{name} unlimited: nothing counted"
        flags = " shadow" if rule.shadow_mode else ""
        kind = ""
        if rule.algorithm is Algorithm.SLIDING_WINDOW:
            kind = " sliding_window"
        elif rule.algorithm is Algorithm.TOKEN_BUCKET:
            kind = f" token_bucket burst {rule.burst}"
        ban = f" ban {rule.ban_seconds}s" if rule.ban_seconds else ""
        where = "not exported (see stderr)"
        if any(item.rule_id == index for item in self.plan.placed):
            table = self.plan.table_of(index)
            where = f"{table.name} slot {table.slot(index)}"
            bans = self.plan.bans
            if bans is not None and index in bans.rules:
                where += f", ban in {bans.name} gpt slot {bans.slot(index)}"
        return f"{rule.stat_key}{name} {rate_of(rule)}{kind}{ban}{flags}: {where}"

    def _routing(self) -> list[str]:
        routes = self.plan.sources.routes
        if not routes or routes[0].match is None:
            return []
        lines = ["# 1. the route Envoy would pick: the first whose match holds"]
        routed = Test("var(txn.rl_route) -m found", "routed")
        for index, route in enumerate(routes):
            assert route.match is not None
            guard = "" if index == 0 else f"!{self.acls.name(routed)} "
            lines.append(
                f"http-request set-var(txn.rl_route) int({index}) if {guard}{self.acls.condition([route.match])}"
            )
            lines[-1] += f"  # {route.label}"
        return lines

    def _replacements(self) -> list[str]:
        plan = self.plan
        if not plan.replacers:
            return []
        lines = ["# 2. limits replaced by another rule that applies to this request"]
        for index, name in enumerate(sorted(plan.replacers)):
            for target in plan.replacers[name]:
                condition = self._if(plan.base_condition(target))
                by = plan.rule_id(target.rule)
                lines.append(f"http-request set-var(txn.rl_replaced{index}) bool(1){condition}  # {name} by r{by}")
        return lines

    def _keys(self) -> list[str]:
        plan = self.plan
        if not plan.placed:
            return []
        lines = ["# 3. counter keys: one per window length and key values"]
        previous = sorted({item.group for item in self.estimated})
        """Groups whose previous window's entry is read (sliding_window rules, fixed flavour)."""
        placed = {item.group for item in plan.placed}
        if self.fixed:
            for unit in sorted({plan.groups[group][0] for group in placed}):
                fetch = "date" if unit == 1 else f"date,div({unit})"
                lines.append(f"http-request set-var(txn.rl_w{unit}) {fetch}")
            for unit in sorted({plan.groups[group][0] for group in previous}):
                millis = unit * 1000
                lines.append(
                    f"http-request set-var(txn.rl_w{unit}p) {'date' if unit == 1 else f'date,div({unit})'},sub(1)"
                )
                lines.append(f"http-request set-var(txn.rl_e{unit}) date(0,ms),mod({millis}),neg,add({millis})")
        if self.banning:
            lines.append("http-request set-var(txn.rl_now) date")
        for group, (unit, parts) in enumerate(plan.groups):
            if group not in placed:
                continue  # its rules found no tracker
            used = self._used_condition(group)
            prefix = f"var(txn.rl_w{unit})" if self.fixed else "str()"
            lines.extend(self._key(f"txn.rl_k{group}", prefix, parts, used))
            if group in previous:
                lines.extend(self._key(f"txn.rl_k{group}p", f"var(txn.rl_w{unit}p)", parts, used))
        for ban_group, parts in enumerate(plan.ban_groups):
            routes = {item.target.route for item in plan.placed if item.ban is not None and item.ban[1] == ban_group}
            if routes:  # else no route had a tracker left to set its bans
                lines.extend(self._key(f"txn.rl_b{ban_group}", "str()", parts, self._if(plan.route_test(routes))))
        return lines

    def _key(self, name: str, prefix: str, parts: tuple[Source, ...], used: str) -> list[str]:
        """``<window>:<len>:<v1>:<v2>`` (every value but the last length-prefixed, so no two lists of
        values make one key); hashed when it may not fit the table's key length. Ban keys have no
        window (``prefix`` ``str()``)."""
        lines: list[str] = []
        expression = [prefix]
        for position, part in enumerate(parts):
            last = position == len(parts) - 1
            if isinstance(part, Const):
                expression.append(f"concat(:{part.value})" if last else f"concat(:{len(part.value)}:{part.value})")
                continue
            value = self._value_var(part, lines)
            if not last:
                if value not in self.lengths:
                    self.lengths.add(value)
                    lines.append(f"http-request set-var(txn.rl_l{value}) var(txn.rl_v{value}),length")
                expression.append(f"concat(:,txn.rl_l{value},:)")
                expression.append(f"concat(,txn.rl_v{value},)")
            else:
                expression.append(f"concat(:,txn.rl_v{value},)")
        if not parts:
            expression.append("concat(:)")
        lines.append(f"http-request set-var({name}) {','.join(expression)}{used}")
        if self._may_be_long(parts):
            lines.append(
                f"http-request set-var({name}) var({name}),sha2(256),bytes(0,{HASH_BYTES}),hex"
                f" if {{ var({name}),length gt {KEY_LENGTH} }}"
            )
        return lines

    def _value_var(self, part: Fetch, lines: list[str]) -> int:
        if part.sample not in self.values:
            self.values.append(part.sample)
            index = len(self.values) - 1
            lines.append(f"http-request set-var(txn.rl_v{index}) {part.sample}")
        return self.values.index(part.sample)

    @staticmethod
    def _may_be_long(parts: tuple[Source, ...]) -> bool:
        bound = 11 + sum(
            len(part.value) + 6 if isinstance(part, Const) else (part.max_length or KEY_LENGTH) + 6 for part in parts
        )
        return bound > KEY_LENGTH

    def _used_condition(self, group: int) -> str:
        """Compute a key only on the routes that track it."""
        routes = {item.target.route for item in self.plan.placed if item.group == group}
        return self._if(self.plan.route_test(routes))

    def _tracking(self) -> list[str]:
        if not self.merged:
            return []
        lines = ["# 4. track the counters this request may spend (sc0..sc2)"]
        seen: dict[tuple[int, int], list[Condition]] = {}
        for item in self.merged:
            conditions = seen.setdefault((item.tracker, item.group), [])
            if item.condition not in conditions:
                conditions.append(item.condition)
        for (tracker, group), conditions in seen.items():
            table = self.plan.table_of(next(i.rule_id for i in self.merged if i.group == group))
            guard = "" if () in conditions else " if " + " || ".join(map(self.acls.condition, conditions))
            lines.append(f"http-request track-sc{tracker} var(txn.rl_k{group}) table {table.name}{guard}")
        return lines

    def _estimates(self) -> list[str]:
        """Fixed flavour, sliding_window rules: what the previous clock window adds to the count."""
        if not self.estimated:
            return []
        lines = [
            "# 4b. sliding_window rules: the previous window's count times the share of it the sliding window",
            "#     still covers (ms left in this window / window length), rounded down",
        ]
        done: set[str] = set()
        for item in sorted(self.estimated, key=lambda i: (i.group, i.rule_id)):
            table = self.plan.table_of(item.rule_id)
            slot = table.slot(item.rule_id)
            unit = table.seconds
            line = (
                f"http-request set-var({self._previous_var(item)}) var(txn.rl_k{item.group}p),"
                f"table_gpc({slot},{table.name}),mul(txn.rl_e{unit}),div({unit * 1000})"
                f"{self._used_condition(item.group)}"
            )
            if line not in done:
                done.add(line)
                lines.append(f"{line}  # r{item.rule_id}")
        return lines

    def _previous_var(self, item: Merged) -> str:
        return f"txn.rl_p{item.group}_{self.plan.table_of(item.rule_id).slot(item.rule_id)}"

    def _bans(self) -> list[str]:
        """Start the ban of every rule this request is over (before any denial stops the rules)."""
        starting = [item for item in self.banning if item.ban is not None and item.ban[0] is not None]
        bans = self.plan.bans
        if not starting or bans is None:
            return []
        lines = ["# 4c. bans: a request over a limit with ban_duration starts its ban, unless one is running"]
        tracked: dict[tuple[int | None, int], list[str]] = {}
        for item in starting:
            assert item.ban is not None
            starts = " ".join(
                filter(None, [self.acls.condition(item.condition), self._over(item), self._not_banned(item)])
            )
            alternatives = tracked.setdefault(item.ban, [])
            if starts not in alternatives:
                alternatives.append(starts)
        for (tracker, ban_group), alternatives in tracked.items():
            lines.append(
                f"http-request track-sc{tracker} var(txn.rl_b{ban_group}) table {bans.name}"
                f" if {' || '.join(alternatives)}"
            )
        for item in sorted(starting, key=lambda i: i.rule_id):
            assert item.ban is not None
            end = f"date(0,ms),add({item.rule.ban_seconds * 1000 + 999}),div(1000)"
            lines.append(
                f"http-request sc-set-gpt({bans.slot(item.rule_id)},{item.ban[0]}) {end}"
                f"{self._if(item.condition, self._over(item), self._not_banned(item))}  # r{item.rule_id}"
            )
        return lines

    def _over(self, item: Merged) -> str:
        """The anonymous ACL 'this rule's counter has no room for one more hit'."""
        slot = self.plan.table_of(item.rule_id).slot(item.rule_id)
        if not self.fixed:
            return f"{{ sc_gpc_rate({slot},{item.tracker}) ge {item.rule.requests_per_unit} }}"
        previous = f",add({self._previous_var(item)})" if item in self.estimated else ""
        return f"{{ sc_get_gpc({slot},{item.tracker}){previous} ge {item.rule.requests_per_unit} }}"

    def _ban_left(self, item: Merged) -> str:
        """Seconds until the rule's ban ends (0 or less: no ban)."""
        assert item.ban is not None and self.plan.bans is not None
        bans = self.plan.bans
        return f"var(txn.rl_b{item.ban[1]}),table_gpt({bans.slot(item.rule_id)},{bans.name}),sub(txn.rl_now)"

    def _banned(self, item: Merged) -> str:
        return f"{{ {self._ban_left(item)} gt 0 }}"

    def _not_banned(self, item: Merged) -> str:
        return f"!{self._banned(item)}"

    def _checks(self) -> list[str]:
        if not self.merged:
            return []
        enforced = [item for item in self.merged if not item.rule.shadow_mode]
        shadow = [item for item in self.merged if item.rule.shadow_mode]
        lines = ["# 5. checks, longest window first (its Retry-After is the longest): nothing counted yet"]
        denials: list[tuple[int, int, int, str]] = []
        """``(longest wait, rule id, order, line)``: a ban's wait is its length, a window's its length."""
        for item in enforced:
            rule = item.rule
            if item.ban is not None:
                retry = f'"%[{self._ban_left(item)}]"'
                banned = self._if(item.condition, self._banned(item))
                line = f"http-request deny {self._deny_response(rule, retry)}{banned}"
                denials.append((rule.ban_seconds, item.rule_id, 0, line))
            line = f"http-request deny {self._deny_response(rule)}{self._if(item.condition, self._over(item))}"
            denials.append((rule.unit_seconds, item.rule_id, 1, line))
        for _, _, _, line in sorted(denials, key=lambda denial: (-denial[0], denial[1], denial[2])):
            lines.append(line)
        for item in sorted(shadow, key=lambda i: i.rule_id):
            over = " ".join(filter(None, [self.acls.condition(item.condition), self._over(item)]))
            if item.ban is not None:
                over += " || " + " ".join(filter(None, [self.acls.condition(item.condition), self._banned(item)]))
            lines.append(
                f"http-request set-var(txn.rl_shadow) str(),concat(,txn.rl_shadow,/r{item.rule_id})"
                f" if {over}  # shadow: never denied"
            )
        return lines

    def _deny_response(self, rule: RateLimitRule, retry: str | None = None) -> str:
        unit = rule.unit_seconds
        until_window_end = f'"%[date,mod({unit}),neg,add({unit})]"'
        if retry is None:
            retry = until_window_end if self.fixed and unit > 1 else str(unit)
        limit = f'"{rule.requests_per_unit}, {rule.requests_per_unit};w={unit}"'
        return (
            'status 429 content-type text/plain string "Too Many Requests\\n"'
            f" hdr Retry-After {retry} hdr x-ratelimit-limit {limit}"
        )

    def _counting(self) -> list[str]:
        if not self.merged:
            return []
        lines = ["# 6. the request is admitted: count it in every limit it passed"]
        for item in sorted(self.merged, key=lambda i: i.rule_id):
            slot = self.plan.table_of(item.rule_id).slot(item.rule_id)
            lines.append(f"http-request sc-inc-gpc({slot},{item.tracker}){self._if(item.condition)}  # r{item.rule_id}")
        return lines

    def _if(self, condition: Condition, *anonymous: str) -> str:
        """`` if <named ACLs> <anonymous ACLs>``, or nothing when there is nothing to test."""
        text = " ".join(filter(None, [self.acls.condition(condition), *anonymous]))
        return f" if {text}" if text else ""

    def _stick_table(self, table: Table) -> str:
        unit = table.seconds
        slots = len(table.rules)
        expire = 2 * unit + 1 if table.keeps_previous else unit + 1
        store = f"gpc({slots})" if self.fixed else f"gpc_rate({slots},{unit}s)"
        return self._table_line(expire, store)

    def _bans_stick_table(self, table: Table) -> str:
        """Entries outlive the longest ban; the ban's end itself is in its gpt slot."""
        longest = max(self.plan.domain.rules[rule_id].ban_seconds for rule_id in table.rules)
        return self._table_line(longest + 1, f"gpt({len(table.rules)})")

    def _table_line(self, expire: int, store: str) -> str:
        peers = f" peers {self.options.peers}" if self.options.peers else ""
        return (
            f"stick-table type string len {KEY_LENGTH} size {self.options.table_size} expire {expire}s{peers} "
            f"store {store}"
        )


def is_sliding(rule: RateLimitRule) -> bool:
    return rule.algorithm is Algorithm.SLIDING_WINDOW


def export(domain: DomainConfig, sources: Sources, options: ExportOptions) -> Export:
    """The HAProxy fragment enforcing ``domain``'s rules for the requests ``sources`` describes."""
    plan = Planner(domain, sources, options)
    text = Renderer(plan).render()
    return Export(text, sorted_problems(domain, plan.problems))


def sorted_problems(domain: DomainConfig, problems: Sequence[Problem]) -> tuple[Problem, ...]:
    """Problems without repeats: those about the proxy config first, then per rule in config order."""
    position = {where_of(rule): index for index, rule in enumerate(domain.rules)}
    unique = list(dict.fromkeys(problems))
    return tuple(sorted(unique, key=lambda problem: position.get(problem.where, -1)))


def pick_domain(domains: Mapping[str, DomainConfig], name: str | None) -> DomainConfig:
    """The domain to export: ``name``, or the only one."""
    if name is not None:
        if name not in domains:
            known = ", ".join(sorted(domains)) or "none"
            raise ExportError(f"domain {name!r} is not in the config (domains: {known})")
        return domains[name]
    if len(domains) != 1:
        raise ExportError(f"the config has {len(domains)} domains; choose one with --domain")
    return next(iter(domains.values()))


# ---------------------------------------------------------------- command line


def add_export_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``export-haproxy``."""
    parser.add_argument("config", help="descriptor config: a YAML file or a directory of them")
    parser.add_argument("--flavour", default="fixed", help="fixed (clock-aligned windows, default) or sliding")
    parser.add_argument("--envoy", help="Envoy config whose route rate_limits say which descriptors requests carry")
    parser.add_argument("--domain", help="domain to export (default: the Envoy filter's, or the only one)")
    parser.add_argument(
        "--fetch",
        action="append",
        default=[],
        metavar="KEY=SAMPLE",
        help="HAProxy sample giving a descriptor key's value (default remote_address=src); overrides --envoy",
    )
    parser.add_argument(
        "--when",
        action="append",
        nargs=2,
        default=[],
        metavar=("KEY=VALUE", "ACL"),
        help="without --envoy: the ACL body under which requests carry the constant entry KEY=VALUE",
    )
    parser.add_argument("--table-size", default=DEFAULT_TABLE_SIZE, help="entries per stick table (k, m, g suffixes)")
    parser.add_argument("--peers", help="peers section to name in every stick-table line")


def parse_pairs(items: Sequence[str], flag: str) -> dict[str, str]:
    """``KEY=VALUE`` arguments as a mapping."""
    pairs = {}
    for item in items:
        key, sign, value = item.partition("=")
        if not sign or not key or not value:
            raise ExportError(f"{flag} {item!r}: expected KEY=VALUE")
        if _CONTROL.search(item):
            raise ExportError(f"{flag} {item!r}: control characters cannot go into a config line")
        pairs[key] = value
    return pairs


def export_options(arguments: argparse.Namespace, command: str) -> ExportOptions:
    """Checked options; :class:`ExportError` names the bad one."""
    if arguments.flavour not in FLAVOURS:
        raise ExportError(f"unknown flavour {arguments.flavour!r} (choose from {', '.join(FLAVOURS)})")
    if not re.fullmatch(r"[1-9][0-9]*[kmg]?", arguments.table_size):
        raise ExportError(f"--table-size {arguments.table_size!r}: expected a number with an optional k, m or g")
    if arguments.peers is not None and not re.fullmatch(r"[A-Za-z0-9_.-]+", arguments.peers):
        raise ExportError(f"--peers {arguments.peers!r}: not a peers section name")
    return ExportOptions(arguments.flavour, arguments.table_size, arguments.peers, command)


def command_line(arguments: argparse.Namespace) -> str:
    """The command that reproduces the export, for the fragment's first comment."""
    words = ["ratelimit-sidecar", "export-haproxy", arguments.config]
    if arguments.envoy:
        words += ["--envoy", arguments.envoy]
    if arguments.domain:
        words += ["--domain", arguments.domain]
    words += ["--flavour", arguments.flavour]
    for item in arguments.fetch:
        words += ["--fetch", item]
    for pair, acl in arguments.when:
        words += ["--when", pair, acl]
    if arguments.table_size != DEFAULT_TABLE_SIZE:
        words += ["--table-size", arguments.table_size]
    if arguments.peers:
        words += ["--peers", arguments.peers]
    return shlex.join(words)


def run_export(arguments: argparse.Namespace) -> Export:
    """``export-haproxy``: load, read the Envoy config or the flags, export.

    Raises :class:`ConfigError` for a bad descriptor config and :class:`ExportError` for the rest.
    """
    options = export_options(arguments, command_line(arguments))
    fetches = parse_pairs(arguments.fetch, "--fetch")
    whens = {}
    for pair, acl in arguments.when:
        key, value = next(iter(parse_pairs([pair], "--when").items()))
        if not acl.strip() or _CONTROL.search(acl):
            raise ExportError(f"--when {pair} {acl!r}: expected an ACL body such as 'path_beg /api'")
        whens[(key, value)] = acl
    config = load_config(arguments.config)
    if arguments.envoy:
        if whens:
            raise ExportError("--when describes requests without Envoy; it cannot be combined with --envoy")
        sources = sources_from_envoy(Path(arguments.envoy), fetches)
        if arguments.domain and arguments.domain != sources.domain:
            raise ExportError(f"--domain {arguments.domain!r}, but {arguments.envoy} uses domain {sources.domain!r}")
        domain = pick_domain(config.domains, sources.domain)
    else:
        domain = pick_domain(config.domains, arguments.domain)
        sources = sources_from_flags(domain, fetches, whens)
    return export(domain, sources, options)
