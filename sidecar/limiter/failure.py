"""What a Redis-backed limiter answers while Redis is unreachable, and what it then owes Redis.

Three modes (``--redis-failure-mode``):

* ``local`` (default): enforce ``ceil(limit / live replicas)`` in this process, the
  "safe capacity" of Doorman: if every replica does so, together they admit about the
  limit without talking to each other; and never past what this replica knows was
  admitted already (the counts Redis last answered with, :mod:`sidecar.limiter.known_counts`).
* ``open``: admit everything; for services where a rate limit outage must never
  become an outage of the service.
* ``closed``: reject every request with an enforced limit; for limits that protect
  something that must never be overrun.

The rule is :func:`failure_limits`, shared by the ``sync`` and ``strict`` backends;
``sync`` applies it to its counters through :func:`sync_failure_limits`, ``strict``
through :class:`FailurePolicy`.
Hits admitted here are owed to Redis through :attr:`FailurePolicy.ledger`
(:mod:`sidecar.limiter.ledger`), so the Redis counters still equal the admitted hits
once Redis is back.

Bans decided here are not sent to Redis: they protect this replica during the outage,
and a ban Redis holds is honoured by the script as soon as Redis answers.

State changes are logged once each (``redis_unavailable``, ``redis_recovered``),
never per request: an outage under load must not turn into a flood of log lines.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Literal, get_args

import structlog

from sidecar.limiter.algorithms import Algorithm
from sidecar.limiter.bounds import DEFAULT_MAX_COUNTERS
from sidecar.limiter.known_counts import KnownCounts, leaves_others_their_shares, local_counts, redis_holds
from sidecar.limiter.ledger import OwedHits
from sidecar.limiter.memory import MemoryLimiter
from sidecar.limiter.protocol import Check, Decision, Role, decide
from sidecar.limiter.redis.keys import per_hit
from sidecar.limiter.shares import share_of_limit
from sidecar.metrics import LimiterSnapshot

log = structlog.get_logger(__name__)

FailureMode = Literal["local", "open", "closed"]
MODES: tuple[FailureMode, ...] = get_args(FailureMode)


def failure_limits(mode: FailureMode, checks: Sequence[Check], counts: Sequence[int], live: int) -> tuple[int, ...]:
    """The limit each check is held to while Redis is unreachable: the one rule of every
    Redis backend's failure mode, applied by :func:`~sidecar.limiter.protocol.decide`
    to the would-be counts the backend knows.

    ``local``: this replica's share, ``ceil(limit / live replicas)`` (the counts must
    then be this replica's own hits). ``open``: never below the count, so nothing is
    over. ``closed``: an enforced check is over whatever its count (nothing left, as
    far as we can know); shadow and quota checks are held to nothing they could pass.
    """
    if mode == "local":
        return tuple(share_of_limit(check.limit, live) for check in checks)
    if mode == "open":
        return tuple(max(check.limit, count) for check, count in zip(checks, counts, strict=True))
    return tuple(
        -1 if check.role is Role.ENFORCED else max(check.limit, count)
        for check, count in zip(checks, counts, strict=True)
    )


def sync_failure_limits(
    mode: FailureMode,
    checks: Sequence[Check],
    *,
    own: Sequence[int],
    known: Sequence[int],
    doubt: Sequence[int],
    remembered: Sequence[bool],
    live: int,
    late: bool,
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The counts and limits a ``sync`` replica decides a request by when Redis did not
    decide it: :func:`failure_limits` applied to what the replica knows of its counters.

    Per check: ``own``, the hits this replica admitted itself in the window, and
    ``known``, what it knows is admitted (``known + unflushed`` of the counter, plus a
    sliding window's previous part), both with this request's hits; ``doubt``, hits of
    its escalations still on the wire (their scripts may admit them any moment; the
    request's own escalation left out); ``remembered``, whether the counter is held.

    ``local`` counts the replica's own hits against its share (safe capacity): if every
    replica does so, the total stays within the limit whatever each one's stale view of
    the others, even in a burst where some escalations were answered and others timed
    out; and it never admits past what it knows was admitted, hits in doubt included
    (:func:`~sidecar.limiter.known_counts.local_counts`), so a timed-out burst adds no
    share on top of what Redis already admitted. ``open`` and ``closed`` count what is known.

    ``late``: the request escalated (it is near a limit) and ran out of time to hear
    Redis's answer while Redis is not known to be down, so the other replicas are still
    admitting through it and a share on top of theirs would overshoot (issue 17: 23 of 20
    in a burst at Envoy's 25 ms deadline); ``local`` then refuses (as ``closed``) when an
    enforced check's known count does not leave the others their shares (the rule strict
    mode's failure policy applies too,
    :func:`~sidecar.limiter.known_counts.leaves_others_their_shares`), as the script may
    yet do. A counter with no room to be remembered cannot be held to a share (nothing
    counts its hits) and could not keep them for Redis: ``local`` refuses it, as ``closed``.
    """
    if mode != "local":
        counts = tuple(known)
        return counts, failure_limits(mode, checks, counts, live)
    seen = tuple(count + max(0, hits) for count, hits in zip(known, doubt, strict=True))
    counts = local_counts(checks, own, seen, live)
    if late and any(
        check.role is Role.ENFORCED and not leaves_others_their_shares(check, count, live)
        for check, count in zip(checks, seen, strict=True)
    ):
        return counts, failure_limits("closed", checks, counts, live)
    limits = failure_limits("local", checks, counts, live)
    if not all(remembered):
        closed = failure_limits("closed", checks, counts, live)
        limits = tuple(
            limit if held else refused for limit, refused, held in zip(limits, closed, remembered, strict=True)
        )
    return counts, limits


