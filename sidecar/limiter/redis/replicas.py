"""How many sidecars share the limits right now, from heartbeats in Redis.

The failure mode ``local`` enforces ``ceil(limit / live replicas)`` per replica and
sync mode sizes its reserves by the replica count, so every replica needs the count
without talking to the others: each one writes its heartbeat into one sorted set and
counts the members heard from within the last three intervals.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import socket
import time

import structlog

from sidecar.limiter.redis.availability import RedisUnavailable, stop_task
from sidecar.limiter.redis.clock import SharedClock
from sidecar.limiter.redis.store import RedisStore
from sidecar.limiter.windows import Clock

log = structlog.get_logger(__name__)

MISSED_BEATS = 3
"""A replica silent for this many intervals counts as dead."""


def new_replica_id() -> str:
    """Unique and recognisable: ``hostname:pid:random`` (pod name, process, restart)."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"


class Replicas:
    """Heartbeats this replica into Redis and keeps :attr:`live` up to date."""

    def __init__(
        self,
        store: RedisStore,
        interval: float = 1.0,
        *,
        replica_id: str | None = None,
        clock: Clock = time.time,
    ) -> None:
        self.store = store
        self.interval = interval
        self.ttl = MISSED_BEATS * interval
        self.replica_id = replica_id or new_replica_id()
        self.clock = clock
        self.live = 1
        """Live replicas, this one included; keeps the last known value while Redis is down."""
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Beat once now (so :attr:`live` is right from the first request), then every interval."""
        await self.beat()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="replica-heartbeat")

    async def beat(self) -> int:
        """One heartbeat (and, with a :class:`SharedClock`, one clock sample); returns
        :attr:`live`, unchanged if Redis is unavailable."""
        try:
            if isinstance(self.clock, SharedClock):  # first, so this beat's timestamp is corrected
                self.clock.observe(*await self.store.server_time(self.clock.local))
            live = await self.store.heartbeat(self.replica_id, self.clock(), self.ttl)
        except RedisUnavailable:
            return self.live
        self.observe(live)
        return self.live

    @property
    def alive_since(self) -> float:
        """Replicas that beat after this Unix time count as live."""
        return self.clock() - self.ttl

    def observe(self, live: int) -> None:
        """Take a live count read elsewhere (a sync flush reads it in the same round trip)."""
        live = max(1, live)
        if live != self.live:
            log.info("replicas_changed", live=live, previous=self.live, replica_id=self.replica_id)
            self.live = live

    async def close(self) -> None:
        """Stop beating and leave the set, so the others stop counting us at once."""
        if self._task is not None:
            await stop_task(self._task)
            self._task = None
        with contextlib.suppress(RedisUnavailable):
            await self.store.leave(self.replica_id)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            await self.beat()
