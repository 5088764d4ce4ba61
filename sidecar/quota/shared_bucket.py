"""One bucket as this replica shares it through Redis, and the counts of the sharing.

:class:`Shared` is what :class:`~sidecar.quota.leases.QuotaLeases` keeps per bucket: the
streams holding it, the usage not yet published, the lease it holds and what it last
pushed. Kept apart from the leases' logic so that logic reads as what it does to them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sidecar.quota.assignments import Assignment
from sidecar.quota.buckets import BucketKey
from sidecar.quota.shape import Shape
from sidecar.quota.stream import LiveBucket, Stream


@dataclass
class Shared:
    """One bucket as this process shares it: its holders, usage since the last call, its lease."""

    key: BucketKey
    base: Assignment
    shape: Shape
    tag: str
    """The common part of its Redis keys (hashed once, not per call)."""
    spread: float
    """In [0, 1), from its digest: where in the renewal window its renewal falls."""
    holders: dict[int, tuple[Stream, LiveBucket]] = field(default_factory=dict)
    count: int = 0
    """Allowed + denied reported since the demand was last published (clamped)."""
    allowed: int = 0
    """Allowed reported since the last call (windowed: added to the window's counter)."""
    counted_since: float = 0.0
    reported: bool = True
    grant: int | None = None
    """The units of the last grant picked up; None until Redis answered for this bucket."""
    lease_until: float = 0.0
    """Local clock: when the lease ends (the call's start + the lease)."""
    unheard_until: float = 0.0
    """Local clock: until when a bucket that never heard from Redis may use the safe capacity."""
    replicas: int = 0
    demand: int = 0
    outages: int = 0
    """The outage count when Redis last answered for it: a later outage means the next call
    publishes the last known demand (not a poll), since the record's demand may have gone
    stale in Redis meanwhile (it would count as 0)."""
    shown: tuple[int, int] = (0, 0)
    """(units, demand) last added to the per-rule totals of the metrics."""
    pushed: tuple[int, int] | None = None
    """(units, holders) of the assignment last pushed: a renewal that changes neither
    builds no assignment (windows excepted: theirs follows the clock)."""
    unsent: tuple[int, float, int] | None = None
    """(count, counted_since, demand) before the call in flight published a new demand: a
    call that finds Redis away puts them back, so the demand is measured over the outage."""
    held: bool = False
    """Redis keeps a silent replica's lease reserved in it (its last reply said so)."""
    past_hold: bool = False
    """Cut from Redis past its hold: enforcing ``--quota-after-hold``."""


@dataclass
class ShareStats:
    calls: int = 0
    batches: int = 0
    failures: int = 0
    computed: int = 0
    pushes: int = 0
    probes: int = 0
    refused: int = 0
    """Calls the script refused: dropped, with what they carried."""
    dropped_used: int = 0
    """Admitted requests those refused calls carried to a window's counter, dropped."""
    recovered: int = 0
