"""Which limit a descriptor's status and the ``RateLimit-*`` headers report.

A descriptor may carry several limits (``rate_limits``) and a request several
descriptors; the client hears of one: the limit closest to exhaustion. This is the
one place that choice is made, for the statuses (:mod:`sidecar.service.servicer`) and
for the headers (:mod:`sidecar.service.headers`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

from sidecar.config.model import RateLimitRule
from sidecar.limiter.protocol import Check, CounterKey, Decision


class Applied(NamedTuple):
    """A descriptor's rule after overrides and ``replaces``, with its check index."""

    rule: RateLimitRule
    check: int | None
    """Index into the request's checks; None for unlimited rules, which count nothing."""
    stats: list[int] | None = None
    """The rule's metric counts (per request values with ``detailed_metric``)."""
    more: tuple[RateLimitRule, ...] = ()
    """Further limits of the descriptor (``rate_limits``), checked at the next indices."""

    def limits(self) -> list[tuple[RateLimitRule, int]]:
        """``(rule, check index)`` of every limit of the descriptor (none when unlimited)."""
        if self.check is None:
            return []
        return [(self.rule, self.check), *((rule, self.check + 1 + n) for n, rule in enumerate(self.more))]


class Reported(NamedTuple):
    """The limit a status or the ``RateLimit-*`` headers describe."""

    rule: RateLimitRule
    check: int
    """Its check's index in the request."""
    remaining: int
    """``limit_remaining`` of the descriptor's status."""
    reset: int
    """``duration_until_reset`` of the descriptor's status, in seconds."""
    over: bool

    @property
    def limit(self) -> int:
        """The configured limit (a token bucket's size), as the headers show it."""
        return self.rule.limit


def as_kept(checks: Sequence[Check], decision: Decision) -> Decision:
    """A refused request's decision with the counts its counters really kept.

    Backends answer with would-be counts (this request's hits added). A refused request
    adds nothing (all-or-nothing), so a descriptor that passed would report hits it did
    not spend: its ``limit_remaining`` must be ``limit - stored count``, as
    envoyproxy/ratelimit answers with STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT. Each
    passing check's count loses the hits of this request on its counter up to it (a
    counter named twice accumulates them). Over-limit checks keep their would-be count
    (their remaining is 0 anyway; the metrics split and a bucket's reset read it), and
    ``count_past_limit`` checks did add their hits. Refused requests only: O(checks).
    """
    if decision.admitted:
        return decision
    counts = list(decision.counts)
    unspent: dict[tuple[CounterKey, int], int] = {}
    for index, check in enumerate(checks):
        if check.count_past:
            continue
        counter = (check.key, check.unit_seconds)
        taken = unspent.get(counter, 0) + check.hits
        unspent[counter] = taken
        if not decision.over[index]:
            counts[index] -= taken
    return decision._replace(counts=tuple(counts))


def closest_to_exhaustion(
    candidates: Iterable[tuple[RateLimitRule, int]], checks: Sequence[Check], decision: Decision, now: float
) -> Reported | None:
    """Among ``(rule, check index)`` candidates, the limit a client most needs to hear of.

    An over-limit one if there is any (the one that resets last: a refused client must
    wait for all of them), else the one with the fewest hits remaining (ties: the later
    reset). It picks the status of a descriptor with several limits, and the descriptor
    the ``RateLimit-*`` headers describe. Runs on every such request, so it compares
    integers and works out a reset only when it must (over-limit candidates and ties).
    """
    over, counts, limits = decision.over, decision.counts, decision.limits

    def reset_of(index: int) -> int:
        return decision.reset(checks[index], index, now)

    chosen: RateLimitRule | None = None
    chosen_index = 0
    chosen_over = False
    remaining = reset = 0
    for rule, index in candidates:
        if over[index]:
            candidate_reset = reset_of(index)
            if not chosen_over or candidate_reset > reset:
                chosen, chosen_index, chosen_over, remaining, reset = rule, index, True, 0, candidate_reset
        elif not chosen_over:
            left = max(0, limits[index] - counts[index])
            if chosen is None or left < remaining:
                chosen, chosen_index, remaining, reset = rule, index, left, -1
            elif left == remaining:
                if reset < 0:
                    reset = reset_of(chosen_index)
                candidate_reset = reset_of(index)
                if candidate_reset > reset:
                    chosen, chosen_index, reset = rule, index, candidate_reset
    if chosen is None:
        return None
    if reset < 0:
        reset = reset_of(chosen_index)
    return Reported(chosen, chosen_index, remaining, reset, chosen_over)


def reported(
    applied: Sequence[Applied | None], checks: Sequence[Check], decision: Decision, now: float
) -> Reported | None:
    """The limit the headers describe, or None when no limited, enforced descriptor took part."""
    candidates = (
        limit for item in applied if item is not None and not item.rule.shadow_mode for limit in item.limits()
    )
    return closest_to_exhaustion(candidates, checks, decision, now)


def reported_index(item: Applied, checks: Sequence[Check], decision: Decision, now: float) -> int:
    """Which of a descriptor's several limits its status reports: the one closest to exhaustion."""
    chosen = closest_to_exhaustion(item.limits(), checks, decision, now)
    return chosen.check if chosen is not None else item.check or 0
