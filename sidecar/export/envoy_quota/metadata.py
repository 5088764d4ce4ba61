"""Envoy's ``metadata`` and ``dynamic_metadata`` rate-limit actions in the quota filter's terms,
and the descriptors of a ``rate_limits`` entry whose entries have alternatives.

What Envoy's ``ratelimit`` filter sends for such an action: the string at ``metadata_key``
(``key`` is the namespace, then ``path``) of the request's dynamic metadata (``source:
DYNAMIC``, the default, and every ``dynamic_metadata``) or of the route's ``metadata``
(``ROUTE_ENTRY``). A value that is not a string, or ``""``, counts as absent; absent, the entry
is ``default_value`` when one is set, else with ``skip_if_absent`` the entry is left out and
the rest of the descriptor is sent, else the descriptor is not sent at all.

What the quota filter can do with it (Envoy 1.36.4 and 1.40.0, checked through both):

- a route's metadata is in the config: a constant of the route, written as ``string_value``;
- dynamic metadata can only be *tested*. Its one HTTP input,
  ``envoy.matching.inputs.dynamic_metadata``, hands the metadata matcher
  (``envoy.matching.matchers.metadata_matcher``) a structured value and gives no string: as a
  bucket id's ``custom_value`` Envoy 1.40 builds no bucket ("Failed to generate the id from
  custom value config": the request passes, unlimited) and Envoy 1.36.4 aborts on the first
  request; as the input of a string matcher it never matches. So an entry from dynamic
  metadata becomes one alternative per value the rules name at its place (that constant,
  under "the metadata is that string"), plus the default or the left-out entry under "no
  string there". That is exact when the rules name the values; rules that count each value
  apart (a key-only or wildcard rule) cannot be met by constants and are refused.

A request takes at most one alternative per action, so the alternatives of one entry are
never sent together: the filters may put them in one filter (:mod:`.filters`).
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sidecar.config.model import DescriptorNode, Level
from sidecar.export.envoy_quota import objects
from sidecar.export.envoy_quota.objects import BucketValue, Predicate
from sidecar.export.rules import landing_nodes, subtree_rules, where_of

Entry = tuple[str, BucketValue]


@dataclass(frozen=True, slots=True)
class Alternative:
    """One way an action fills its entry: ``entry`` (None: left out) when ``tests`` all hold."""

    entry: Entry | None
    tests: tuple[Predicate, ...] = ()


Choices = tuple[Alternative, ...]
"""An action's alternatives, which exclude one another; none: the descriptor is never sent."""

MAX_VARIANTS = 64
"""More alternatives than this for one ``rate_limits`` entry is refused: each is a matcher entry
(and a filter in the ``route`` shape) tested on every request."""
_FIELDS = {
    "metadata": {"descriptor_key", "metadata_key", "default_value", "source", "skip_if_absent"},
    "dynamic_metadata": {"descriptor_key", "metadata_key", "default_value"},
}
_SOURCES = ("DYNAMIC", "ROUTE_ENTRY")


def fixed(key: str, value: BucketValue, tests: Sequence[Predicate] = ()) -> Choices:
    """The one alternative of an action that always fills its entry (under ``tests``)."""
    return (Alternative((key, value), tuple(tests)),)


@dataclass(frozen=True, slots=True)
class DynamicRead:
    """An entry from dynamic metadata: its alternatives are the values the rules name at its
    place in the descriptor, so they are chosen while the descriptor is expanded."""

    kind: str
    key: str
    namespace: str
    path: tuple[str, ...]
    default: str
    skip: bool

    def choices(self, levels: Sequence[Level]) -> Choices | str:
        """The alternatives under the rule levels an entry here can land in, or why none can be exact."""
        named: dict[str, None] = {}
        for level in levels:
            for node in _nodes_of(level, self.key):
                if node.value is not None and node.wildcard is None:
                    named[node.value] = None
                    continue
                counted = next(subtree_rules(node), None)
                if counted is not None:
                    which = "key-only" if node.value is None else f"wildcard {node.value!r}"
                    apart = "counts each value apart" if node.counts_each_value else "shares a limit among values"
                    return (
                        f"action {self.kind!r} ({self.source_text()}): the {which} rule {where_of(counted)} {apart}, "
                        "and a bucket id cannot take a value from dynamic metadata (Envoy's "
                        "dynamic metadata input gives its metadata matcher a value, no string); only values "
                        "the rules name can be tested"
                    )
        found = [
            Alternative(
                (self.key, BucketValue(constant=value)), (objects.metadata_is(self.namespace, self.path, value),)
            )
            for value in named
            if value  # Envoy never sends "": it is absent
        ]
        absent = (objects.negate(objects.metadata_has_string(self.namespace, self.path)),)
        if self.default:
            found.append(Alternative((self.key, BucketValue(constant=self.default)), absent))
        elif self.skip:
            found.append(Alternative(None, absent))
        return tuple(found)

    def source_text(self) -> str:
        return f"dynamic metadata {'.'.join((self.namespace, *self.path))}"


def _nodes_of(level: Level, key: str) -> list[DescriptorNode]:
    """Every node of ``level`` an entry of ``key`` may land on, whatever its value."""
    exact = [node for (name, _), node in level.exact.items() if name == key]
    default = level.defaults.get(key)
    return [*exact, *level.wildcards.get(key, ()), *([] if default is None else [default])]


