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
only once its limiter has settled them (``settled``). In Cluster, one master's outage is
followed the same way for its slots (:meth:`Replicas.holds`): there the heartbeats may go
on throughout, so a replica says it has settled with a separate mark, written with its
beats while it owes nothing from an outage and knows no master down. See docs/redis.md,
"Returning from an outage".
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import secrets
import socket
import time
from collections.abc import Callable, Iterable

import structlog
from redis.crc import key_slot

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
        self.shard_slots: frozenset[int] = frozenset()
        """Cluster: slots of masters back from an outage, held like a whole return (:meth:`holds`)."""
        self._shards = False
        """Following each Cluster master's outage (:meth:`follow_outages`): beats carry settled marks."""
        self._shard_since = 0.0
        self._shard_floor = 0
        """The count when a master went down (the heartbeats may live on it)."""
        self._shard_held = 1
        """While :attr:`shard_slots`: the count before the outage, which :attr:`live` does not go below."""
        self._shard_task: asyncio.Task[None] | None = None

    @property
    def live(self) -> int:
        """Live replicas, this one included; while :attr:`returning` (or a master's slots are,
        :meth:`holds`), never fewer than before the outage."""
        return max(self._observed, self._held, self._shard_held if self.shard_slots else 0)

    @live.setter
    def live(self, value: int) -> None:
        self._observed = max(1, value)

    def follow_outages(self, settled: Callable[[], bool], *, shards: bool = False) -> None:
        """Hold the count through Redis outages and rejoin only once ``settled()`` says the
        limiter's outage hits are in Redis (call before the store starts). ``shards``: in
        Cluster, follow each master's outage too (:meth:`holds`)."""
        self._settled = settled
        self.store.add_listener(self._on_redis_state)
        nodes = getattr(self.store, "nodes", None)
        if shards and nodes is not None:
            self._shards = True
            nodes.add_shard_listener(self._on_shard)

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
        if self._shards and self._clean():  # a peer back from a master's outage waits for it
            with contextlib.suppress(RedisUnavailable):
                await self._mark()  # after the beat: a peer that sees it counts us
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

    # -- one Cluster master returning -------------------------------------------------

    def holds(self, keys: Iterable[str]) -> bool:
        """Whether a decision on ``keys`` is held to this replica's share: one of them lives on
        a master back from an outage whose hits may not all be in Redis yet (docs/redis.md,
        "Returning from an outage"). One CRC16 per key, only while some master is returning."""
        slots = self.shard_slots
        return bool(slots) and any(key_slot(key.encode()) in slots for key in keys)

    def _on_shard(self, up: bool, slots: frozenset[int]) -> None:
        """A master's slots are served again: hold them until every replica has settled."""
        if not up:
            self._shard_floor = max(self._shard_floor, self.live)
            return
        self._shard_held = max(self._shard_held, self._shard_floor, self.live)
        self.shard_slots |= slots
        self._shard_since = self.clock()
        if self._shard_task is None or self._shard_task.done():
            self._shard_task = asyncio.get_running_loop().create_task(self._shard_return(), name="replica-shard-return")

    @property
    def settled_key(self) -> str:
        """Sorted set of the replicas' settled marks: written with a beat while the replica's
        limiter owes nothing from an outage and knows no master down."""
        return f"{self.store.replicas_key}:settled"

    def _clean(self) -> bool:
        nodes = getattr(self.store, "nodes", None)
        return (self._settled is None or self._settled()) and not (nodes is not None and nodes.down())

    async def _mark(self) -> float:
        """This replica's settled mark (raises :class:`RedisUnavailable`); returns its time."""
        now = self.clock()
        key = self.settled_key
        keep = 10 * self.ttl
        replies = await self.store.run_scripts(
            [("ZADD", key, now, self.replica_id), ("ZREMRANGEBYSCORE", key, "-inf", now - keep),
             ("EXPIRE", key, math.ceil(keep))],
            self.store.background_timeout,
        )  # fmt: skip
        for reply in replies:
            if isinstance(reply, BaseException):
                raise RedisUnavailable(str(reply))
        return now

    async def _shard_return(self) -> None:
        """Until every replica counted has marked itself settled since the latest return (or
        three intervals have passed: a replica that has not is dead, or as if): this one marks
        itself once settled, and looks every :attr:`poll`; then the slots are free."""
        while True:
            since = self._shard_since
            with contextlib.suppress(RedisUnavailable):
                if self._clean():
                    await self._beat_now()  # a mark comes with a beat: a peer that sees it counts us
                    await self._mark()
                    others = await self._marked_since(since)
                    done = others + 1 >= self._shard_held or self.clock() - since >= self.ttl
                    if done and since == self._shard_since:  # and no other master returned meanwhile
                        await self._beat_now()  # the count, from beats since the peers' marks
                        log.info("shard_return_settled", slots=len(self.shard_slots), replica_id=self.replica_id)
                        self.shard_slots = frozenset()
                        self._shard_held, self._shard_floor = 1, 0
                        return
            await asyncio.sleep(self.poll)

    async def _marked_since(self, since: float) -> int:
        """Other replicas whose settled mark is at or after ``since``."""
        (members,) = await self.store.run_scripts(
            [("ZRANGEBYSCORE", self.settled_key, since, "+inf")], self.store.background_timeout
        )
        if isinstance(members, BaseException):
            raise RedisUnavailable(str(members))
        mine = self.replica_id.encode()
        return sum(1 for member in members if (member if isinstance(member, bytes) else str(member).encode()) != mine)

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
        for task in (self._task, self._return_task, self._shard_task):
            if task is not None:
                await stop_task(task)
        self._task = self._return_task = self._shard_task = None
        with contextlib.suppress(RedisUnavailable):
            await self.store.leave(self.replica_id)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            await self.beat()
