"""Redis key names for counters: collision-free, bounded, Cluster-slot aware.

A counter key is a tuple of arbitrary strings (rule identity plus request values
that may hold ``_``, ``:``, ``{``, ``}``, newlines or any UTF-8). Joining them with
a separator would let two descriptors collide, and putting them in a key verbatim
would make keys unbounded and let ``{`` break Redis Cluster hash tags. So the tuple
is length-prefix encoded and hashed (BLAKE2b, 128 bits): keys have a fixed length,
never carry request data, and every key of one counter shares the hash tag
``{digest}``, so all of them (window counters, bans) live in one Cluster slot.

One counter's keys, all ``prefix:{digest}:<suffix>``:

* ``:<window start>``: a fixed or sliding window's hits in that window (a sliding
  window also reads the previous window's key, ``start - unit``);
* ``:tat``: a token bucket's theoretical arrival time, in Unix microseconds;
* ``:ban``: present while the counter is banned; it holds the ban's end (Unix
  seconds) and expires then (``SET ... EXAT end``), so whoever reads it knows until when.
"""

from __future__ import annotations

import hashlib
import math

from sidecar.limiter.algorithms import MICROSECONDS, Algorithm
from sidecar.limiter.counters import DIGEST_BYTES, encode_counter
from sidecar.limiter.protocol import Check, CounterKey
from sidecar.limiter.windows import window_start

EXPIRY_GRACE_SECONDS = 5
"""Keys outlive their window by this much, so a late flush still finds its key."""


def counter_digest(key: CounterKey) -> str:
    """Fixed-length hex digest naming a counter in Redis.

    Every backend names a counter this way, so replicas in sync and strict mode
    share counters. The window length is part of ``key`` (the rule's ``counter_id``
    carries it), so a rule whose unit changes on reload starts new counters.
    """
    return hashlib.blake2b(encode_counter(key), digest_size=DIGEST_BYTES).hexdigest()


def window_key(prefix: str, digest: str, start: int) -> str:
    """Name of one counter's window: ``prefix:{digest}:start``."""
    return f"{prefix}:{{{digest}}}:{start}"


def bucket_key(prefix: str, digest: str) -> str:
    """Name of one counter's token bucket (its TAT): ``prefix:{digest}:tat``; no window."""
    return f"{prefix}:{{{digest}}}:tat"


def ban_key(prefix: str, digest: str) -> str:
    """Name of one counter's ban: ``prefix:{digest}:ban``, holding the ban's end."""
    return f"{prefix}:{{{digest}}}:ban"


def sibling_ban_key(key: str) -> str:
    """The ban key of the counter that ``key`` (any key of :func:`check_window`) belongs to."""
    return key.rpartition(":")[0] + ":ban"


def previous_window(key: str, unit_seconds: int) -> tuple[str, int]:
    """``(key of the window before, start of this one)`` for a window key.

    Derived from the key rather than from a clock, so a caller passing one key per
    check (strict mode, sync mode's escalations) and the script agree on the window.
    """
    base, _, start = key.rpartition(":")
    begin = int(start)
    return f"{base}:{begin - unit_seconds}", begin


def counter_window(prefix: str, key: CounterKey, unit_seconds: int, now: float) -> tuple[str, int]:
    """The Redis key of ``key``'s fixed window at ``now`` and the time that key may expire."""
    start = window_start(now, unit_seconds)
    return window_key(prefix, counter_digest(key), start), expire_at(start, unit_seconds)


def check_window(prefix: str, check: Check, now: float) -> tuple[str, int]:
    """:func:`counter_window` for any algorithm: the key a check spends on, and its expiry.

    A sliding window's key is read by the next window, so it lives one window longer.
    A token bucket has one key; its expiry here is an upper bound (the bucket is full
    again once ``burst`` intervals have passed), used for hits owed to it: the script
    sets the real expiry from the TAT it writes.
    """
    if check.algorithm is Algorithm.TOKEN_BUCKET:
        refill = check.limit * check.interval_us / MICROSECONDS
        return bucket_key(prefix, counter_digest(check.key)), math.ceil(now + refill) + EXPIRY_GRACE_SECONDS
    key, expires = counter_window(prefix, check.key, check.unit_seconds, now)
    if check.algorithm is Algorithm.SLIDING_WINDOW:
        expires += check.unit_seconds
    return key, expires


def per_hit(check: Check) -> int:
    """What one hit adds to the check's key: 1 in a window, the interval (us) to a bucket's TAT.

    Hits owed to Redis, or given back, are ``INCRBY`` of ``hits * per_hit(check)``.
    """
    return check.interval_us if check.algorithm is Algorithm.TOKEN_BUCKET else 1


def expire_at(start: int, unit_seconds: int) -> int:
    """Unix time at which a fixed window's key may be deleted."""
    return start + unit_seconds + EXPIRY_GRACE_SECONDS


def replicas_key(prefix: str) -> str:
    """The sorted set of live replicas (member = replica id, score = last heartbeat)."""
    return f"{prefix}:replicas"
