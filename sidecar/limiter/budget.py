"""How long a request may wait for Redis, and why a request was decided without it.

The budget is the caller's (issue 17). Envoy's rate-limit filter sends its ``timeout``
(20-25 ms in our shipped configs) as the gRPC deadline of every call; a request waits
for Redis until shortly before that deadline, keeping :func:`caller_budget`'s margin
for the answer to reach Envoy. ``--redis-timeout`` (:data:`DEFAULT_REDIS_TIMEOUT`) is
the budget of callers that send no deadline and an upper bound for those that do: a
caller that gives 2 s still waits at most ``--redis-timeout`` for Redis, so one slow
Redis cannot hold every request for seconds. The default is 100 ms: behind Envoy the
deadline (20-25 ms) is what counts, and a caller that chose to wait longer gets a
bound that a burst's queueing does not reach. At 20 ms, a burst of 300 calls on a
2-core machine (``burst`` in ``python -m loadtest.accuracy``) had a third of its
requests meet the bound while Redis answered every one, and the failure mode's share
then went on top of what Redis admitted (sync 20 hits over its bound of 3).

A request decided without Redis is counted by :class:`FailureReasons` under one of
:data:`REASONS` (``ratelimit_sidecar_failure_decisions_total{reason}``).
"""

from __future__ import annotations

from typing import Literal

DEFAULT_REDIS_TIMEOUT = 0.1
"""``--redis-timeout``: seconds a request waits for Redis at most (and without a deadline)."""
DEADLINE_MARGIN = 0.005
"""Seconds of the caller's deadline kept for the answer to reach it, at least ...

Measured on a 2-core machine (``python -m loadtest.reliability --areas deadline-budget``):
a request that waits its whole budget reaches a 25 ms caller 2-6 ms after the budget
ran out (the failure-mode decision, the response written, the caller's own scheduling);
a 2.5 ms margin let 2-26 of 600 calls per fault miss the deadline."""
DEADLINE_MARGIN_FRACTION = 0.2
"""... or this fraction of the time it has left, whichever is more (5 ms of Envoy's 25 ms)."""

Reason = Literal["deadline", "redis_timeout", "redis_down", "redis_refused", "corrupt_key"]
REASONS: tuple[Reason, ...] = ("deadline", "redis_timeout", "redis_down", "redis_refused", "corrupt_key")
"""Why a request was decided by the failure mode:

* ``deadline``: the caller's deadline (less the margin) ran out before Redis answered,
  or had run out before the request could ask;
* ``redis_timeout``: ``--redis-timeout`` ran out first (callers with no deadline, or a
  longer one);
* ``redis_down``: Redis was known to be unavailable (connection refused or broken, or
  silent well beyond any budget while this process was responsive);
* ``redis_refused``: Redis answered this call with an error (a busy script, ...);
* ``corrupt_key``: a key the request needs holds something that is not a counter.
"""


def caller_budget(remaining: float | None) -> float | None:
    """What the limiter may spend of the ``remaining`` seconds a caller waits (its gRPC
    deadline): all but the margin the answer needs to reach it. None: no deadline."""
    if remaining is None:
        return None
    return remaining - max(DEADLINE_MARGIN, DEADLINE_MARGIN_FRACTION * remaining)


NO_DEADLINE_LIMIT = 0.25
"""Seconds a caller without a deadline waits at most while this process's own lag
stretches Redis's budget (the wait charged to Redis is ``--redis-timeout`` still)."""


def redis_wait(redis_timeout: float, budget: float | None) -> tuple[float, float, bool]:
    """``(seconds Redis may take, seconds the caller waits at most, whether the caller's
    deadline set the first)``.

    Redis may take the caller's ``budget`` (:func:`caller_budget`), at most
    ``redis_timeout`` (``--redis-timeout``); time our own event loop lags is not charged
    to it, up to the caller's budget (:data:`NO_DEADLINE_LIMIT` without a deadline), so
    an answer read late because this process was busy is still taken while the caller waits.
    """
    if budget is None:
        return redis_timeout, max(redis_timeout, NO_DEADLINE_LIMIT), False
    if budget >= redis_timeout:
        return redis_timeout, budget, False
    budget = max(0.0, budget)
    return budget, budget, True


class FailureReasons:
    """Requests decided without Redis, per :data:`REASONS`: plain integers, read at scrape time."""

    __slots__ = ("counts",)

    def __init__(self) -> None:
        self.counts: dict[str, int] = dict.fromkeys(REASONS, 0)

    def note(self, reason: Reason) -> None:
        self.counts[reason] += 1

    def total(self) -> int:
        return sum(self.counts.values())

    def copy(self) -> dict[str, int]:
        return dict(self.counts)
