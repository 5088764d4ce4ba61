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
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any

from sidecar.config.model import DomainConfig, Level
from sidecar.export.envoy_quota import objects
from sidecar.export.envoy_quota.objects import BucketValue, Fallback, Predicate
from sidecar.export.envoy_quota.routes import QuotaRoute
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
    """Paths of earlier routes of the same host that leave some of their requests without a bucket here."""
    host = None
    for route in routes:
        if route.host != host:
            host, earlier = route.host, []
        if route.path is None:
            continue
        mine = [item for item in route.descriptors if shapes[item.entries] == number]
        descriptor = mine[0] if mine else None
        if descriptor is not None:
            tests = [
                *([route.host_test] if route.host_test is not None else []),
                route.path,
                *([objects.negate(objects.any_of(earlier))] if earlier else []),
            ]
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
                problems.append(Problem(descriptor.where, f"matches no rule of domain {domain.name!r}", True))
        kept.append(replace(route, descriptors=tuple(descriptors)))
    return kept