def held_to_shares(checks: Sequence[Check], own: Sequence[int], live: int, admit_all: bool) -> tuple[int, ...] | None:
    """Returning from an outage (``local`` mode, :attr:`Replicas.returning`): the limits
    that refuse the request when this replica's own hits of a window (``own``, the request's
    and those of its calls on the wire included) would pass its share, ``ceil(limit / R)``;
    None when every check fits and Redis may decide as usual.

    A peer may still decide by the failure mode, or hold outage hits Redis lacks, so what
    Redis answers is not the whole count: every replica finishes the outage under its
    share until all have settled, which keeps the bound whatever the order in which they
    return (proved in docs/redis.md, "Returning from an outage").
    """
    limits = failure_limits("local", checks, own, live)
    admitted, _, _ = decide(checks, own, limits, admit_all)
    return None if admitted else limits


class Settlement:
    """Whether the hits a limiter admitted before Redis returned are all in Redis.

    The limiter numbers its flushes; at a return, :meth:`returned` notes the last number
    (plus one when hits wait for a flush not prepared yet), and :meth:`landed` each
    flush Redis acknowledged (or one prepared empty: nothing was left). A returning
    replica beats only once settled (:meth:`Replicas.follow_outages`).
    """

    def __init__(self) -> None:
        self._due = 0
        self._landed = 0

    def returned(self, sequence: int, waiting: bool) -> None:
        """Redis is back; ``sequence``: the last flush numbered, ``waiting``: hits not in one yet."""
        self._due = sequence + 1 if waiting else sequence

    def landed(self, sequence: int) -> None:
        """Flush ``sequence`` is in Redis, or was empty (flushes are acknowledged in order)."""
        self._landed = max(self._landed, sequence)

    def settled(self) -> bool:
        """Every hit admitted before the last return is in Redis."""
        return self._landed >= self._due


Admitted = dict[str, tuple[int, int]]
"""Owed to Redis: ``{key: (amount, expire_at)}``, ``INCRBY`` amounts (hits, or a TAT's
microseconds); negative amounts are to be given back."""
WAITERS_PRUNE = 1024
"""Abandoned waiters of :meth:`FailurePolicy.wait_settled` are pruned past this many."""


