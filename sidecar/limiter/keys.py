"""Redis key names for counters: collision-free, bounded, Cluster-slot aware.

A counter key is a tuple of arbitrary strings (rule identity plus request values
that may hold ``_``, ``:``, ``{``, ``}``, newlines or any UTF-8). Joining them with
a separator would let two descriptors collide, and putting them in a key verbatim
would make keys unbounded and let ``{`` break Redis Cluster hash tags. So the tuple
is length-prefix encoded and hashed (BLAKE2b, 128 bits): keys have a fixed length,
never carry request data, and every key of one counter shares the hash tag
``{digest}``, so all of them (window counters, bans) live in one Cluster slot.
"""

from __future__ import annotations

import hashlib

from sidecar.limiter.protocol import CounterKey
from sidecar.limiter.windows import window_start

DIGEST_BYTES = 16
EXPIRY_GRACE_SECONDS = 5
"""Keys outlive their window by this much, so a late flush still finds its key."""


def encode_counter(key: CounterKey) -> bytes:
    """Injective byte encoding of a tuple of strings: each part as ``len:bytes``."""
    parts: list[bytes] = []
    for part in key:
        data = part.encode("utf-8", "surrogatepass")
        parts.append(b"%d:" % len(data))
        parts.append(data)
    return b"".join(parts)


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


def counter_window(prefix: str, key: CounterKey, unit_seconds: int, now: float) -> tuple[str, int]:
    """The Redis key of ``key``'s window at ``now`` and the time that key may expire."""
    start = window_start(now, unit_seconds)
    return window_key(prefix, counter_digest(key), start), expire_at(start, unit_seconds)


def expire_at(start: int, unit_seconds: int) -> int:
    """Unix time at which a window's key may be deleted."""
    return start + unit_seconds + EXPIRY_GRACE_SECONDS


def replicas_key(prefix: str) -> str:
    """The sorted set of live replicas (member = replica id, score = last heartbeat)."""
    return f"{prefix}:replicas"
