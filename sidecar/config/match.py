"""Find the rule a request descriptor lands on, and the counter it spends.

The walk follows envoyproxy/ratelimit: at each level the entry's exact
``key``/``value`` wins, then wildcard values of that key in config order (the
wildcard applies to the value, never to the key), then the key-only default. A
limit applies only when the descriptor's last entry lands on a node with a
``rate_limit``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

from sidecar.config.model import DescriptorNode, DomainConfig, Level, RateLimitRule
from sidecar.limiter.counters import MAX_INLINE_CHARS, counter_key, hashed_counter_key
from sidecar.limiter.protocol import CounterKey
from sidecar.limiter.windows import Unit


class Entry(Protocol):
    """A descriptor entry: the proto's ``RateLimitDescriptor.Entry`` satisfies it."""

    @property
    def key(self) -> str: ...

    @property
    def value(self) -> str: ...


class Match(NamedTuple):
    """The rule that applies to a descriptor and the counter it spends."""

    rule: RateLimitRule
    key: CounterKey
    """``(rule.counter_id, *values)``: the request values of key-only and unshared
    wildcard levels, so each distinct value gets its own counter (long values hashed,
    see :func:`sidecar.limiter.redis.keys.counter_key`)."""
    more: tuple[Match, ...] = ()
    """The node's further limits (``rate_limits``), each with its own counter."""

    def limits(self) -> tuple[Match, ...]:
        """This limit and the further ones, in config order."""
        return (self, *self.more) if self.more else (self,)


def find_node(level: Level, entry: Entry) -> DescriptorNode | None:
    """The sibling an entry lands on: exact value, then wildcards in order, then key only."""
    node = level.exact.get((entry.key, entry.value))
    if node is not None:
        return node
    for candidate in level.wildcards.get(entry.key, ()):
        if candidate.wildcard is not None and candidate.wildcard(entry.value):
            return candidate
    return level.defaults.get(entry.key)


def match_descriptor(domain: DomainConfig, entries: Sequence[Entry]) -> Match | None:
    """The rule and counter for one descriptor, or None when no rule applies."""
    level = domain.root
    values: list[str] = []
    chars = 0
    last = len(entries) - 1
    for index, entry in enumerate(entries):
        node = find_node(level, entry)
        if node is None:
            return None
        if node.counts_each_value:
            value = entry.value
            values.append(value)
            chars += len(value)
        if index == last:
            rule = node.rule
            if rule is None:
                return None
            if node.more:
                more = tuple(Match(extra, limit_key(extra, values, chars)) for extra in node.more)
                return Match(rule, limit_key(rule, values, chars), more)
            # limit_key, inlined: this runs for every descriptor.
            if chars <= MAX_INLINE_CHARS:
                return Match(rule, (rule.counter_id, *values))
            return Match(rule, hashed_counter_key(rule.counter_id, values))
        level = node.children
    return None


def limit_key(rule: RateLimitRule, values: list[str], chars: int) -> CounterKey:
    """:func:`sidecar.limiter.redis.keys.counter_key` for values whose length is known."""
    if chars <= MAX_INLINE_CHARS:
        return (rule.counter_id, *values)
    return hashed_counter_key(rule.counter_id, values)


# ---------------------------------------------------------------- request-level matching


def detailed_stat_key(domain: DomainConfig, entries: Sequence[Entry]) -> str:
    """``domain.key_value...`` with the request's own values, for ``detailed_metric`` rules,
    except where an entry landed on a ``share_threshold`` wildcard: there the pattern
    (``key_files/*``), as envoyproxy/ratelimit names it, since those values share one
    counter. Walks the tree again (as :func:`match_descriptor` does, at most
    ``MAX_ENTRIES`` levels); only for descriptors that matched a ``detailed_metric`` rule."""
    parts = [domain.name]
    level: Level | None = domain.root
    for entry in entries:
        key, value = entry.key, entry.value
        node = None
        if level is not None:
            node = find_node(level, entry)
            level = node.children if node is not None else None
        if node is not None and node.wildcard is not None and node.share_threshold:
            parts.append(f"{key}_{node.value}")
        else:
            parts.append(f"{key}_{value}" if value else key)
    return ".".join(parts)


OVERRIDE_SOURCE = "request override"


def value_stat_key(domain: DomainConfig, entries: Sequence[Entry]) -> str:
    """envoyproxy/ratelimit's stat key of a descriptor under ``value_to_metric``: at each
    level, ``key_value`` with the configured value (a wildcard's pattern, and always so
    under ``share_threshold``), except that a ``value_to_metric`` node matched by key only
    or by a wildcard shows the request's value. Only for descriptors that matched a rule."""
    parts = [domain.name]
    level = domain.root
    for entry in entries:
        key, value = entry.key, entry.value
        node = level.exact.get((key, value))
        if node is None:
            node = next((n for n in level.wildcards.get(key, ()) if n.wildcard is not None and n.wildcard(value)), None)
            if node is not None:
                shown = value if node.value_to_metric and not node.share_threshold else node.value
                parts.append(f"{key}_{shown}")
            else:
                node = level.defaults.get(key)
                parts.append(f"{key}_{value}" if node is not None and node.value_to_metric and value else key)
        else:
            parts.append(f"{key}_{value}")
        if node is None:
            break
        level = node.children
    return ".".join(parts)


def override_stat_key(domain: str, descriptor: Any) -> str:
    """``domain.key1.key2...``: the stat key of a request override, its entries' keys only.

    envoyproxy/ratelimit names an override's stats ``domain.key_value...`` with the
    request's values, one series per value; any client could then mint a series per call.
    Here every override of one domain and key shape shares one row (the values still get
    counters of their own)."""
    return ".".join([domain, *(entry.key for entry in descriptor.entries)])


def override_rule(domain: str, descriptor: Any) -> Match:
    """The limit a request carries itself (``descriptor.limit``): wins over the config.

    Its counter is keyed by the descriptor's entries and unit, like envoyproxy/ratelimit,
    so requests overriding with different numbers share one count; its metrics row by
    the keys only (:func:`override_stat_key`).
    """
    unit = Unit(descriptor.limit.unit)
    entries = [part for entry in descriptor.entries for part in (entry.key, entry.value)]
    stat = override_stat_key(domain, descriptor)
    counter_id = f"override\0{domain}\0{unit.seconds}"
    rule = RateLimitRule(
        domain=domain,
        requests_per_unit=descriptor.limit.requests_per_unit,
        unit=unit,
        unlimited=False,
        name=None,
        replaces=frozenset(),
        shadow_mode=False,
        quota_mode=False,
        detailed_metric=False,
        stat_key=stat,
        counter_id=counter_id,
        source=OVERRIDE_SOURCE,
    )
    return Match(rule, counter_key(counter_id, entries))


def drop_replaced(matches: list[Match | None]) -> list[Match | None]:
    """Remove limits named in another matched limit's ``replaces`` (same request only)."""
    replaced = {name for match in matches if match for limit in match.limits() for name in limit.rule.replaces}
    if not replaced:
        return matches
    return [unreplaced(match, replaced) if match else None for match in matches]


def unreplaced(match: Match, replaced: set[str]) -> Match | None:
    """``match`` without its limits named in ``replaces``; None when none is left."""
    kept = [limit for limit in match.limits() if limit.rule.name not in replaced]
    if len(kept) == len(match.limits()):
        return match
    return kept[0]._replace(more=tuple(kept[1:])) if kept else None
