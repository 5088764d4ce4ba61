"""Descriptors onto ``rate_limit_quota`` filters, and each filter's matchers in route order.

One filter puts a request in one bucket only, so a route sending several descriptors needs
several filters. A descriptor sent by several routes is always in the same filter, so that its
bucket (its counter) is shared by those routes as in the sidecar; the filters are few: a greedy
colouring of "sent by the same route". In a filter, one matcher entry per route sending a
descriptor for it: the test of the route's virtual host (when there is more than one host:
:mod:`sidecar.export.hosts`), the route's path test, the tests of its actions, and "none of
the earlier routes of that host that could have taken the request", since Envoy picks the
first matching route and the matcher list the first matching entry, but an earlier route
without a bucket here leaves the request to later entries.

That is the ``list`` shape: every filter runs on every request and walks its entries. The
``route`` shape (:func:`route_filters`, what ``--full`` writes) lets Envoy's router do the
choosing: one filter per descriptor, off by default and turned on (``typed_per_filter_config``)
on exactly the routes that send it, so its matcher holds no route test at all: only the
descriptor's own conditions, or none (``on_no_match``). Envoy's ``RateLimitQuotaOverride``
cannot do this: Envoy 1.36-1.40 refuse it on a route ("doesn't support virtual host or route
specific configurations") and the filter never reads one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

from sidecar.config.model import DomainConfig, Level
from sidecar.export.envoy_quota import objects
from sidecar.export.envoy_quota.objects import BucketValue, Fallback, Predicate
from sidecar.export.envoy_quota.routes import Descriptor, QuotaRoute
from sidecar.export.problems import Problem
from sidecar.export.rules import landing_nodes, node_limits


def reaches_a_rule(level: Level, entries: Sequence[tuple[str, BucketValue]]) -> bool:
    """Whether some value of the request could make the descriptor match a rule of the config."""
    key, value = entries[0]
    for node in landing_nodes(level, key, value.constant):
        if len(entries) == 1 and node_limits(node):
            return True
        if len(entries) > 1 and reaches_a_rule(node.children, entries[1:]):
            return True
    return False


Shape = tuple[tuple[str, BucketValue], ...]


def assign_filters(routes: Sequence[QuotaRoute]) -> dict[Shape, int]:
    """The filter of every descriptor: one per descriptor shape, shared by every route sending
    it; two descriptors one request of a route may send never share a filter (greedy colouring,
    in order). The descriptors of one ``rate_limits`` entry (the alternatives of a metadata
    entry) are never sent together: they may share one."""
    chosen: dict[Shape, int] = {}
    for route in routes:
        for descriptor in route.descriptors:
            if descriptor.entries in chosen:
                continue
            taken = {
                chosen[other.entries]
                for sender in routes
                for item in sender.descriptors
                if item.entries == descriptor.entries
                for other in sender.descriptors
                if other.entries in chosen and other.where != item.where
            }
            chosen[descriptor.entries] = next(index for index in range(len(chosen) + 1) if index not in taken)
    return chosen


def filter_matchers(routes: Sequence[QuotaRoute], belongs: Callable[[Shape], bool]) -> Iterator[Any]:
    """``(route, descriptor, predicate)`` of the entries of the filter holding the descriptors
    ``belongs`` says, in route order (a route's alternatives of one entry in turn: they exclude
    one another)."""
    earlier: list[Predicate] = []
    """Paths of earlier routes of the same host that leave some of their requests without a bucket here."""
    host = None
    for route in routes:
        if route.host != host:
            host, earlier = route.host, []
        if route.path is None:
            continue
        mine = [item for item in route.descriptors if belongs(item.entries)]
        tests = [
            *([route.host_test] if route.host_test is not None else []),
            route.path,
            *([objects.negate(objects.any_of(earlier))] if earlier else []),
        ]
        for descriptor in mine:
            yield route, descriptor, objects.all_of([*tests, *descriptor.conditions])
        if not mine or any(descriptor.conditions for descriptor in mine):
            earlier.append(route.path)


def build_filters(domain: str, routes: Sequence[QuotaRoute], cluster: str, fallback: Fallback) -> list[dict[str, Any]]:
    """The filters, as YAML data, in the order of their first descriptor."""
    shapes = assign_filters(routes)
    filters = []
    for number in range(max(shapes.values(), default=-1) + 1):
        matchers = [
            objects.field_matcher(predicate, objects.bucket_settings(domain, descriptor.entries, fallback))
            for _, descriptor, predicate in filter_matchers(routes, in_filter(shapes, number))
        ]
        matcher = objects.matcher_list(matchers)
        filters.append(objects.as_yaml_dict(objects.quota_filter(filter_name(number), domain, cluster, matcher)))
    return filters


def in_filter(shapes: dict[Shape, int], number: int) -> Callable[[Shape], bool]:
    """Whether a descriptor is in filter ``number``."""
    return lambda entries: shapes[entries] == number


def filter_name(number: int) -> str:
    return objects.FILTER_NAME if number == 0 else f"{objects.FILTER_NAME}.{number}"


RouteKey = tuple[str, int]
"""``(virtual host name, route index)``."""


@dataclass(frozen=True, slots=True)
class RouteFilters:
    """The ``route`` shape: the filters (YAML data, chain order) and, per filter name, the
    routes it is turned on for (it is off everywhere else)."""

    filters: list[dict[str, Any]]
    enabled: dict[str, tuple[RouteKey, ...]]


def route_filters(domain: str, routes: Sequence[QuotaRoute], cluster: str, fallback: Fallback) -> RouteFilters:
    """One filter per descriptor, in the order of first sending, on only on the routes sending it.

    The router has chosen the route (virtual host included) before the filter chain is made,
    so a filter that is on runs on exactly that route's requests: its matcher holds only the
    descriptor's conditions (a header present, a header matching) or nothing. One filter per
    descriptor keeps a bucket in one filter, counted once, as the sidecar counts it. Only a
    descriptor sent under different conditions by different routes needs to tell the routes
    apart: its filter keeps the route tests of the ``list`` shape (exact there too). The
    alternatives of one ``rate_limits`` entry (:func:`alternatives`) share one filter, an
    entry each, when every route sending them sends them all alike.
    """
    senders: dict[Shape, list[tuple[QuotaRoute, Descriptor]]] = {}
    for route in routes:
        if route.path is not None:
            for descriptor in route.descriptors:
                senders.setdefault(descriptor.entries, []).append((route, descriptor))
    together = alternatives(routes)
    filters: list[dict[str, Any]] = []
    enabled: dict[str, tuple[RouteKey, ...]] = {}
    done: set[Shape] = set()
    for entries, own in senders.items():
        if entries in done:
            continue
        bundle = together.get(entries)
        if bundle is not None:
            matcher = objects.matcher_list(
                [
                    objects.field_matcher(objects.all_of(tests), objects.bucket_settings(domain, shape, fallback))
                    for shape, tests in bundle
                ]
            )
            sent: Sequence[tuple[QuotaRoute, Descriptor]] = [item for shape, _ in bundle for item in senders[shape]]
            done.update(shape for shape, _ in bundle)
        else:
            matcher, sent = single_matcher(domain, routes, entries, own, fallback), own
        name = filter_name(len(filters))
        filters.append(objects.as_yaml_dict(objects.quota_filter(name, domain, cluster, matcher)))
        enabled[name] = tuple(dict.fromkeys((route.host, route.index) for route, _ in sent))
    return RouteFilters(filters, enabled)


def single_matcher(
    domain: str,
    routes: Sequence[QuotaRoute],
    entries: Shape,
    sent: Sequence[tuple[QuotaRoute, Descriptor]],
    fallback: Fallback,
) -> objects.BucketMatcher:
    """The matcher of a filter holding one descriptor: its conditions, or the route tests too
    when its routes send it under different conditions."""
    settings = objects.bucket_settings(domain, entries, fallback)
    conditions = [list(descriptor.conditions) for _, descriptor in sent]
    if all(item == conditions[0] for item in conditions):
        return objects.conditional_matcher(conditions[0], settings)
    return objects.matcher_list(
        [objects.field_matcher(predicate, settings) for _, _, predicate in filter_matchers(routes, entries.__eq__)]
    )


Bundle = tuple[tuple[Shape, tuple[Predicate, ...]], ...]


def alternatives(routes: Sequence[QuotaRoute]) -> dict[Shape, Bundle]:
    """The descriptors that can share a filter in the ``route`` shape: the alternatives of one
    ``rate_limits`` entry (never sent together, each under its own conditions), when every route
    sending any of them sends the same alternatives under the same conditions (so no route test
    is needed). Each such descriptor maps to its bundle; the others are not in the answer."""
    seen: dict[Shape, list[Bundle]] = {}
    for route in routes:
        if route.path is None:
            continue
        grouped: dict[str, list[Descriptor]] = {}
        for descriptor in route.descriptors:
            grouped.setdefault(descriptor.where, []).append(descriptor)
        for group in grouped.values():
            bundle = tuple((item.entries, item.conditions) for item in group)
            for item in group:
                seen.setdefault(item.entries, []).append(bundle)
    found: dict[Shape, Bundle] = {}
    for entries, bundles in seen.items():
        first = bundles[0]
        alike = all(bundle == first for bundle in bundles)
        if len(first) > 1 and alike and all(tests for _, tests in first):
            found[entries] = first
    return {
        entries: bundle
        for entries, bundle in found.items()
        if all(found.get(shape) == bundle for shape, _ in bundle)  # every member agrees
    }


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
                empty = [key for key, value in descriptor.entries if value.constant == ""]
                when = f" when {', '.join(empty)} is empty" if empty else ""
                problems.append(Problem(descriptor.where, f"matches no rule of domain {domain.name!r}{when}", True))
        kept.append(replace(route, descriptors=tuple(descriptors)))
    return kept
