"""``share.lua`` calls over Redis: keys, arguments, one pipeline per batch, what a reply means.

A batch either runs (each call answered, or **refused** on its own) or does not
(:class:`SharesUnavailable`: Redis down, slow, or refusing every call). The difference
matters: a call the script refuses (a key of the wrong type, say) would be refused again
with the same arguments, so the caller drops it (:class:`CallRefused`) instead of treating
Redis as away and retrying it forever, which would keep that replica from sharing at all.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from typing import TYPE_CHECKING, Any, Protocol

from sidecar.limiter.redis.scripts import Script
from sidecar.quota.buckets import BucketKey
from sidecar.quota.shares import Call, Reply, clamped

if TYPE_CHECKING:
    from sidecar.limiter.redis.replicas import Replicas
    from sidecar.limiter.redis.store import RedisStore


def load_share_script() -> Script:
    source = resources.files("sidecar.quota").joinpath("lua", "share.lua").read_text(encoding="utf-8")
    return Script("share.lua", source, hashlib.sha1(source.encode("utf-8"), usedforsecurity=False).hexdigest())


SHARE = load_share_script()


def bucket_digest(key: BucketKey) -> str:
    """A fixed-length name for a bucket id (length-prefixed items, BLAKE2b 128 bits)."""
    digest = hashlib.blake2b(digest_size=16)
    for name, value in key:
        for part in (name, value):
            data = part.encode("utf-8")
            digest.update(len(data).to_bytes(4, "big") + data)
    return digest.hexdigest()


def bucket_tag(prefix: str, key: BucketKey) -> str:
    """The common part of a bucket's keys, with its hash tag (computed once per bucket)."""
    return f"{prefix}:quota:{{{bucket_digest(key)}}}"


def keys_of(tag: str, window: int) -> list[str]:
    """``KEYS`` of ``share.lua``: the replicas hash, the meta hash, the window counter."""
    meta = f"{tag}:meta"
    return [f"{tag}:replicas", meta, f"{tag}:used:{window}" if window >= 0 else meta]


def share_keys(prefix: str, key: BucketKey, window: int) -> list[str]:
    """``KEYS`` of ``share.lua`` for a bucket id. All carry the bucket's hash tag, so one
    bucket's keys live in one Cluster slot."""
    return keys_of(bucket_tag(prefix, key), window)


def share_arguments(call: Call, now_ms: int = 0) -> list[int | str]:
    call = clamped(call)
    keep_ms = 2 * max(call.lease_ms + call.hold_ms, call.stale_ms, call.master_ms)
    return [
        call.replica, now_ms, call.demand, call.limit, call.lease_ms, call.stale_ms, call.master_ms,
        call.threshold_pct, call.min_gap_ms, call.window, call.used_add, keep_ms, keep_ms, call.master_gap_ms,
        call.hold_ms,
    ]  # fmt: skip


@dataclass(frozen=True, slots=True)
class CallRefused:
    """Redis ran this call's script and it failed: the same call would fail again."""

    reason: str


class SharesUnavailable(Exception):  # noqa: N818 - a state, as RedisUnavailable
    """The share calls could not run (Redis down, slow or refusing)."""


class ShareBackend(Protocol):
    """Runs ``share.lua`` calls: Redis (:class:`RedisShares`) or a simulation's fake."""

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def run(self, calls: Sequence[tuple[list[str], Call]]) -> Sequence[Reply | CallRefused]: ...


class RedisShares:
    """``share.lua`` over a :class:`~sidecar.limiter.redis.store.RedisStore`: one pipeline per batch."""

    def __init__(self, store: RedisStore, replicas: Replicas | None = None) -> None:
        self.store = store
        self.replicas = replicas
        """Heartbeats of the quota replicas: the live count for the safe capacity."""
        self.round_trips = 0

    async def start(self) -> None:
        await self.store.start()
        if self.replicas is not None:
            await self.replicas.start()

    async def close(self) -> None:
        if self.replicas is not None:
            await self.replicas.close()
        await self.store.close()

    async def run(self, calls: Sequence[tuple[list[str], Call]]) -> list[Reply | CallRefused]:
        from sidecar.limiter.redis.availability import FAILURES, RedisUnavailable  # noqa: PLC0415 - lazy

        store = self.store
        try:
            store.availability.ensure_available()
        except RedisUnavailable as error:
            raise SharesUnavailable(str(error)) from None
        try:
            replies = await self._pipeline(calls, with_body=False)
            missing = [index for index, reply in enumerate(replies) if _noscript(reply)]
            if missing:
                again = await self._pipeline([calls[index] for index in missing], with_body=True)
                for index, reply in zip(missing, again, strict=True):
                    replies[index] = reply
        except FAILURES as error:
            raise SharesUnavailable(str(store.availability.failed(error, request_path=False))) from error
        failure = next((reply for reply in replies if _redis_away(reply)), None)
        if failure is not None:
            raise SharesUnavailable(str(store.availability.failed(failure, request_path=False)))
        store.availability.answered()
        return [
            CallRefused(str(reply)[:200]) if isinstance(reply, BaseException) else _reply(reply) for reply in replies
        ]

    async def _pipeline(self, calls: Sequence[tuple[list[str], Call]], with_body: bool) -> list[Any]:
        pipe = self.store.client.pipeline(transaction=False)
        for keys, call in calls:
            args = share_arguments(call)
            if with_body:
                pipe.execute_command("EVAL", SHARE.source, len(keys), *keys, *args)
            else:
                # execute_command: redis-py blocks pipe.evalsha on Cluster pipelines.
                pipe.execute_command("EVALSHA", SHARE.sha, len(keys), *keys, *args)
        self.round_trips += 1
        async with asyncio.timeout(self.store.background_timeout):
            replies: list[Any] = await pipe.execute(raise_on_error=False)
        return replies


def _noscript(reply: object) -> bool:
    from redis.exceptions import NoScriptError  # noqa: PLC0415 - lazy

    return isinstance(reply, NoScriptError)


def _redis_away(reply: object) -> bool:
    """An error reply that says Redis as a whole cannot run calls now (loading, busy with
    another script, out of memory, a read-only replica, a moved slot): not this call's fault.
    Any other error reply is the script refusing this call."""
    from redis.exceptions import (  # noqa: PLC0415 - lazy
        BusyLoadingError,
        ClusterError,
        OutOfMemoryError,
        ReadOnlyError,
        ResponseError,
    )

    if not isinstance(reply, BaseException):
        return False
    if isinstance(reply, BusyLoadingError | OutOfMemoryError | ReadOnlyError | ClusterError):
        return True
    if not isinstance(reply, ResponseError):
        return True
    text = str(reply)
    return text.startswith(("BUSY", "MASTERDOWN", "TRYAGAIN", "CLUSTERDOWN", "MOVED", "ASK", "NOSCRIPT"))


def _reply(values: Sequence[Any]) -> Reply:
    grant, replicas, unsettled, master, computed, capacity, others, silent = (int(value) for value in values)
    return Reply(grant, replicas, bool(unsettled), bool(master), bool(computed), capacity, others, silent)
