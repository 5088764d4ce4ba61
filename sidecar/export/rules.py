"""The descriptor config as an exporter reads it: which domain, the limits of a tree node, which
nodes a descriptor entry can land on, and how a problem names a rule.

The serving process matches one request's values against the tree (:func:`find_node`); an
exporter writes config for every request at once, so it asks where an entry *could* land: on the
one node a known value picks, or, for a value read from the request, on any node a request can
reach, in the order matching tries them.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping

from sidecar.config.model import DescriptorNode, DomainConfig, Level, RateLimitRule
from sidecar.export.problems import ExportError

_NOT_IN_REQUESTS = re.compile(r"[\x00\n\r]")
"""Characters no HTTP header value or client address holds: a node whose value has one is
never reached by a request."""


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


def node_limits(node: DescriptorNode) -> tuple[RateLimitRule, ...]:
    """The limits of a node: its ``rate_limit`` (or first ``rate_limits`` entry), then the others."""
    return () if node.rule is None else (node.rule, *node.more)


def subtree_rules(node: DescriptorNode) -> Iterator[RateLimitRule]:
    """Every rule at or below ``node``."""
    yield from node_limits(node)
    for child in node.children.nodes():
        yield from subtree_rules(child)


def landing_nodes(level: Level, key: str, value: str | None) -> list[DescriptorNode]:
    """The nodes an entry of ``key`` can land on, in the order :func:`find_node` tries them.

    A known ``value`` (a constant of the proxy config) lands on the one node matching picks:
    the exact value, else the first wildcard it matches, else the key-only default. A value
    read from the request (None) can land on every exact and wildcard node a request can
    reach, then on the default, which takes what none of them took.
    """
    if value is not None:
        node = level.exact.get((key, value))
        if node is None:
            node = next((n for n in level.wildcards.get(key, ()) if n.wildcard and n.wildcard(value)), None)
        node = node or level.defaults.get(key)
        return [] if node is None else [node]
    exact = [node for (name, text), node in level.exact.items() if name == key and _reachable(text)]
    wildcards = [node for node in level.wildcards.get(key, ()) if _reachable(node.value or "")]
    default = level.defaults.get(key)
    return [*exact, *wildcards, *([] if default is None else [default])]


def _reachable(value: str) -> bool:
    return _NOT_IN_REQUESTS.search(value) is None


def where_of(rule: RateLimitRule) -> str:
    """How problems name a rule: its file and line, stat key and name, and which of a node's
    ``rate_limits`` it is (several can share a line and a stat key)."""
    name = f" ({rule.name})" if rule.name else ""
    entry = f" {rule.where.rsplit('.', 1)[-1]}" if ".rate_limits[" in rule.where else ""
    return f"{rule.source}: {rule.stat_key}{name}{entry}"
