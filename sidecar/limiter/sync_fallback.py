"""The failure-mode side of ``sync`` mode: decisions taken without Redis, and their accounting.

Kept apart from :mod:`sidecar.limiter.sync` (local decisions, escalations, the flush
loop) as a mixin of :class:`~sidecar.limiter.sync.SyncLimiter`: what it decides when
Redis is away, slow, past the caller's deadline or refusing a key, how a late answer
of an escalation it stood in for is reconciled, and how hits it cannot keep are
counted. The ``local`` failure mode knows the count (:mod:`sidecar.limiter.fallback`):
a replica admits within its safe share *and* within what it knows is left of the
limit, ``known + unflushed`` of the counter.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import structlog

from sidecar.limiter.algorithms import Algorithm
from sidecar.limiter.budget import FailureReasons, Reason
from sidecar.limiter.failure import FailureMode, failure_limits
from sidecar.limiter.fallback import leaves_others_their_shares, local_counts
from sidecar.limiter.protocol import Check, Decision, Role
from sidecar.limiter.redis.replicas import Replicas
from sidecar.limiter.redis.store import RedisStore
from sidecar.limiter.redis.store import verdict as script_verdict
from sidecar.limiter.sync_counters import WindowCounter

log = structlog.get_logger("sidecar.limiter.sync")


class SyncFallback:
    """What :class:`~sidecar.limiter.sync.SyncLimiter` does when Redis does not decide."""

    admit_all: bool
    failure_mode: FailureMode
    failure_decisions: int
    reasons: FailureReasons
    replicas: Replicas
    store: RedisStore
    dropped_hits: int
    max_counters: int
    _drop_logged: bool

    def _would_be(
        self, checks: Sequence[Check], counters: Sequence[WindowCounter], own: bool = False, now: float = 0.0
    ) -> tuple[int, ...]:
        raise NotImplementedError  # SyncLimiter's

    def _apply(
        self,
        checks: Sequence[Check],
        counters: Sequence[WindowCounter],
        counts: tuple[int, ...],
        limits: tuple[int, ...],
    ) -> Decision:
        raise NotImplementedError  # SyncLimiter's

    def _decide_without_redis(
        self,
        checks: Sequence[Check],
        counters: Sequence[WindowCounter],
        now: float,
        reason: Reason,
        *,
        in_doubt: bool = False,
        late: bool = False,
    ) -> Decision:
        """Redis did not decide (``reason``): apply the failure mode
        (:func:`~sidecar.limiter.failure.failure_limits`); admitted hits stay pending.

        ``local`` counts this replica's own hits of the window against its share (safe
        capacity): if every replica does so, the total stays within the limit whatever
        each one's stale view of the others, even in a burst where some escalations
        were answered and others timed out; and it never admits past what it knows
        was admitted (``known + unflushed``: :func:`~sidecar.limiter.fallback.local_counts`),
        so a timed-out burst adds no share on top of what Redis already admitted.
        Escalations still on the wire count as admitted (``doubt``: their scripts may
        admit any moment), but for this request's own (``in_doubt``). ``open`` and
        ``closed`` count what is known.

        ``late``: the request escalated (it is near a limit) and ran out of time to hear
        Redis's answer. While Redis is not known to be down, the other replicas are still
        admitting through it, so a share on top of theirs would overshoot (issue 17: 23 of
        20 in a burst at Envoy's 25 ms deadline); ``local`` then refuses the enforced checks
        whose known count does not leave the others their shares (the rule strict mode's
        failure policy applies too, :func:`~sidecar.limiter.fallback.leaves_others_their_shares`),
        as the script may yet do, and a late answer that admitted gives its hits back.
        Once Redis is marked down, every replica holds to its share and ``local`` shares.
        """
        self.failure_decisions += 1
        self.reasons.note(reason)
        local = self.failure_mode == "local"
        live = self.replicas.live
        counts = self._would_be(checks, counters, own=local, now=now)
        if local:
            known = self._would_be(checks, counters, now=now)
            doubt = [
                counter.doubt - (check.hits if in_doubt else 0) for check, counter in zip(checks, counters, strict=True)
            ]
            known = tuple(count + max(0, hits) for count, hits in zip(known, doubt, strict=True))
            counts = local_counts(checks, counts, known, live)
            if (
                late
                and self.store.available
                and any(
                    check.role is Role.ENFORCED and not leaves_others_their_shares(check, seen, live)
                    for check, seen in zip(checks, known, strict=True)
                )
            ):
                return self._apply(checks, counters, counts, failure_limits("closed", checks, counts, live))
        limits = failure_limits(self.failure_mode, checks, counts, live)
        if local and not all(counter.remembered for counter in counters):
            # A counter with no room to be remembered cannot be held to a share (nothing
            # counts its hits) and could not keep them for Redis: refused, as ``closed``.
            closed = failure_limits("closed", checks, counts, live)
            limits = tuple(
                limit if counter.remembered else refused
                for limit, refused, counter in zip(limits, closed, counters, strict=True)
            )
        return self._apply(checks, counters, counts, limits)

    def _learn(
        self,
        checks: Sequence[Check],
        counters: Sequence[WindowCounter],
        adjusted: Sequence[Check],
        counts: Sequence[int],
    ) -> tuple[bool, tuple[bool, ...], tuple[bool, ...]]:
        """Update ``known`` from a script's answer; returns the script's ``decide`` verdict."""
        verdict = script_verdict(adjusted, counts, [check.limit for check in adjusted], self.admit_all)
        for check, counter, count, spent in zip(adjusted, counters, counts, verdict[2], strict=True):
            if check.algorithm is Algorithm.SLIDING_WINDOW:
                continue  # an estimate, not the window's count: the next flush reads the count
            counter.known = max(counter.known, count if spent else count - check.hits)
        return verdict

    @staticmethod
    def _doubt(checks: Sequence[Check], counters: Sequence[WindowCounter]) -> Callable[[], None]:
        """An escalation goes on the wire: its hits are in doubt until the returned function is called."""
        for check, counter in zip(checks, counters, strict=True):
            counter.doubt += check.hits

        def settled() -> None:
            for check, counter in zip(checks, counters, strict=True):
                counter.doubt -= check.hits

        return settled

    def _late_answer(
        self,
        checks: Sequence[Check],
        counters: Sequence[WindowCounter],
        adjusted: Sequence[Check],
        counts: list[int],
    ) -> None:
        """The script ran after we answered from the failure mode: undo the double count.

        Redis already holds the hits the script consumed, so they come off our pending
        hits (possibly below zero: the next flush then subtracts them in Redis). Hits
        the failure mode admitted are counted once either way; hits it refused are not
        counted at all.
        """
        _, _, consume = self._learn(checks, counters, adjusted, counts)
        for check, counter, spent in zip(checks, counters, consume, strict=True):
            if spent:
                counter.pending -= check.hits

    def _drop(self, hits: int) -> None:
        """Hits admitted on a counter that could not be remembered: counted, logged once per outage."""
        self.dropped_hits += hits
        if not self._drop_logged:
            self._drop_logged = True
            log.error(
                "failure_hits_dropped",
                mode="sync",
                failure_mode=self.failure_mode,
                max_counters=self.max_counters,
                hint="every counter holds hits Redis lacks: new counters are not remembered until Redis is back",
            )
