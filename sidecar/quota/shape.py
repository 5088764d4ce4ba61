"""How one rule's assignment is shared across replicas: a share of ``units`` as an assignment,
and the units a measured rate asks for (:class:`Shape`).

Limits of a minute or more are budgets per window (shares of what is left of it); shorter
ones rates (a token bucket refilled at the share's rate).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

from sidecar.limiter.algorithms import Algorithm
from sidecar.quota.assignments import MAX_TOKENS, MIN_FILL_SECONDS, Assignment, Kind, fill_of
from sidecar.quota.shares import MAX_UNITS

MAX_COUNTED = 2**40
"""What a bucket counts between two calls is clamped to this (an outage carries it)."""
HEADROOM = 0.1
"""Demand published = measured x (1 + HEADROOM), at least 1: room to grow before the next report."""
WINDOW_BUDGET_SECONDS = 60
"""Windows of at least this length are budgets (shares of what is left), shorter ones rates."""


@dataclass(frozen=True, slots=True)
class Shape:
    """How a rule's assignment is shared: ``limit`` units per ``seconds``."""

    limit: int
    seconds: int
    burst: int
    windowed: bool
    token_bucket: bool

    @classmethod
    def of(cls, base: Assignment) -> Shape | None:
        """The shape of a full-limit token-bucket assignment; None when it is not shared."""
        if base.kind is not Kind.TOKEN_BUCKET or base.rule is None:
            return None
        token_bucket = base.rule.algorithm is Algorithm.TOKEN_BUCKET and base.why != "several_limits"
        seconds = base.fill_seconds
        return cls(
            limit=base.tokens_per_fill,
            seconds=seconds,
            burst=base.max_tokens,
            windowed=not token_bucket and seconds >= WINDOW_BUDGET_SECONDS,
            token_bucket=token_bucket,
        )

    def assignment(self, base: Assignment, units: int, now_wall: float) -> Assignment:
        """The assignment of a share of ``units``."""
        if units <= 0:
            return Assignment(Kind.DENY_ALL, "shared_zero", base.rule)
        units = min(units, MAX_TOKENS)
        if self.windowed:
            left = self.seconds - int(now_wall) % self.seconds
            return Assignment(Kind.TOKEN_BUCKET, "shared_window", base.rule, units, units, max(MIN_FILL_SECONDS, left))
        if self.token_bucket:
            burst = max(1, self.burst * units // max(1, self.limit))
            tokens, seconds = fill_of(Fraction(units, self.seconds))
            return Assignment(Kind.TOKEN_BUCKET, "shared", base.rule, min(burst, MAX_TOKENS), tokens, seconds)
        return Assignment(Kind.TOKEN_BUCKET, "shared", base.rule, units, units, max(MIN_FILL_SECONDS, self.seconds))

    def window(self, now_wall: float) -> int:
        return int(now_wall) // self.seconds * self.seconds if self.windowed else -1

    def demand(self, rate: float, now_wall: float) -> int:
        """Units wanted for ``rate`` requests per second: per fill interval, or (windowed)
        for what is left of the window."""
        span = self.seconds - int(now_wall) % self.seconds if self.windowed else self.seconds
        wanted = max(1, math.ceil(min(rate, MAX_COUNTED) * span * (1 + HEADROOM)))
        return min(wanted, self.limit) if self.windowed else min(wanted, MAX_UNITS)
