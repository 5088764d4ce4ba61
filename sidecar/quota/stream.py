"""One open RLQS stream and the buckets it keeps alive: the state the registry, the shares
and the servicer all hold a reference to.

Kept apart from :mod:`sidecar.quota.registry` (which decides what happens to them) so the
shares (:mod:`sidecar.quota.leases`) can name them without importing the registry.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from sidecar.quota.assignments import Action, Assignment
from sidecar.quota.buckets import BucketKey, bucket_key
from sidecar.quota.outbox import Outbox


@dataclass(slots=True)
class LiveBucket:
    bucket_id: dict[str, str]
    assignment: Assignment
    sent_at: float
    used_at: float
    nanos: int = 0
    allowed: int = 0
    denied: int = 0
    refresh_every: float = 0.0
    generation: int = 0
    """The config generation it was matched under (a reload re-matches older ones)."""


@dataclass
class Stream:
    """One open ``StreamRateLimitQuotas`` call."""

    id: int
    peer: str
    opened_at: float
    buckets: dict[BucketKey, LiveBucket] = field(default_factory=dict)
    abandoned: dict[BucketKey, float] = field(default_factory=dict)
    abandon_order: deque[tuple[float, BucketKey]] = field(default_factory=deque)
    pending: Outbox = field(default_factory=Outbox)
    due: list[tuple[float, int, BucketKey]] = field(default_factory=list)
    """A heap of when each live bucket next needs a look (refresh or idle), one entry each."""
    last_report_at: float | None = None
    domain: str = ""
    notify: Callable[[], None] = lambda: None
    """Wakes the stream's writer: called when actions were queued outside its own loop."""

    def push(self, action: Action, key: BucketKey | None = None) -> None:
        """Queue one action for the stream's writer: the one way actions are queued.

        The latest action per bucket id replaces one still queued (see :class:`Outbox`);
        ``key`` is the id's :func:`bucket_key` when the caller has it."""
        self.pending.push(bucket_key(action.bucket_id) if key is None else key, action)

    def abandon(self, key: BucketKey, now: float) -> None:
        self.abandoned[key] = now
        self.abandon_order.append((now, key))
