"""The ledger of hits owed to Redis: admitted here, not yet in Redis's counters.

Hits admitted without Redis (the failure mode) are remembered per Redis key so the
limiter can add them to Redis when it is back (:meth:`OwedHits.drain_admitted`, then
:meth:`~OwedHits.settle` or :meth:`~OwedHits.restore`): the Redis counters then still
equal the admitted hits, and other replicas see them. The same ledger takes
corrections (:meth:`OwedHits.owe`, possibly negative: hits Redis holds but must give
back), so every adjustment of a counter is one commutative ``INCRBY`` whatever was
already sent.

The ledger holds what ``INCRBY`` adds, per key: hits for a window (a sliding window's
hits go to its current window, like a fixed window's), and ``hits * interval`` (us)
for a token bucket's TAT key: charging the bucket, or with a negative amount giving
back. That is an approximation for buckets: ``INCRBY`` moves the TAT it finds, not
``max(TAT, now)`` as a decision does, so hits owed to a bucket that has refilled since
(its TAT in the past, or its key expired) are partly or wholly forgiven, never charged
twice; and ``INCRBY`` keeps the key's expiry, set for the TAT before the charge, so a
charge longer than the expiry grace may be forgiven early when the key expires.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Mapping, Sequence

import structlog

log = structlog.get_logger(__name__)

Admitted = dict[str, tuple[int, int]]
"""Owed to Redis: ``{key: (amount, expire_at)}``, ``INCRBY`` amounts (hits, or a TAT's
microseconds); negative amounts are to be given back."""
WAITERS_PRUNE = 1024
"""Abandoned waiters of :meth:`OwedHits.wait_settled` are pruned past this many."""


class OwedHits:
    """Hits owed to Redis per key, the keys on their way there, and the keys in doubt."""

    def __init__(self, max_counters: int) -> None:
        self.max_counters = max_counters
        self.dropped_hits = 0
        """Admitted hits that could not be remembered (more than ``max_counters`` keys owed)."""
        self.dropped_give_backs = 0
        """Hits to give back that could not be remembered (Redis keeps them: errs towards rejecting)."""
        self._owed: dict[str, list[int]] = {}
        self._per_hit: dict[str, int] = {}
        """Amount per hit of owed or in-flight keys that are not windows (token buckets), for
        the hit counts reported; kept while the key is owed or in flight."""
        self._in_flight: dict[str, int] = {}
        self._held: dict[str, int] = {}
        self._has_owed = asyncio.Event()
        self._waiters: list[asyncio.Future[None]] = []
        self._drop_logged = False

    def log_next_drop(self) -> None:
        """Log the next dropped hit again (once per outage, not once per process)."""
        self._drop_logged = False

    @property
    def owed_hits(self) -> int:
        """Hits admitted here and not sent to Redis yet (in flight excluded)."""
        return sum(hits for hits in self._hits(self._owed) if hits > 0)

    @property
    def owed_give_backs(self) -> int:
        """Hits Redis holds but must give back, not sent yet (in flight excluded)."""
        return -sum(hits for hits in self._hits(self._owed) if hits < 0)

    def hits_in(self, adds: Mapping[str, Sequence[int]]) -> int:
        """Hits (not give-backs) in owed or in-flight amounts such as a flush's ``adds``."""
        return sum(hits for hits in self._hits(adds) if hits > 0)

    def _hits(self, amounts: Mapping[str, Sequence[int]]) -> Iterable[int]:
        """Each key's amount in hits (a token bucket's microseconds divided back)."""
        per = self._per_hit
        if not per:
            return (amount for amount, *_ in amounts.values())
        return (amount // per.get(key, 1) for key, (amount, *_) in amounts.items())

    def reconciled(self) -> bool:
        """Whether Redis holds every hit admitted here (nothing owed, in flight or held)."""
        return not self._owed and not self._in_flight and not self._held

    def owes(self) -> bool:
        """Whether any hit waits for reconciliation (in flight excluded)."""
        return bool(self._owed)

    def settled(self, keys: Iterable[str]) -> bool:
        """Whether Redis holds exactly what this replica admitted on ``keys``.

        False while one of them has hits (or give-backs) owed, on their way, or held
        (:meth:`hold`): Redis might not hold them yet, so an exact decision on that
        counter must wait.
        """
        owed, in_flight, held = self._owed, self._in_flight, self._held
        if not owed and not in_flight and not held:
            return True
        return not any(key in owed or key in in_flight or key in held for key in keys)

    def hold(self, keys: Iterable[str]) -> None:
        """Hits of ``keys`` are in doubt (a Redis call that may still count them is on the wire)."""
        held = self._held
        for key in keys:
            held[key] = held.get(key, 0) + 1

    def release(self, keys: Iterable[str]) -> None:
        """Undo one :meth:`hold` of ``keys``: the doubt is resolved (and owed as needed)."""
        held = self._held
        for key in keys:
            left = held.get(key, 0) - 1
            if left > 0:
                held[key] = left
            else:
                held.pop(key, None)
        self._wake()

    async def wait_settled(self, keys: Sequence[str]) -> None:
        """Return once :meth:`settled` holds for ``keys`` (the caller bounds the wait)."""
        while not self.settled(keys):
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            if len(self._waiters) >= WAITERS_PRUNE:
                self._waiters = [pending for pending in self._waiters if not pending.done()]
            self._waiters.append(waiter)
            await waiter

    def busy(self, keys: Iterable[str]) -> bool:
        """Whether hits of one of ``keys`` are on their way to Redis right now.

        A request on such a key must not ask Redis yet: Redis might not have the
        hits, and this replica would count them as if they were not admitted.
        """
        in_flight = self._in_flight
        return bool(in_flight) and any(key in in_flight for key in keys)

    def take(self, keys: Iterable[str]) -> Admitted:
        """Owed hits of ``keys`` only (to send with a request's own script); marks them in flight."""
        if not self._owed:
            return {}
        taken: Admitted = {}
        for key in keys:
            entry = self._owed.pop(key, None)
            if entry is not None:
                taken[key] = (entry[0], entry[1])
        self._mark_in_flight(taken)
        return taken

    def drain_admitted(self) -> Admitted:
        """Every owed hit, to be flushed to Redis; marks them in flight until settled or restored."""
        drained = {key: (hits, expire_at) for key, (hits, expire_at) in self._owed.items()}
        self._owed.clear()
        self._has_owed.clear()
        self._mark_in_flight(drained)
        return drained

    def settle(self, adds: Mapping[str, tuple[int, int]]) -> None:
        """Redis holds ``adds`` now."""
        self._unmark_in_flight(adds)

    def restore(self, adds: Mapping[str, tuple[int, int]]) -> None:
        """Sending ``adds`` failed: owe them again."""
        for key, (amount, expire_at) in adds.items():
            self.owe_amount(key, amount, expire_at, None, self._per_hit.get(key, 1))
        self._unmark_in_flight(adds)

    def owe(self, key: str, hits: int, expire_at: int, amount_per_hit: int = 1) -> bool:
        """Add ``hits`` (negative: take them off) to what Redis is owed for ``key``.

        For corrections: a negative entry is sent like any other (``INCRBY`` with a
        negative amount), and entries of one key merge, so a correction is exact
        whether what it corrects is still owed, on the wire, or already in Redis.
        ``amount_per_hit`` is what one hit adds to the key (:func:`~sidecar.limiter.redis.keys.per_hit`).
        Returns False if it could not be remembered (see :attr:`dropped_hits` and
        :attr:`dropped_give_backs`).
        """
        return self.owe_amount(key, hits * amount_per_hit, expire_at, None, amount_per_hit) if hits else True

    async def wait_owed(self) -> None:
        """Return once some hit is owed."""
        await self._has_owed.wait()

    def owe_amount(self, key: str, amount: int, expire_at: int, now: float | None, amount_per_hit: int = 1) -> bool:
        """Owe ``amount`` (already in ``INCRBY`` units) for ``key``; False if it could not be remembered."""
        entry = self._owed.get(key)
        if entry is not None:
            entry[0] += amount
            if not entry[0]:
                self._forget(key)  # a correction cancelled what was owed: nothing to send
                self._wake()
                return True
        elif len(self._owed) < self.max_counters or self._make_room(now):
            self._owed[key] = [amount, expire_at]
        else:
            self._drop(amount // amount_per_hit)
            return False
        if amount_per_hit != 1:
            self._per_hit[key] = amount_per_hit
        self._has_owed.set()
        return True

    def _forget(self, key: str) -> None:
        """Drop what is owed for ``key``, and its amount per hit once nothing of it is in flight."""
        del self._owed[key]
        if key not in self._in_flight:
            self._per_hit.pop(key, None)

    def _make_room(self, now: float | None) -> bool:
        """Forget hits owed to windows that have ended, and to buckets full again by now
        (their keys are gone from Redis anyway, or the hits no longer matter)."""
        moment = time.time() if now is None else now
        for key in [key for key, (_, expire_at) in self._owed.items() if expire_at <= moment]:
            self._forget(key)
        return len(self._owed) < self.max_counters

    def _drop(self, hits: int) -> None:
        if hits < 0:
            self.dropped_give_backs -= hits
        else:
            self.dropped_hits += hits
        if not self._drop_logged:
            self._drop_logged = True
            log.warning(
                "failure_hits_dropped",
                max_counters=self.max_counters,
                hint="more distinct counters were admitted during the outage than --max-counters",
            )

    def _mark_in_flight(self, adds: Mapping[str, tuple[int, int]]) -> None:
        for key in adds:
            self._in_flight[key] = self._in_flight.get(key, 0) + 1

    def _unmark_in_flight(self, adds: Mapping[str, tuple[int, int]]) -> None:
        for key in adds:
            left = self._in_flight.get(key, 0) - 1
            if left > 0:
                self._in_flight[key] = left
            else:
                self._in_flight.pop(key, None)
                if key not in self._owed:
                    self._per_hit.pop(key, None)
        self._wake()

    def _wake(self) -> None:
        """Let every :meth:`wait_settled` look again."""
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)
