"""Rule -> assignment: what Envoy's ``rate_limit_quota`` filter is told to enforce for a bucket.

==========================================  ==========================================
rule                                        assignment
==========================================  ==========================================
window limit, L per unit (x multiplier)     token bucket: max_tokens L, tokens_per_fill L,
                                            fill_interval = the window in whole seconds
``algorithm: token_bucket``, burst B,       token bucket: max_tokens B, rate R/S as
rate R per S seconds                        tokens_per_fill R/g every S/g s, g = gcd(R, S)
several limits (``rate_limits``)            one token bucket at least as tight as each:
                                            the smallest max_tokens, the slowest rate
``requests_per_unit: 0``                    DENY_ALL
``unlimited``, shadow rule, --shadow-mode   ALLOW_ALL (usage still counted per rule)
unknown domain, no match, bad bucket id,    ALLOW_ALL (:data:`DEFAULT_ACTION`), counted
bucket over the caps                        by reason
==========================================  ==========================================

Envoy 1.40 truncates ``fill_interval`` to whole seconds and treats anything under one
second as *no limit*, so every fill interval here is a whole number of seconds, at
least 1 (rules have no window shorter than a second, and the reduction above keeps the
rate exact). ``--instances N`` gives each Envoy ``ceil(L / N)`` (``ceil(B / N)`` and
rate ``R / N`` for token buckets), as the memory backend divides its limits.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from fractions import Fraction
from typing import Generic, TypeVar

from sidecar.config.match import match_descriptor
from sidecar.config.model import RateLimitConfig, RateLimitRule
from sidecar.limiter.algorithms import Algorithm
from sidecar.limiter.shares import share_of_limit
from sidecar.quota.buckets import ParsedBucket

MAX_TOKENS = 2**32 - 1
"""``max_tokens`` and ``tokens_per_fill`` are uint32 in Envoy's ``TokenBucket``."""
MIN_FILL_SECONDS = 1
"""Envoy 1.40: a ``fill_interval`` under one second means no limit at all."""
MAX_POOLED = 4096
"""Distinct values a :class:`Pool` keeps; past it, it starts over (correct, a little less shared)."""

T = TypeVar("T")


class Kind(Enum):
    ALLOW_ALL = "allow_all"
    DENY_ALL = "deny_all"
    TOKEN_BUCKET = "token_bucket"


@dataclass(frozen=True, slots=True)
class Assignment:
    """What one bucket is told to enforce, and why (the ``why`` labels the metrics)."""

    kind: Kind
    why: str
    rule: RateLimitRule | None = None
    """The rule whose metrics the bucket's usage goes to (the first limit of its descriptor)."""
    max_tokens: int = 0
    tokens_per_fill: int = 0
    fill_seconds: int = 0

    def envoy_fields(self) -> tuple[Kind, int, int, int]:
        """What Envoy receives (two assignments equal here are the same to Envoy)."""
        return (self.kind, self.max_tokens, self.tokens_per_fill, self.fill_seconds)

    def describe(self) -> dict[str, object]:
        """For ``/config``."""
        shown: dict[str, object] = {"action": self.kind.value, "why": self.why}
        if self.rule is not None:
            shown["rule"] = self.rule.stat_key
            shown["source"] = self.rule.source
        if self.kind is Kind.TOKEN_BUCKET:
            shown["max_tokens"] = self.max_tokens
            shown["tokens_per_fill"] = self.tokens_per_fill
            shown["fill_interval_seconds"] = self.fill_seconds
        return shown


def assignment_identity(assignment: Assignment) -> Hashable:
    """What makes two assignments interchangeable: their fields, the rule by identity
    (hashing a rule would hash all its fields; the pooled assignment holds the rule, so
    its id is not reused while the entry lives)."""
    return (
        assignment.kind,
        assignment.why,
        id(assignment.rule),
        assignment.max_tokens,
        assignment.tokens_per_fill,
        assignment.fill_seconds,
    )


class Pool(Generic[T]):
    """One object per distinct immutable value, shared by every bucket that has it.

    Each object a live bucket keeps that the cyclic collector tracks (a slotted dataclass
    is tracked; a dict or tuple of strings and ints is not) is walked by every full
    collection, which holds the GIL: 20,000 buckets each with their own
    :class:`Assignment` doubled what a full collection walks. Buckets of one rule share
    one. At most :data:`MAX_POOLED` values are kept (then the pool starts over), so ids
    from clients cannot grow it."""

    def __init__(self, identity: Callable[[T], Hashable], max_size: int = MAX_POOLED) -> None:
        self.identity = identity
        self.max_size = max_size
        self._values: dict[Hashable, T] = {}

    def shared(self, value: T) -> T:
        """The pooled object equal to ``value`` (``value`` itself the first time)."""
        key = self.identity(value)
        pooled = self._values.get(key)
        if pooled is None:
            if len(self._values) >= self.max_size:
                self._values.clear()
            pooled = self._values[key] = value
        return pooled

    def clear(self) -> None:
        """Forget every value (a reload: the old rules are let go)."""
        self._values.clear()

    def __len__(self) -> int:
        return len(self._values)


