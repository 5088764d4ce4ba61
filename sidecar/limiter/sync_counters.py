"""What a ``sync`` replica knows of each counter, and what one flush carries.

Kept apart from :mod:`sidecar.limiter.sync` (the decisions and the flush loop) because
these are its plain data: one :class:`WindowCounter` per counter and window, the
check an escalation sends (:func:`lowered_check`), and a :class:`FlushBatch`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sidecar.limiter.algorithms import Algorithm
from sidecar.limiter.protocol import Check


@dataclass(slots=True)
class WindowCounter:
    """What this replica knows about one counter in one window."""

    key: str
    digest: str
    expire_at: int
    known: int = 0
    """Global total last read from Redis (includes our flushed hits)."""
    pending: int = 0
    """Admitted here, not yet sent to Redis."""
    inflight: int = 0
    """Sent in a flush that has not been acknowledged yet."""
    growth: float = 0.0
    """EWMA of hits other replicas add between two of our syncs."""
    own: int = 0
    """Hits this replica admitted in the window (the ``local`` failure mode's measure)."""
    doubt: int = 0
    """Hits of this replica's escalations on the wire: Redis may admit them any moment (the
    ``local`` failure mode counts them as admitted until their answer comes)."""
    touched: bool = True
    """Used since the last flush: its total is worth reading back."""
    busy: int = 0
    """Requests deciding with this counter right now: it must not be evicted or expired
    under them, or the hits they admit would land on a counter nobody flushes."""
    ban_key: str | None = None
    """Rules with ``ban_duration``: the counter's ban key, read back with every flush."""
    previous_key: str | None = None
    """Sliding window only: the previous window's key, read back with every flush."""
    previous: int | None = None
    """Sliding window only: the previous window's global total; None until known (every
    decision on the counter escalates until then)."""
    remembered: bool = True
    """False for a counter made for one request only, at ``--max-counters`` with no counter
    that can be forgotten: nothing flushes its hits, so only Redis (an escalation) may
    admit on it, and hits a failure mode admits on it are dropped and counted."""

    @property
    def unflushed(self) -> int:
        """Our hits Redis may not hold yet."""
        return self.pending + self.inflight

    def extra_reads(self) -> list[str]:
        """Keys a flush reads besides the counter: the previous window, the ban."""
        return [key for key in (self.previous_key, self.ban_key) if key is not None]


def lowered_check(check: Check, own: int, previous_part: int | None) -> Check:
    """The check an escalation sends: the limit lowered by our unflushed hits.

    A sliding window whose previous total is known goes as a fixed window with the
    limit also lowered by that total's weighted part, so the answer is the current
    window's count, which :meth:`SyncLimiter._learn` can learn from; one whose previous
    total is unknown goes as a sliding window and the script weighs the previous
    window itself.
    """
    # Not clamped at 0: hits counted past the limit (count_past_limit) can leave less
    # than nothing, and a check of 0 hits must then still be over.
    if previous_part is None:
        return check._replace(limit=check.limit - own)
    lowered = check.limit - own - previous_part
    return check._replace(limit=lowered, algorithm=Algorithm.FIXED_WINDOW)


@dataclass(slots=True)
class FlushBatch:
    """One flush: what was sent, so the answer (or failure) can be applied."""

    sent: dict[str, tuple[WindowCounter, int]]
    reads: list[WindowCounter]
    sequence: int
    """Grows with every new batch; a retried batch keeps its number (idempotent flush)."""

    bans: dict[str, int] = field(default_factory=dict)
    """Bans decided here since the last flush: ``{ban key: until}`` (SET NX, so the first wins)."""

    def counters(self) -> list[WindowCounter]:
        """Every counter the flush sends hits for or reads back."""
        return [counter for counter, _ in self.sent.values()] + self.reads
