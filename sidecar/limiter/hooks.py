"""Where an observer may wrap a Redis limiter's waits for Redis: the tracing hook, declared.

Both Redis backends hold a :class:`RedisWaits` in their ``redis_waits`` attribute,
``None`` unless tracing is on (:mod:`sidecar.tracing` sets it). A limiter hands it the
awaitable of each wait that matters to an operator: the one a request makes for Redis
(sync's escalation, strict's script call) and each flush of hits to Redis. So the
limiter code holds no tracing, pays one ``is None`` check when it is off, and renaming a
private method cannot silently turn a span off.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Protocol, TypeVar

T = TypeVar("T")


class RedisWaits(Protocol):
    """What an observer of a limiter's Redis waits provides."""

    def on_path(self, wait: Awaitable[T]) -> Awaitable[T]:
        """``wait``, a request's wait for Redis (it puts Redis on the request's path)."""
        ...

    def flush(self, keys: int, flush: Awaitable[T]) -> Awaitable[T]:
        """``flush``, one round trip carrying hits to Redis for ``keys`` keys."""
        ...
