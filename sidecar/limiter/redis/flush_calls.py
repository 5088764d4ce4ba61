"""The calls a flush sends (:meth:`~sidecar.limiter.redis.store.RedisStore.flush`) and how its
replies read: one ``flush_batch.lua`` call on plain Redis, one call (or two commands) per
key in Cluster, where keys live on several masters."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from redis.exceptions import ResponseError

from sidecar.limiter.redis.availability import RedisUnavailable
from sidecar.limiter.redis.pipeline import Command, ScriptCall
from sidecar.limiter.redis.scripts import FLUSH_BATCH, FLUSH_ONCE

Adds = Mapping[str, tuple[int, int]]
"""Hits to add: ``{window_key: (hits, expire_at)}`` (the store's ``Pending``)."""


class PartialFlush(RedisUnavailable):
    """Some keys of a flush failed (in Cluster, a master is down), the others landed.

    The flush failed as a whole for callers that resend it whole (idempotent with
    ``once``: the landed keys add nothing again); a caller may instead settle
    :attr:`totals` (the keys that landed, as :meth:`RedisStore.flush` returns them) and
    keep only :attr:`failed` for later, so counters on healthy masters do not wait for
    the dead one.
    """

    def __init__(self, message: str, totals: dict[str, int], failed: list[str]) -> None:
        super().__init__(message)
        self.totals = totals
        self.failed = failed


def flush_calls(
    calls: list[ScriptCall | Command],
    adds: Adds,
    reads: Sequence[str],
    once: tuple[str, int] | None,
    *,
    prefix: str,
    cluster: bool,
) -> bool:
    """Append a flush's adds and reads; True when they go as one ``flush_batch.lua`` call."""
    if once is None or cluster:
        calls += add_calls(adds, once)
        calls += [("GET", key) for key in reads]
        return False
    owner, sequence = once
    args: list[int | str] = [sequence, len(adds)]
    for hits, expire_at in adds.values():
        args += (hits, expire_at)
    calls.append(ScriptCall(FLUSH_BATCH, [f"{prefix}:flushed:{owner}", *adds, *reads], args))
    return True


def batch_replies(replies: list[Any], keys: int) -> list[Any]:
    """``flush_batch.lua``'s one reply as one reply per key, as the per-key calls give them.

    A nil marks a key that holds no counter: a ResponseError, so its hits are
    counted as refused (an add) or it is left out (a read).
    """
    (reply,) = replies
    if isinstance(reply, BaseException):
        return [reply] * keys
    refused = ResponseError("not a counter")
    return [refused if value is None else value for value in reply]


def add_calls(adds: Adds, once: tuple[str, int] | None) -> list[ScriptCall | Command]:
    """INCRBY + EXPIREAT per key, or one idempotent ``flush_once.lua`` call per key."""
    if once is None:
        return [call for key, (hits, at) in adds.items() for call in (("INCRBY", key, hits), ("EXPIREAT", key, at))]
    owner, sequence = once
    return [
        ScriptCall(FLUSH_ONCE, [key, f"{key}:flushed:{owner}"], [sequence, hits, expire_at])
        for key, (hits, expire_at) in adds.items()
    ]
