"""What the service asks of a backend, and the all-or-nothing admission rule they share.

A request is all-or-nothing: if any enforced descriptor is over its limit, no
descriptor of that request consumes hits, so a counter always equals the hits that
were admitted against it (envoyproxy/ratelimit increments every counter even for a
rejected request, issues #440 and #1060). The one exception is a rule with
``count_past_limit``: its hits are a cost already incurred (a response's tokens,
reported with ``apply_on_stream_done``), so they are always added, and a check with
0 hits on that counter is then refused until the window ends. Backends differ only in where counts live;
they all apply :func:`decide` to the counts they see, so the policy lives in one place.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from enum import Enum
from typing import TYPE_CHECKING, NamedTuple, Protocol

from sidecar.limiter.algorithms import Algorithm, reset_seconds
from sidecar.limiter.windows import seconds_until_reset

if TYPE_CHECKING:
    from sidecar.metrics import LimiterSnapshot

CounterKey = tuple[str, ...]
"""Identity of one counter without its window: rule identity plus the request's values.

A tuple, not a joined string, so no descriptor value can make two counters collide.
"""


class Role(Enum):
    """How a descriptor's verdict takes part in the request's verdict."""

    ENFORCED = "enforced"
    """Over the limit rejects the whole request."""
    SHADOW = "shadow"
    """Reported OK whatever happens; its hits count whenever the request is admitted."""
    QUOTA = "quota"
    """Rejects the request only if every quota descriptor of the request is over."""


class Check(NamedTuple):
    """One counter a request wants to spend hits on.

    Request-path value objects are NamedTuples: building one is a tuple allocation,
    several times cheaper than a frozen dataclass, and they are just as immutable.
    """

    key: CounterKey
    unit_seconds: int
    """Window length (``unit`` times ``unit_multiplier``); a token bucket refills
    ``requests_per_unit`` tokens per this many seconds."""
    limit: int
    """``requests_per_unit``, or a token bucket's ``burst``."""
    hits: int
    role: Role = Role.ENFORCED
    algorithm: Algorithm = Algorithm.FIXED_WINDOW
    interval_us: int = 0
    """Token bucket only: microseconds per token (GCRA's emission interval)."""
    ban_seconds: int = 0
    """``ban_duration``: once over, the counter refuses everything for this long."""
    count_past: bool = False
    """``count_past_limit``: its hits are added whatever the verdict, even past the limit
    and in a refused request (a cost already incurred, such as a response's tokens)."""
    suppress: bool = False
    """``overload: suppress``: admitted with a probability from the attempted demand before
    the window check (:mod:`sidecar.limiter.suppression`)."""


class Decision(NamedTuple):
    """A backend's answer for one request, index-aligned with its checks.

    ``counts[i]`` is what check ``i``'s counter holds, or would hold, with this
    request's hits added; ``limits[i]`` is the limit this backend enforced for it
    (the configured one, or this replica's share of it).
    """

    admitted: bool
    over: tuple[bool, ...]
    counts: tuple[int, ...]
    limits: tuple[int, ...]
    ban_ends: tuple[float, ...] = ()
    """Per check, when its counter's ban ends (``ban_duration``), where the backend knows
    it: an over-limit check then resets when its ban does. Empty when no check has a ban."""
    suppressed: tuple[bool, ...] = ()
    """Per check, whether ``overload: suppress`` refused it by a draw (it is then over too);
    empty when no check was."""

    def reset(self, check: Check, index: int, now: float) -> int:
        """``duration_until_reset`` of check ``index``: its window's or bucket's
        (:func:`~sidecar.limiter.algorithms.reset_seconds`), or, while it is banned, the
        ban's end if that comes later (a client must wait for both)."""
        if not self.ban_ends and check.algorithm is not Algorithm.TOKEN_BUCKET:
            return seconds_until_reset(now, check.unit_seconds)  # the common case, kept cheap
        over = self.over[index]
        reset = reset_seconds(check, self.counts[index], self.limits[index], over, now)
        if over and self.ban_ends and self.ban_ends[index] > now:
            return max(reset, math.ceil(self.ban_ends[index] - now))
        return reset

    def remaining(self, index: int) -> int:
        """Hits left in check ``index``'s window after this request (0 when over)."""
        return max(0, self.limits[index] - self.counts[index])


class Limiter(Protocol):
    """A backend: decides a request's checks against the current window and records it."""

    async def check(self, checks: Sequence[Check], now: float, budget: float | None = None) -> Decision:
        """Decide and, when the request is admitted, record its hits atomically.

        ``budget``: seconds the caller still waits for the answer, less the margin the
        answer needs to reach it (:func:`~sidecar.limiter.budget.caller_budget`); None
        when it sent no deadline. Only Redis backends use it (they set
        ``takes_budget = True``; the service computes it for those only).
        """
        ...

    async def start(self) -> None:
        """Start background work (connections, sync, heartbeats) once the loop runs."""
        ...

    async def close(self, deadline: float | None = None) -> None:
        """Release resources; backends with pending state flush it first, trying until
        ``deadline`` (``time.monotonic()``; None: about a second) while Redis is away."""
        ...

    def snapshot(self) -> LimiterSnapshot:
        """Numbers for the metrics endpoint, read when Prometheus scrapes."""
        ...


def decide(
    checks: Sequence[Check],
    counts: Sequence[int],
    limits: Sequence[int],
    admit_all: bool,
) -> tuple[bool, tuple[bool, ...], tuple[bool, ...]]:
    """Apply the admission rule to would-be counts.

    Returns ``(admitted, over, consume)``: whether the request passes, which checks
    are over their limit, and which counters must add their hits. ``admit_all`` is
    global shadow mode: verdicts are still computed but every request passes, and
    since every request is then admitted every check consumes. A ``count_past`` check
    (``count_past_limit``) always consumes: the one exception to all-or-nothing.
    """
    over = tuple(count > limit for count, limit in zip(counts, limits, strict=True))
    blocked = False
    quota_seen = False
    quota_all_over = True
    for check, is_over in zip(checks, over, strict=True):
        if check.role is Role.ENFORCED and is_over:
            blocked = True
        elif check.role is Role.QUOTA:
            quota_seen = True
            quota_all_over = quota_all_over and is_over
    admitted = admit_all or not (blocked or (quota_seen and quota_all_over))
    consume = tuple(
        (admitted and (admit_all or not is_over or check.role is Role.SHADOW)) or check.count_past
        for check, is_over in zip(checks, over, strict=True)
    )
    return admitted, over, consume
