"""How many sidecars share the limits right now, from heartbeats in Redis.

The failure mode ``local`` enforces ``ceil(limit / live replicas)`` per replica and
sync mode sizes its reserves by the replica count, so every replica needs the count
without talking to the others: each one writes its heartbeat into one sorted set and
counts the members heard from within the last three intervals.

A Redis outage silences every replica at once, so the set says nothing about who is
alive right after it: a replica that returns first finds its peers' last beats older
than three intervals and would count itself alone (a share of the whole limit, no
blind cap) while they are still deciding by the failure mode. So a limiter that
follows outages (:meth:`Replicas.follow_outages`) keeps the count it had before the
outage until its peers have beaten since its return, or have had three intervals of
Redis to do so and are dead. That span is :attr:`Replicas.returning`, and a peer's beat
in it also says the peer's own outage hits are in Redis: a returning replica beats
only once its limiter has settled them (``settled``). See docs/redis.md, "Returning
from an outage".
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import socket
import time
from collections.abc import Callable

import structlog

from sidecar.limiter.redis.availability import RedisUnavailable, stop_task
from sidecar.limiter.redis.clock import SharedClock
from sidecar.limiter.redis.store import RedisStore
from sidecar.limiter.windows import Clock

log = structlog.get_logger(__name__)

MISSED_BEATS = 3
"""A replica silent for this many intervals counts as dead."""
RETURN_POLL = 0.05
"""Seconds between two looks for the peers' beats while returning from an outage (one
default ``--sync-interval``): the count and the end of :attr:`Replicas.returning` follow
a peer's return within about this long."""


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
        poll: float = RETURN_POLL,
    ) -> None:
        self.store = store
        self.interval = interval
        self.ttl = MISSED_BEATS * interval
        self.replica_id = replica_id or new_replica_id()
        self.clock = clock
        self.poll = poll
        self._observed = 1
        """The count Redis last answered (kept while Redis is down)."""
        self._held = 0
        """While returning: the count before the outage, which :attr:`live` does not go below."""
        self.returning = False
        """From an outage (Redis marked down) until every replica counted before it has beaten
        since this one returned, or could have for three intervals: a limiter that follows
        outages holds each replica to its share meanwhile (docs/redis.md)."""
        self._settled: Callable[[], bool] | None = None
        self._rejoined = True
        """False from an outage until this replica's first beat after it: no beat is sent
        before the limiter's outage hits are in Redis, since a beat tells peers they are."""
        self._return_task: asyncio.Task[None] | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def live(self) -> int:
        """Live replicas, this one included; while :attr:`returning`, never fewer than before the outage."""
        return max(self._observed, self._held)

    @live.setter
    def live(self, value: int) -> None:
        self._observed = max(1, value)

    def follow_outages(self, settled: Callable[[], bool]) -> None:
        """Hold the count through Redis outages and rejoin only once ``settled()`` says the
        limiter's outage hits are in Redis (call before the store starts)."""
        self._settled = settled
        self.store.add_listener(self._on_redis_state)

    async def start(self) -> None:
        """Beat once now (so :attr:`live` is right from the first request), then every interval."""
        await self.beat()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="replica-heartbeat")

    async def beat(self) -> int:
        """One heartbeat (and, with a :class:`SharedClock`, one clock sample); returns
        :attr:`live`, unchanged if Redis is unavailable or this replica has not rejoined
        after an outage yet."""
        if not self._rejoined:
            return self.live
        with contextlib.suppress(RedisUnavailable):
            await self._beat_now()
        return self.live

    async def _beat_now(self) -> float:
        """Beat (raises :class:`RedisUnavailable`); returns the beat's timestamp."""
        if isinstance(self.clock, SharedClock):  # first, so this beat's timestamp is corrected
            self.clock.observe(*await self.store.server_time(self.clock.local))
        now = self.clock()
        self.observe(await self.store.heartbeat(self.replica_id, now, self.ttl))
        return now

    @property
    def alive_since(self) -> float:
        """Replicas that beat after this Unix time count as live."""
        return self.clock() - self.ttl

    def observe(self, live: int) -> None:
        """Take a live count read elsewhere (a sync flush reads it in the same round trip)."""
        before = self.live
        self._observed = max(1, live)
        if self.live != before:
            log.info("replicas_changed", live=self.live, previous=before, replica_id=self.replica_id)

    # -- returning from an outage ------------------------------------------------------

    def _on_redis_state(self, available: bool, reason: str) -> None:
        if not available:
            if not self.returning:
                self.returning = True
                self._held = self.live
            self._rejoined = False
        elif self._return_task is None or self._return_task.done():
            self._return_task = asyncio.get_running_loop().create_task(self._return(), name="replica-return")

    async def _return(self) -> None:
        """Rejoin once settled, then wait for the peers counted before the outage to beat
        since (beating every :attr:`poll` meanwhile, so theirs see ours), or for three
        intervals to pass; a new outage ends this task (the next return starts another)."""
        try:
            while self._settled is not None and not self._settled():
                if not self.store.available:
                    return
                await asyncio.sleep(self.poll)
            since = await self._beat_now()
            self._rejoined = True
            log.info("replica_rejoined", live=self.live, expected=self._held, replica_id=self.replica_id)
            while self.store.available:
                beaten = await self._beaten_since(since)
                if beaten >= self._held or self.clock() - since >= self.ttl:
                    break
                await asyncio.sleep(self.poll)
                await self._beat_now()
            else:
                return
            await self._beat_now()  # after all we saw: peers still waiting for us see a beat since theirs
        except RedisUnavailable:
            return
        log.info("replicas_settled", live=self._observed, held=self._held, replica_id=self.replica_id)
        self.returning = False
        self._held = 0

    async def _beaten_since(self, since: float) -> int:
        """Replicas whose last beat is at or after ``since`` (this one included)."""
        (count,) = await self.store.run_scripts(
            [("ZCOUNT", self.store.replicas_key, since, "+inf")], self.store.background_timeout
        )
        if isinstance(count, BaseException):
            raise RedisUnavailable(str(count))
        return int(count)

    async def close(self) -> None:
        """Stop beating and leave the set, so the others stop counting us at once."""
        for task in (self._task, self._return_task):
            if task is not None:
                await stop_task(task)
        self._task = self._return_task = None
        with contextlib.suppress(RedisUnavailable):
            await self.store.leave(self.replica_id)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            await self.beat()
