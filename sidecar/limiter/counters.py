"""A counter's identity: the rule plus the request's values, bounded in size.

Every backend keys its counters by this tuple (memory in a dict, Redis through
:mod:`sidecar.limiter.redis.keys`, which hashes it into a key name), so it lives with
the backend-neutral vocabulary, not with the Redis plumbing.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Sequence

from sidecar.limiter.protocol import CounterKey

DIGEST_BYTES = 16
MAX_INLINE_CHARS = 128
"""Request values longer than this in total are held as their digest (see :func:`counter_key`)."""
HASHED_MARK = "\0hashed"
"""Ends the rule id of a counter whose values are hashed. No plain rule id ends so:
config ids are JSON (a NUL is escaped there) and request-override ids end in digits."""


def counter_key(rule_id: str, values: Sequence[str]) -> CounterKey:
    """The identity of a counter: ``(rule_id, *values)``, with long values hashed.

    Every backend keeps this tuple in memory per live counter, and ``--max-counters``
    bounds memory only if a counter is bounded in size: a key-only rule would otherwise
    hold 4096 characters per value, a request override 32 entries of them (130 kB per
    counter). Past :data:`MAX_INLINE_CHARS` the values become their BLAKE2b digest
    under the rule id plus :data:`HASHED_MARK`, so hashed and plain keys never meet
    and distinct values stay distinct counters.
    """
    if sum(map(len, values)) <= MAX_INLINE_CHARS:
        return (rule_id, *values)
    return hashed_counter_key(rule_id, values)


def hashed_counter_key(rule_id: str, values: Sequence[str]) -> CounterKey:
    """:func:`counter_key` for values known to be long: a fixed-size key."""
    digest = hashlib.blake2b(encode_counter(tuple(values)), digest_size=DIGEST_BYTES).hexdigest()
    return (sys.intern(rule_id + HASHED_MARK), digest)


def encode_counter(key: CounterKey) -> bytes:
    """Injective byte encoding of a tuple of strings: each part as ``len:bytes``."""
    parts: list[bytes] = []
    for part in key:
        data = part.encode("utf-8", "surrogatepass")
        parts.append(b"%d:" % len(data))
        parts.append(data)
    return b"".join(parts)