def metadata_action(kind: str, body: Mapping[str, Any], route: Mapping[str, Any]) -> Choices | DynamicRead | str:
    """Envoy's ``metadata`` / ``dynamic_metadata`` action: the route's metadata as choices made
    now, dynamic metadata as a :class:`DynamicRead`; or why not."""
    read = read_action(kind, body)
    if isinstance(read, str) or not read.route:
        return read
    value = route_metadata(route, read.namespace, read.path)
    if isinstance(value, Unreadable):
        return f"action {kind!r} (route metadata {'.'.join((read.namespace, *read.path))}): {value.reason}"
    if value or read.default:
        return fixed(read.key, BucketValue(constant=value or read.default))
    return (Alternative(None),) if read.skip else ()


@dataclass(frozen=True, slots=True)
class MetadataRead(DynamicRead):
    """A metadata action as written; ``route``: from the route's metadata (``ROUTE_ENTRY``)."""

    route: bool = False


def read_action(kind: str, body: Mapping[str, Any]) -> MetadataRead | str:
    """The fields of a ``metadata`` / ``dynamic_metadata`` action, or what is wrong with them."""
    extra = sorted(set(body) - _FIELDS[kind])
    if extra:
        return f"action {kind!r}: {', '.join(extra)} not supported"
    key = body.get("descriptor_key")
    metadata_key = body.get("metadata_key")
    namespace = metadata_key.get("key") if isinstance(metadata_key, Mapping) else None
    segments = metadata_key.get("path") if isinstance(metadata_key, Mapping) else None
    if not isinstance(key, str) or not key or not isinstance(namespace, str) or not namespace:
        return f"action {kind!r}: descriptor_key and metadata_key.key are required"
    path = tuple(item.get("key") if isinstance(item, Mapping) else None for item in segments or [])
    if not path or not all(isinstance(item, str) and item for item in path):
        return f"action {kind!r}: metadata_key.path must be one or more {{key: NAME}} segments"
    default = body.get("default_value", "")
    source = str(body.get("source", "DYNAMIC"))
    if not isinstance(default, str) or source not in _SOURCES:
        return f"action {kind!r}: default_value must be a string and source one of {', '.join(_SOURCES)}"
    names = tuple(str(item) for item in path)
    return MetadataRead(kind, key, namespace, names, default, bool(body.get("skip_if_absent")), source == "ROUTE_ENTRY")


@dataclass(frozen=True, slots=True)
class Unreadable:
    """A route metadata value whose meaning to Envoy is not known here."""

    reason: str


def route_metadata(route: Mapping[str, Any], namespace: str, path: Sequence[str]) -> str | Unreadable:
    """The string the route's ``metadata.filter_metadata`` holds at ``namespace`` / ``path``
    (``""``: none, as Envoy reads it: a number, a boolean, a struct or nothing there)."""
    value: Any = ((route.get("metadata") or {}).get("filter_metadata") or {}).get(namespace)
    for segment in path:
        if not isinstance(value, Mapping):
            return ""
        value = value.get(segment)
    if isinstance(value, str):
        return value
    if isinstance(value, datetime.date):  # YAML reads a bare date as one; Envoy keeps the text
        return Unreadable("a YAML date: write it quoted")
    return ""


Variant = tuple[tuple[Entry, ...], tuple[Predicate, ...]]


def expand(items: Sequence[Choices | DynamicRead], root: Level) -> list[Variant] | str:
    """The descriptors one ``rate_limits`` entry sends, as ``(entries, tests)`` (those with the
    same entries merged: either's tests), from its actions' alternatives; or why not."""
    partial: list[tuple[tuple[Entry, ...], tuple[Predicate, ...], list[Level]]] = [((), (), [root])]
    for item in items:
        grown = []
        for entries, tests, levels in partial:
            choices = item.choices(levels) if isinstance(item, DynamicRead) else item
            if isinstance(choices, str):
                return choices
            for choice in choices:
                if choice.entry is None:
                    grown.append((entries, tests + choice.tests, levels))
                else:
                    key, value = choice.entry
                    following = _next_levels(levels, key, value.constant)
                    grown.append(((*entries, choice.entry), tests + choice.tests, following))
        if len(grown) > MAX_VARIANTS:
            return (
                f"more than {MAX_VARIANTS} combinations of its entries' alternatives (metadata values the "
                "rules name; a header or query parameter empty or not, or absent)"
            )
        partial = grown
    return merge([(entries, tests) for entries, tests, _ in partial if entries])


def _next_levels(levels: Sequence[Level], key: str, value: str | None) -> list[Level]:
    found: dict[int, Level] = {}
    for level in levels:
        for node in landing_nodes(level, key, value):
            found.setdefault(id(node.children), node.children)
    return list(found.values())


def merge(variants: Sequence[Variant]) -> list[Variant]:
    """One variant per distinct entries, sent when any of the merged ones' tests hold."""
    grouped: dict[tuple[Entry, ...], list[tuple[Predicate, ...]]] = {}
    for entries, tests in variants:
        grouped.setdefault(entries, []).append(tests)
    merged = []
    for entries, options in grouped.items():
        if len(options) == 1 or any(not tests for tests in options):
            merged.append((entries, options[0] if len(options) == 1 else ()))
        else:
            merged.append((entries, (objects.any_of([objects.all_of(tests) for tests in options]),)))
    return merged
