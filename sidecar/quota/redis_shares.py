"""``share.lua`` calls over Redis: keys, arguments, one pipeline per batch, what a reply means.

A batch either runs (each call answered, or **refused** on its own) or does not
(:class:`SharesUnavailable`: Redis down, slow, or refusing every call). The difference
matters: a call the script refuses (a key of the wrong type, say) would be refused again
with the same arguments, so the caller drops it (:class:`CallRefused`) instead of treating
Redis as away and retrying it forever, which would keep that replica from sharing at all.
"""

from __future__ import annotations

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
    """``share.lua`` over a :class:`~sidecar.limiter.redis.store.RedisStore`: one pipeline per
    batch, through :meth:`~sidecar.limiter.redis.store.RedisStore.run_scripts`, which resends
    calls that met ``NOSCRIPT`` and tells a reply about Redis as a whole from one about a call.
    Packed by hand (``packed=True``, :mod:`sidecar.limiter.redis.packed`): a pipeline's replies
    are read and applied in one loop turn, which redis-py's ``Pipeline`` made 3-4 times longer."""

    def __init__(self, store: RedisStore, replicas: Replicas | None = None) -> None:
        self.store = store
        self.replicas = replicas
        """Heartbeats of the quota replicas: the live count for the safe capacity."""

    async def start(self) -> None:
        """Connect, then beat. The heartbeats follow Redis outages as the limiters' do
        (:meth:`Replicas.follow_outages`): a replica back first keeps the count from before
        the outage until its peers have beaten again, instead of counting itself alone (a
        whole limit's capacity) for up to an interval. Quota owes Redis nothing from an
        outage (its grants are leases), so it is settled at once."""
        if self.replicas is not None:
            self.replicas.follow_outages(lambda: True)
        await self.store.start()
        if self.replicas is not None:
            await self.replicas.start()

    async def close(self) -> None:
        if self.replicas is not None:
            await self.replicas.close()
        await self.store.close()

    async def run(self, calls: Sequence[tuple[list[str], Call]]) -> list[Reply | CallRefused]:
        """Each call's reply, or :class:`CallRefused`; :class:`SharesUnavailable` when the batch
        did not run (Redis down, slow, or answering for itself rather than for the calls)."""
        from sidecar.limiter.redis.availability import RedisUnavailable  # noqa: PLC0415 - lazy
        from sidecar.limiter.redis.pipeline import ScriptCall  # noqa: PLC0415

        store = self.store
        script_calls = [ScriptCall(SHARE, keys, share_arguments(call)) for keys, call in calls]
        try:
            replies = await store.run_scripts(script_calls, store.background_timeout, away_raises=True, packed=True)
        except RedisUnavailable as error:
            raise SharesUnavailable(str(error)) from error
        return [
            CallRefused(str(reply)[:200]) if isinstance(reply, BaseException) else _reply(reply) for reply in replies
        ]


def _reply(values: Sequence[Any]) -> Reply:
    grant, replicas, unsettled, master, computed, capacity, others, silent = values
    return Reply(
        int(grant),
        int(replicas),
        bool(int(unsettled)),
        bool(int(master)),
        bool(int(computed)),
        int(capacity),
        int(others),
        int(silent),
    )