class FailurePolicy:
    """Decides requests without Redis and keeps the hits it admitted until Redis has them."""

    def __init__(
        self,
        mode: FailureMode = "local",
        live: Callable[[], int] = lambda: 1,
        *,
        admit_all: bool = False,
        max_counters: int = DEFAULT_MAX_COUNTERS,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"failure mode must be one of {', '.join(MODES)}, not {mode!r}")
        self.mode = mode
        self.live = live
        self.admit_all = admit_all
        self.max_counters = max_counters
        self.degraded = False
        """True between ``redis_unavailable`` and ``redis_recovered``."""
        self.decisions = 0
        """Requests decided here since the process started."""
        self.ledger = OwedHits(max_counters)
        """What this replica admitted (or must give back) and Redis does not hold yet."""
        self._local = MemoryLimiter(max_counters=max_counters, admit_all=admit_all)
        self.known = KnownCounts(max_counters)
        """``local`` mode: the counts Redis last answered with per key, plus hits admitted here since."""
        self._since = 0.0
        self._on_wire: dict[str, int] = {}
        """Returning from an outage: hits of this replica's script calls on the wire, per key."""

    # -- deciding --------------------------------------------------------------------

    def check(
        self,
        checks: Sequence[Check],
        keys: Sequence[str],
        expire_ats: Sequence[int],
        now: float,
        *,
        late: bool = False,
    ) -> Decision:
        """Decide one request without Redis; ``keys``/``expire_ats`` are its Redis window keys.

        ``late``: Redis is up, only this request could not hear it in time (:meth:`_held_back`)."""
        return self._check(checks, keys, expire_ats, now, owe=True, in_doubt=False, late=late)[0]

    def check_without_owing(
        self,
        checks: Sequence[Check],
        keys: Sequence[str],
        expire_ats: Sequence[int],
        now: float,
        *,
        late: bool = False,
    ) -> tuple[Decision, tuple[int, ...]]:
        """:meth:`check`, but owing nothing: returns the hits admitted per check instead.

        For a request whose Redis call is still on the wire: the caller decides what
        is owed once it knows whether the script counted the hits (:meth:`owe`), and
        holds the keys meanwhile (:meth:`hold`). Its script's hits are in doubt
        (:meth:`KnownCounts.in_doubt`) and not counted twice.
        """
        return self._check(checks, keys, expire_ats, now, owe=False, in_doubt=True, late=late)

    def _check(
        self,
        checks: Sequence[Check],
        keys: Sequence[str],
        expire_ats: Sequence[int],
        now: float,
        *,
        owe: bool,
        in_doubt: bool,
        late: bool = False,
    ) -> tuple[Decision, tuple[int, ...]]:
        self.decisions += 1
        local = self.mode == "local"
        if local and late and self._held_back(checks, keys, in_doubt):
            return self._without_counting(checks, "closed"), (0,) * len(checks)
        decision = self._decide_locally(checks, keys, now, in_doubt) if local else self._without_counting(checks)
        if not decision.admitted and not any(check.count_past for check in checks):
            return decision, (0,) * len(checks)
        _, _, consume = decide(checks, decision.counts, decision.limits, self.admit_all)
        spent = tuple(check.hits if spend else 0 for check, spend in zip(checks, consume, strict=True))
        if local:
            for check, key, expire_at, hits in zip(checks, keys, expire_ats, spent, strict=True):
                if hits and check.algorithm is Algorithm.FIXED_WINDOW:
                    self.known.admitted(key, hits, expire_at, now)
        if owe:
            for check, key, expire_at, hits in zip(checks, keys, expire_ats, spent, strict=True):
                if hits:
                    self.ledger.owe_amount(key, hits * per_hit(check), expire_at, now, per_hit(check))
        return decision, spent

    def _held_back(self, checks: Sequence[Check], keys: Sequence[str], in_doubt: bool) -> bool:
        """Redis is up and only this request could not hear it in time (its deadline ran out):
        the other replicas are still admitting through Redis, so a share on top of theirs
        would overshoot. True (refuse, as ``closed``) when an enforced fixed window may be
        near its limit: what is known of it, the count Redis last answered plus this
        replica's scripts on the wire, leaves less room than every other replica's share
        (``(R - 1) * ceil(limit / R)``; with one replica, nobody else admits, and the
        share's own floor already counts what is known). Elsewhere the share applies as
        in an outage: far from a limit, and where nothing is known (a window no answer
        has come for yet, a sliding window, a bucket), so a Redis hiccup shorter than the
        silence that marks it down does not refuse every request of a new window.
        """
        live = max(1, self.live())
        for check, key in zip(checks, keys, strict=True):
            if check.role is not Role.ENFORCED:
                continue
            known = self.known.known(key) if check.algorithm is Algorithm.FIXED_WINDOW else None
            if known is None:
                continue
            if in_doubt:
                known -= check.hits  # its own script is on the wire: counted once
            if not leaves_others_their_shares(check, known + check.hits, live):
                return True
        return False

    def _decide_locally(self, checks: Sequence[Check], keys: Sequence[str], now: float, in_doubt: bool) -> Decision:
        """This replica's share of each limit, counted over all of its own hits of the window,
        and within what it knows is left of the limit (:mod:`sidecar.limiter.known_counts`).

        The hits this replica had Redis admit before the outage count too
        (:meth:`note_admitted`): if every replica keeps its own hits of a window within
        ``ceil(limit / R)``, the total stays within the limit whatever each one knew of
        the others. Local counts outlive the outage until their window ends, so a
        second outage in the same window still sees the first one's hits. Bans decided
        here stay here (see the module docstring).
        """
        live = max(1, self.live())
        self._local.instances = live
        floors = self.known.floors(checks, keys, live, in_doubt) if self.known else ()
        return self._local.check_now(checks, now, floors)

    def beyond_share(
        self, checks: Sequence[Check], keys: Sequence[str], expire_ats: Sequence[int], now: float
    ) -> Decision | None:
        """strict, returning from an outage: the refusal of a request that would take this
        replica's own hits of a window past its share (:func:`held_to_shares`), counting
        its calls still on the wire; None when it fits and Redis decides. ``local`` only:
        ``open`` never held to a share, ``closed`` admitted nothing meanwhile."""
        if self.mode != "local":
            return None
        counts = self._own_counts(checks, keys, now)
        limits = held_to_shares(checks, counts, max(1, self.live()), self.admit_all)
        if limits is None:
            return None
        admitted, over, consume = decide(checks, counts, limits, self.admit_all)
        for check, key, expire_at, spend in zip(checks, keys, expire_ats, consume, strict=True):
            if spend and check.hits:  # count_past_limit: counted though refused, as the script would
                self._local.record(check, now)
                self.ledger.owe_amount(key, check.hits * per_hit(check), expire_at, now, per_hit(check))
        return Decision(admitted, over, counts, limits)

    def _own_counts(self, checks: Sequence[Check], keys: Sequence[str], now: float) -> tuple[int, ...]:
        """Per check, this replica's own hits of its window (a bucket's: 0, it has no
        window), its calls on the wire and the request's hits, earlier checks of a key included."""
        seen: dict[str, int] = {}
        counts = []
        for check, key in zip(checks, keys, strict=True):
            if check.algorithm is Algorithm.TOKEN_BUCKET:
                counts.append(0)
                continue
            before = seen.get(key)
            if before is None:
                before = self._local.count(check.key, check.unit_seconds, now) + self._on_wire.get(key, 0)
            seen[key] = before + check.hits
            counts.append(before + check.hits)
        return tuple(counts)

    def on_wire(self, checks: Sequence[Check], keys: Sequence[str], change: int) -> None:
        """A call admitted by :meth:`beyond_share` goes to Redis (``change`` 1) or has ended (-1)."""
        for check, key in zip(checks, keys, strict=True):
            left = self._on_wire.get(key, 0) + change * check.hits
            if left > 0:
                self._on_wire[key] = left
            else:
                self._on_wire.pop(key, None)

    def note_admitted(self, checks: Sequence[Check], consume: Sequence[bool], now: float) -> None:
        """Count hits Redis admitted for this replica against its local share (``local`` mode)."""
        if self.mode != "local":
            return
        for check, spent in zip(checks, consume, strict=True):
            if spent and check.hits:
                self._local.record(check, now)

    def learn(
        self,
        checks: Sequence[Check],
        keys: Sequence[str],
        expire_ats: Sequence[int],
        counts: Sequence[int],
        consume: Sequence[bool],
        *,
        now: float,
    ) -> None:
        """Remember what Redis holds on each fixed window of a script's answer (``local``
        mode): the would-be count if the script consumed the hits, else that less them."""
        if self.mode != "local":
            return
        ledger = self.ledger
        for key, held, expire_at in redis_holds(checks, keys, expire_ats, counts, consume):
            self.known.learn(key, held, expire_at, ledger.settled((key,)), now)

    def _without_counting(self, checks: Sequence[Check], mode: FailureMode | None = None) -> Decision:
        """``open`` and ``closed``: the request's own hits against :func:`failure_limits`."""
        counts = tuple(check.hits for check in checks)
        limits = failure_limits(mode or self.mode, checks, counts, self.live())
        admitted, over, _ = decide(checks, counts, limits, self.admit_all)
        return Decision(admitted, over, counts, tuple(max(0, limit) for limit in limits))

    def local_snapshot(self) -> LimiterSnapshot:
        """Counters of the local failure-mode limiter (the only counters strict mode holds)."""
        return self._local.snapshot()

    # -- state changes -----------------------------------------------------------------

    def on_redis_state(self, available: bool, reason: str) -> None:
        """Listener for :meth:`RedisStore.add_listener`: one log line per change of state."""
        if not available and not self.degraded:
            self.degraded = True
            self._since = time.monotonic()
            self.ledger.log_next_drop()
            log.warning("redis_unavailable", reason=reason, failure_mode=self.mode, live_replicas=self.live())
        elif available and self.degraded:
            self.degraded = False
            log.info(
                "redis_recovered",
                outage_seconds=round(time.monotonic() - self._since, 3),
                failure_decisions=self.decisions,
                owed_hits=self.ledger.owed_hits,
                dropped_hits=self.ledger.dropped_hits,
            )
