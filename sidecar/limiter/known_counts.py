"""A failure mode that knows the count: the ``local`` share starts from what is known admitted.

With Redis away, ``local`` holds each replica to its safe share, ``ceil(limit / R)``
of its own hits in the window. On its own that ignores what the replica knows Redis
already admitted: in a burst whose first requests Redis answered and whose last ones
timed out, every replica could add a whole share on top of a counter Redis had
filled (issue 17: strict mode admitted 30 of 20). So a request is also held to what
the replica knows is left: its would-be count is raised to at least

    share - limit + known

where ``known`` is what this replica knows was admitted in the window, this request's
hits included: the global total it last read plus its own hits Redis may not hold yet
(sync: ``known + unflushed`` of the counter; strict: :class:`KnownCounts`). The
request is then over its share exactly when ``own + hits > share`` or
``known > limit``: a replica never admits past a limit it knows is reached, and
never more than its share. The hits it admits are owed to Redis as before (the
ledger), so the Redis counters still equal the admitted hits afterwards.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from sidecar.limiter.algorithms import Algorithm
from sidecar.limiter.protocol import Check
from sidecar.limiter.shares import share_of_limit

PRUNE_SHARE = 0.9
"""At the cap, :class:`KnownCounts` forgets ended windows, then the oldest entries, down to this share."""


def knowledge_floor(check: Check, known: int, live: int) -> int:
    """The least would-be count of ``check`` in the ``local`` failure mode, given that
    ``known`` hits (this request's included) are known admitted in the window."""
    return share_of_limit(check.limit, live) - check.limit + known


def leaves_others_their_shares(check: Check, known: int, live: int) -> bool:
    """Whether ``known`` hits of ``check``'s window (this request's included) leave every other
    replica its share, ``(R - 1) * ceil(limit / R)``: the room a request decided without
    Redis needs while Redis is up and the others still admit through it (issue 17).
    With one replica nobody else admits: only the limit counts."""
    return known <= check.limit - (live - 1) * share_of_limit(check.limit, live)


def local_counts(checks: Sequence[Check], own: Sequence[int], known: Sequence[int], live: int) -> tuple[int, ...]:
    """Would-be counts for the ``local`` failure mode: this replica's own (``own``, the
    request's hits included), raised by what it knows (``known``, likewise)."""
    return tuple(
        max(count, knowledge_floor(check, seen, live)) for check, count, seen in zip(checks, own, known, strict=True)
    )


def redis_holds(
    checks: Sequence[Check],
    keys: Sequence[str],
    expire_ats: Sequence[int],
    counts: Sequence[int],
    consume: Sequence[bool],
) -> Iterator[tuple[str, int, int]]:
    """``(key, count Redis holds, expire_at)`` per fixed window of a script's answer:
    its would-be count where the script consumed the request's hits, else that less them
    (a sliding window's answer is an estimate, a bucket's a time: neither is a count)."""
    for check, key, expire_at, count, spent in zip(checks, keys, expire_ats, counts, consume, strict=True):
        if check.algorithm is Algorithm.FIXED_WINDOW:
            yield key, (count if spent else count - check.hits), expire_at


class KnownCounts:
    """strict mode: per window key, the count Redis last answered with, plus the hits the
    failure mode admitted on it that Redis may not hold yet, plus the hits of this
    replica's scripts on the wire (``doubt``: Redis may admit them any moment).

    Only fixed windows (a sliding window's answer is an estimate, a bucket's a time).
    Bounded by ``max_keys``; an entry is forgotten once its window's key has expired.
    """

    def __init__(self, max_keys: int) -> None:
        self.max_keys = max(1, max_keys)
        self._entries: dict[str, list[int]] = {}
        """key: ``[count Redis answered, failure-mode hits since, expire_at]``."""
        self._doubt: dict[str, int] = {}
        """key: hits of this replica's script calls on the wire (entries go with their calls)."""

    def learn(self, key: str, count: int, expire_at: int, settled: bool, now: float) -> None:
        """Redis holds ``count`` on ``key``. ``settled``: no failure-mode hit of the key is
        owed, on its way or in doubt, so ``count`` holds them all; otherwise they stay
        counted on top (erring towards refusing while Redis is away)."""
        entry = self._entries.get(key)
        if entry is None:
            self._make_room(now)
            self._entries[key] = [count, 0, expire_at]
            return
        entry[0] = max(entry[0], count)
        if settled:
            entry[1] = 0

    def admitted(self, key: str, hits: int, expire_at: int, now: float) -> None:
        """The failure mode admitted ``hits`` on ``key``: owed to Redis, known here."""
        entry = self._entries.get(key)
        if entry is None:
            self._make_room(now)
            self._entries[key] = [0, hits, expire_at]
        else:
            entry[1] += hits

    def in_doubt(self, checks: Sequence[Check], keys: Sequence[str], change: int) -> None:
        """A script call on ``keys`` goes on the wire (``change`` 1) or has ended (-1)."""
        doubt = self._doubt
        for check, key in zip(checks, keys, strict=True):
            if check.algorithm is Algorithm.FIXED_WINDOW and check.hits:
                left = doubt.get(key, 0) + change * check.hits
                if left > 0:
                    doubt[key] = left
                else:
                    doubt.pop(key, None)

    def known(self, key: str) -> int | None:
        """Hits known admitted on ``key`` in its window, or maybe admitted by a script on the
        wire; None when nothing is known."""
        entry = self._entries.get(key)
        doubt = self._doubt.get(key)
        if entry is None:
            return doubt
        return entry[0] + entry[1] + (doubt or 0)

    def floors(
        self, checks: Sequence[Check], keys: Sequence[str], live: int, own_in_doubt: bool = False
    ) -> tuple[int, ...]:
        """:func:`knowledge_floor` per check (0 where nothing is known); ``own_in_doubt``: the
        request's own script is on the wire, so its hits are not counted twice."""
        floors = []
        for check, key in zip(checks, keys, strict=True):
            known = self.known(key) if check.algorithm is Algorithm.FIXED_WINDOW else None
            if known is not None and own_in_doubt:
                known -= check.hits
            floors.append(0 if known is None else knowledge_floor(check, known + check.hits, live))
        return tuple(floors)

    def __bool__(self) -> bool:
        return bool(self._entries) or bool(self._doubt)

    def _make_room(self, now: float) -> None:
        entries = self._entries
        if len(entries) < self.max_keys:
            return
        for key in [key for key, entry in entries.items() if entry[2] <= now]:
            del entries[key]
        keep = int(self.max_keys * PRUNE_SHARE)
        while len(entries) > keep:
            del entries[next(iter(entries))]
