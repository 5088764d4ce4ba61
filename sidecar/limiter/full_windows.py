"""Fixed windows Redis has reported full: strict mode refuses them without a round trip.

A fixed window's counter in Redis only grows until the window ends (strict mode adds
hits only to admitted requests, and the one thing that lowers a counter, a give-back
after a late answer, makes this memory forget the key). So once a script's answer says
a window holds ``count >= limit``, every later request that would add hits to it in
the same window is refused by Redis too, whatever the other replicas do meanwhile.
Deciding those here is exact, and it takes the round trip off the requests that need it
least: in a burst or a flood most requests are over the limit (issue 17: 280 of 300),
and each one that does not wait for Redis can neither miss its deadline nor fall to the
failure mode. envoyproxy/ratelimit keeps the same kind of memory (its
``LOCAL_CACHE_SIZE_IN_BYTES``); here it is always on and bounded in entries.

Only what cannot change the outcome is decided here: an ``enforced`` fixed-window check
over its limit refuses the whole request, which then consumes nothing. A request is
still sent to Redis when anything could make Redis answer otherwise or record
something: global shadow mode (every request consumes), a ``count_past_limit`` check
(consumes even when refused) or a ``ban_duration`` (Redis starts the ban), and when one
of its checks is not a fixed window Redis has reported on (its status would be a guess)
or names a counter twice. The limit is compared at request time, so a reload that
raises it sends the key to Redis again.

Not in Redis Cluster: a request whose counters live in different slots takes hits per
counter and gives back those of a refused request afterwards, so a count Redis reports
there may include hits on their way back.

Why not :class:`~sidecar.limiter.known_counts.KnownCounts`, which also remembers Redis's
answers: it serves the failure mode and errs high on purpose (it adds hits admitted
without Redis and scripts on the wire, and keeps counts a give-back may lower), while a
refusal here must rest on a count Redis is sure to hold.

If someone deletes a counter in Redis by hand (or a failover loses writes), requests on
it are refused until its window ends, as they were before; an exactly-counting design
cannot tell that apart from a full window without asking.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from sidecar.limiter.algorithms import Algorithm
from sidecar.limiter.protocol import Check, Decision, Role

PRUNE_SHARE = 0.9
"""At the cap, ended windows go first, then the oldest entries, down to this share."""


class FullWindows:
    """Per fixed-window Redis key, the count Redis last reported: the windows at or past
    their limit refuse requests here; the others give refused requests their counts."""

    __slots__ = ("_entries", "max_keys", "refusals")

    def __init__(self, max_keys: int) -> None:
        self.max_keys = max(0, max_keys)
        """0: nothing is remembered (Redis Cluster, see :class:`~sidecar.limiter.strict.StrictLimiter`)."""
        self.refusals = 0
        """Requests refused here without asking Redis."""
        self._entries: dict[str, tuple[int, int]] = {}
        """key: ``(count Redis holds, expire_at)``."""

    def __len__(self) -> int:
        return len(self._entries)

    def learn(self, holds: Iterable[tuple[str, int, int]], *, now: float) -> None:
        """Remember what a script's answer shows each fixed window holds:
        ``(key, count, expire_at)`` from :func:`~sidecar.limiter.known_counts.redis_holds`."""
        if not self.max_keys:
            return
        answered = list(holds)
        if len(answered) > 1 and len({key for key, _, _ in answered}) < len(answered):
            return  # a counter named twice: its would-be counts add up within the request
        entries = self._entries
        for key, held, expire_at in answered:
            entry = entries.get(key)
            if entry is None:
                self._make_room(now)
            elif entry[0] >= held:
                continue  # an answer that left Redis before a later one we already read
            entries[key] = (held, expire_at)

    def forget(self, key: str) -> None:
        """Redis is being given hits back on ``key``: its count may fall below what we hold."""
        self._entries.pop(key, None)

    def refusal(self, checks: Sequence[Check], keys: Sequence[str], admit_all: bool) -> Decision | None:
        """The decision Redis would take, if it is sure to be a refusal that records nothing;
        None when the request must go to Redis.

        Every check must be a fixed window Redis has reported on, so each descriptor's
        status and count come from Redis's own numbers (the last ones it sent)."""
        entries = self._entries
        if not entries or admit_all or (len(keys) > 1 and len(set(keys)) < len(keys)):
            return None
        counts = []
        refused = False
        for check, key in zip(checks, keys, strict=True):
            entry = entries.get(key)
            if entry is None or check.algorithm is not Algorithm.FIXED_WINDOW or check.count_past or check.ban_seconds:
                return None
            count = entry[0] + check.hits
            refused = refused or (count > check.limit and check.role is Role.ENFORCED)
            counts.append(count)
        if not refused:
            return None
        self.refusals += 1
        limits = tuple(check.limit for check in checks)
        over = tuple(count > limit for count, limit in zip(counts, limits, strict=True))
        return Decision(False, over, tuple(counts), limits)

    def _make_room(self, now: float) -> None:
        entries = self._entries
        if len(entries) < self.max_keys:
            return
        for key in [key for key, (_, expire_at) in entries.items() if expire_at <= now]:
            del entries[key]
        keep = int(self.max_keys * PRUNE_SHARE)
        while len(entries) > keep:
            del entries[next(iter(entries))]