def default(why: str) -> Assignment:
    """The documented default for buckets without a rule: ALLOW_ALL, labelled by reason."""
    return Assignment(Kind.ALLOW_ALL, why)


def assign(config: RateLimitConfig, bucket: ParsedBucket, instances: int = 1, admit_all: bool = False) -> Assignment:
    """The assignment of a bucket, found by the same match tree as ``ShouldRateLimit``."""
    domain = config.domains.get(bucket.domain)
    if domain is None:
        return default("unknown_domain")
    match = match_descriptor(domain, bucket.entries)
    if match is None:
        return default("no_match")
    rules = [limit.rule for limit in match.limits()]
    if admit_all:
        return Assignment(Kind.ALLOW_ALL, "shadow_mode", match.rule)
    return assign_rules(rules, instances)


def assign_rules(rules: Sequence[RateLimitRule], instances: int = 1) -> Assignment:
    """The assignment of one descriptor's limits (one rule, or several with ``rate_limits``)."""
    first = rules[0]
    if first.unlimited:
        return Assignment(Kind.ALLOW_ALL, "unlimited", first)
    if any(rule.shadow_mode for rule in rules):
        return Assignment(Kind.ALLOW_ALL, "shadow", first)
    shapes = [bucket_shape(rule, instances) for rule in rules]
    burst = min(shape[0] for shape in shapes)
    if burst == 0:
        return Assignment(Kind.DENY_ALL, "zero_limit", first)
    _, tokens, seconds = min(shapes, key=lambda shape: Fraction(shape[1], shape[2]))
    why = "several_limits" if len(rules) > 1 else first.algorithm.label
    return Assignment(Kind.TOKEN_BUCKET, why, first, min(burst, MAX_TOKENS), tokens, seconds)


def bucket_shape(rule: RateLimitRule, instances: int) -> tuple[int, int, int]:
    """``(max_tokens, tokens_per_fill, fill seconds)`` of one limit: this Envoy's share."""
    if rule.algorithm is Algorithm.TOKEN_BUCKET:
        burst = share_of_limit(rule.burst, instances)
        return (burst, *fill_of(Fraction(rule.requests_per_unit, rule.unit_seconds * instances)))
    # Fixed and sliding windows alike: L per window, the whole L refilled over a window.
    limit = share_of_limit(rule.requests_per_unit, instances)
    return limit, min(max(limit, 1), MAX_TOKENS), max(MIN_FILL_SECONDS, rule.unit_seconds)


def fill_of(rate: Fraction) -> tuple[int, int]:
    """``(tokens_per_fill, fill seconds)`` for ``rate`` tokens per second: the lowest terms
    (``Fraction`` keeps them), so the rate is exact and the fill interval whole seconds.

    Only a rate whose terms overflow uint32 is rounded: the fill then grows so that the
    rate is at most the configured one."""
    tokens, seconds = rate.numerator, rate.denominator
    if tokens > MAX_TOKENS:
        scale = math.ceil(tokens / MAX_TOKENS)
        tokens, seconds = MAX_TOKENS, seconds * scale
    return tokens, max(MIN_FILL_SECONDS, seconds)


@dataclass(frozen=True, slots=True)
class Action:
    """One bucket action to send: an assignment, or abandon (``assignment`` None)."""

    bucket_id: Mapping[str, str]
    assignment: Assignment | None
    nanos: int = 0
    """``fill_interval.nanos``: 0 or 1, flipped when only the fill seconds change (Envoy
    1.40 does not compare ``fill_interval.seconds``, so it would keep the old bucket)."""


def nanos_after(old: Assignment, new: Assignment, nanos: int) -> int:
    """The ``fill_interval.nanos`` that makes Envoy see ``new`` as a change from ``old``."""
    if (
        old.kind is new.kind is Kind.TOKEN_BUCKET
        and old.fill_seconds != new.fill_seconds
        and (old.max_tokens, old.tokens_per_fill) == (new.max_tokens, new.tokens_per_fill)
    ):
        return 1 - nanos
    return nanos
