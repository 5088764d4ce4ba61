"""The partition rule's knobs and what it shows: how long a silent replica's lease is held,
what a replica cut from Redis enforces once that hold ended, and the signals an SRE
alerts on (docs/quota.md, "Across replicas").

Nobody can tell a replica cut off from Redis from a dead one. Redis keeps a silent
replica's last lease reserved for the **hold**, while the replica, if it is alive without
Redis, keeps enforcing that lease as long. What happens after the hold is the operator's
choice (``--quota-after-hold``):

* ``deny`` (the default): the cut replica assigns nothing. What every Envoy enforces stays
  within the limit in every partition; a full Redis outage denies every shared bucket
  once the hold ended.
* ``share``: the cut replica enforces ``ceil(limit / R)``, R the live replicas it last
  knew. A full outage stays available (R replicas x ceil(limit / R)); a partition outlasting
  the hold puts the sum over the limit by at most ``ceil(limit / R)`` per cut replica.

Light on purpose (no Redis, no metrics imports): :mod:`sidecar.settings` reads the defaults.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, get_args

import structlog

log = structlog.get_logger(__name__)

AfterHold = Literal["deny", "share"]
AFTER_HOLD_POLICIES: tuple[str, ...] = get_args(AfterHold)
REPORT_SECONDS = 5.0
"""Envoy 1.40 reports every 5 s whatever ``reporting_interval`` says."""
LEASE_MARGIN = 2 * REPORT_SECONDS
"""A lease outlives Envoy's assignment TTL by two reports: the reports renew it in time."""
HOLD_LEASES = 4
"""The default hold, in leases: 4 x (``--quota-ttl`` + 10 s), 280 s at ``--quota-ttl`` 60.
Longer rides out longer partitions within the limit; shorter hands a crashed replica's
share on sooner."""
LOG_SECONDS = 60.0
"""Each partition log line is written at most this often (the counters count every event)."""


def lease_seconds(ttl: float, report_seconds: float = REPORT_SECONDS) -> float:
    """How long a share is leased: Envoy's assignment TTL and two reports."""
    return ttl + 2 * report_seconds


def hold_seconds(ttl: float, hold: float | None = None, report_seconds: float = REPORT_SECONDS) -> float:
    """The hold: ``hold`` when given (``--quota-partition-hold``), else :data:`HOLD_LEASES` leases."""
    return HOLD_LEASES * lease_seconds(ttl, report_seconds) if hold is None else hold


@dataclass(frozen=True, slots=True)
class PartitionCounts:
    """What the partition rule is doing on this replica, for a scrape."""

    policy: str
    held_buckets: int
    """Buckets in which Redis keeps a silent replica's lease reserved (as of this replica's last call)."""
    holds_started: int
    """Times a bucket started being held for a silent replica."""
    past_hold_buckets: int
    """Buckets of this replica, cut from Redis, whose hold ended: enforcing ``policy``."""
    holds_ended: int
    """Times a bucket's hold ended while this replica was cut from Redis."""
    handed_on: int
    """Records given back at a clean stop (the others need not wait for the hold)."""


class PartitionWatch:
    """Counts the partition rule's events and logs them, at most once a minute per kind."""

    def __init__(self, policy: AfterHold, clock: Callable[[], float]) -> None:
        self.policy = policy
        self.clock = clock
        self.held_buckets = 0
        self.holds_started = 0
        self.past_hold_buckets = 0
        self.holds_ended = 0
        self.handed_on = 0
        self._logged_held = -math.inf
        self._logged_ended = -math.inf

    def held(self, started: bool) -> None:
        """A bucket started (True) or stopped (False) being held for a silent replica."""
        if not started:
            self.held_buckets -= 1
            return
        self.held_buckets += 1
        self.holds_started += 1
        now = self.clock()
        if now - self._logged_held >= LOG_SECONDS:
            self._logged_held = now
            log.warning(
                "quota_share_held_for_silent_replica",
                buckets=self.held_buckets,
                started=self.holds_started,
                why="a replica stopped calling (dead or cut from Redis): its lease stays reserved for the hold",
            )

    def hold_ended(self) -> None:
        """A bucket of this replica, cut from Redis, passed its hold: it enforces the policy now."""
        self.past_hold_buckets += 1
        self.holds_ended += 1
        now = self.clock()
        if now - self._logged_ended >= LOG_SECONDS:
            self._logged_ended = now
            log.warning(
                "quota_partition_hold_ended",
                policy=self.policy,
                buckets=self.past_hold_buckets,
                ended=self.holds_ended,
                why="no answer from Redis for a lease and its hold: "
                + ("assigning nothing (deny)" if self.policy == "deny" else "enforcing ceil(limit / replicas)"),
            )

    def hold_over(self) -> None:
        """A bucket past its hold heard from Redis again, or was dropped."""
        self.past_hold_buckets -= 1

    def counts(self) -> PartitionCounts:
        return PartitionCounts(
            self.policy,
            self.held_buckets,
            self.holds_started,
            self.past_hold_buckets,
            self.holds_ended,
            self.handed_on,
        )
