"""Redis access for the limiter backends: few round trips, one failure type, reconnection.

Every public call is one network round trip (a script or a pipeline) so its cost is
predictable and countable: the accuracy harness reports ``round_trips_*`` per request.
Every script call (decisions, flushes, quota shares) goes through one method,
:meth:`RedisStore.run_scripts`: one pipeline, ``NOSCRIPT`` resent once, one failure type.
Every failure surfaces as :class:`~sidecar.limiter.redis.availability.RedisUnavailable`,
and while Redis is known to be down calls fail at once
(:mod:`sidecar.limiter.redis.availability`; in Cluster, per master:
:mod:`sidecar.limiter.redis.cluster_health`); the client comes from
:func:`sidecar.limiter.redis.connect.connect`.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot
from redis.exceptions import NoScriptError, RedisError, ResponseError

from sidecar.limiter.budget import DEFAULT_REDIS_TIMEOUT
from sidecar.limiter.protocol import Check, decide
from sidecar.limiter.redis.availability import FAILURES, Availability, RedisUnavailable, StateListener
from sidecar.limiter.redis.cluster_health import ClusterNodes
from sidecar.limiter.redis.connect import MIN_BACKGROUND_TIMEOUT, background_timeout, connect, secrets_of
from sidecar.limiter.redis.corrupt import CorruptKeys, key_of_reply, problem_with
from sidecar.limiter.redis.counts import Counts, counts_of, verdict
from sidecar.limiter.redis.flush_calls import PartialFlush, add_calls, batch_replies, flush_calls
from sidecar.limiter.redis.keys import per_hit, replicas_key
from sidecar.limiter.redis.packed import packable, run_packed
from sidecar.limiter.redis.pipeline import Command, ScriptCall, commands_of, queue_calls, redis_away
from sidecar.limiter.redis.scripts import DECIDE, SCRIPTS, decide_arguments
from sidecar.limiter.windows import Clock
from sidecar.metrics import LimiterSnapshot

__all__ = ["CorruptKey", "Counts", "DecideRequest", "Pending", "RedisStore", "counts_of", "same_slot", "verdict"]
"""``Counts``, ``counts_of`` and ``verdict`` live in :mod:`.counts`; their callers import them from here."""

Pending = Mapping[str, tuple[int, int]]
"""Hits to add unconditionally: ``{window_key: (hits, expire_at)}``."""


class CorruptKey(RedisUnavailable):
    """A key this call needed holds something that is not a counter; the failure mode
    decides the request, Redis stays available (see :mod:`sidecar.limiter.redis.corrupt`)."""


DecideRequest = tuple[Sequence[str], Sequence[Check], Sequence[int]]
"""One request for :meth:`RedisStore.decide_batch`: window keys, checks, expiry times."""
Answer = Callable[[int, "list[int] | RedisUnavailable"], None]
"""Told ``(index, answer)`` of each request of a batch as soon as that answer is known."""


def same_slot(keys: Sequence[str]) -> bool:
    """Whether every key maps to one Cluster slot (so one script may touch them all)."""
    first = key_slot(keys[0].encode())
    return all(key_slot(key.encode()) == first for key in keys[1:])


class RedisStore:
    """Counters, scripts and replica heartbeats in Redis or Redis Cluster."""

    def __init__(
        self,
        client: Redis | RedisCluster,
        *,
        prefix: str = "rls",
        redis_timeout: float = DEFAULT_REDIS_TIMEOUT,
        background_timeout: float = MIN_BACKGROUND_TIMEOUT,
        secrets: tuple[str, ...] = (),
    ) -> None:
        self.client = client
        self.prefix = prefix
        self.replicas_key = replicas_key(prefix)
        """The sorted set of live replicas (heartbeats)."""
        self.redis_timeout = redis_timeout
        self.background_timeout = background_timeout
        self.cluster = isinstance(client, RedisCluster)
        self.availability = Availability(self._probe_once, redis_timeout, secrets)
        """Up/down state and the probe back; its listeners hear of every change. In
        Cluster mode the Cluster as a whole: down only when every master is."""
        self.nodes = (
            ClusterNodes(client, self.availability, redis_timeout, background_timeout, secrets)
            if isinstance(client, RedisCluster)
            else None
        )
        """Availability per Cluster master (:mod:`~sidecar.limiter.redis.cluster_health`)."""
        self.round_trips_request_path = 0
        self.round_trips_background = 0
        self.give_back_failures = 0
        self.corrupt = CorruptKeys()
        """Keys found holding something that is not a counter: logged, counted, avoided."""
        self._tasks: set[asyncio.Task[None]] = set()

    @classmethod
    def for_url(
        cls, url: str, *, cluster: bool = False, prefix: str = "rls", redis_timeout: float = DEFAULT_REDIS_TIMEOUT
    ) -> RedisStore:
        """A store for ``url`` (any scheme :func:`~sidecar.limiter.redis.connect.connect` takes);
        connects lazily (call :meth:`start`)."""
        return cls(
            connect(url, cluster, redis_timeout),
            prefix=prefix,
            redis_timeout=redis_timeout,
            background_timeout=background_timeout(redis_timeout),
            secrets=secrets_of(url),
        )

    @property
    def refused_hits(self) -> int:
        """Hits :meth:`flush` could not add because their key does not hold a counter."""
        return self.corrupt.refused_hits

    def _failed(self, error: BaseException, request_path: bool) -> RedisUnavailable:
        """The exception a failed call raises: :class:`CorruptKey` (noted) when a script
        found a key holding no counter, else what :class:`Availability` makes of it."""
        if type(error) is ResponseError:
            corrupt = key_of_reply(str(error))
            if corrupt is not None:
                self.corrupt.found(*corrupt)
                return CorruptKey(f"redis refused the call: key {corrupt[0]} {corrupt[1]}")
        if self.nodes is not None:  # in Cluster, the master's state was kept by ClusterNodes.run
            return self.availability.failed(self.nodes.call_only(error), request_path)
        return self.availability.failed(error, request_path)

    # -- life cycle -----------------------------------------------------------------

    @property
    def available(self) -> bool:
        """Whether Redis is taking calls (False from the first outage until a probe succeeds)."""
        return self.availability.available

    @property
    def last_error(self) -> str:
        """Why Redis was last found unavailable."""
        return self.availability.last_error

    def unavailable_for(self, keys: Sequence[str]) -> str | None:
        """Why a call on ``keys`` would fail at once, or None: Redis known down, or in Cluster,
        a master owning one of them (a caller about to wait for something to land on those
        keys, such as hits owed to them, can give up at once instead)."""
        if not self.available:
            return self.last_error
        return self.nodes.down_for(keys) if self.nodes is not None else None

    def add_listener(self, listener: StateListener) -> None:
        """Be told ``(available, reason)`` on every change of state."""
        self.availability.add_listener(listener)

    async def start(self) -> None:
        """Connect and load the scripts; if Redis is down, start probing and return anyway.

        A sidecar whose Redis is down at boot still serves (in its failure mode)
        rather than crash-looping, and switches to Redis when the probe succeeds.
        """
        await self.availability.start()

    async def probe(self) -> bool:
        """Try Redis once, now, instead of waiting for the backoff; returns :attr:`available`.

        For shutdown: hits still owed to Redis should not be lost to a backoff sleep.
        """
        return await self.availability.probe()

    async def wait_available(self) -> None:
        """Return once Redis is available (at once if it already is)."""
        await self.availability.wait_available()

    def note_redis_timeout(self) -> None:
        """A caller stopped waiting for a call still on the wire (its budget ran out).

        Counts as a request-path timeout of :meth:`decide` does: once Redis has been
        silent well beyond any budget while our loop was responsive, it is marked
        unavailable, so later requests stop waiting on it. In Cluster mode, each master
        by its own silence: the silent one is marked down, not the Cluster.
        """
        if self.nodes is not None:
            self.nodes.note_timeout()
            return
        self.availability.failed(TimeoutError("no answer within the request budget"), request_path=True)

    async def close(self) -> None:
        """Stop probing, let give-backs finish, close the connections."""
        await self.availability.close()
        if self.nodes is not None:
            await self.nodes.close()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=self.background_timeout)
        await self.client.aclose()

    # -- the calls ------------------------------------------------------------------

    async def decide(
        self,
        keys: Sequence[str],
        checks: Sequence[Check],
        expire_ats: Sequence[int],
        admit_all: bool,
        pending: Pending | None = None,
        *,
        request_path: bool = True,
        now_us: int = 0,
    ) -> tuple[bool, list[int], dict[str, int]]:
        """Add ``pending``, then decide ``checks`` all-or-nothing and record them if admitted.

        Returns ``(admitted, counts, totals)``: each check's would-be count (see
        ``lua/decide.lua``; repeated counters see earlier checks) and each pending key's
        value afterwards (including hits this request consumed). ``keys`` holds one key
        per check (:func:`~sidecar.limiter.redis.keys.check_window`); ``now_us`` is the
        script's clock, 0 for Redis ``TIME``. One round trip. In Cluster mode, keys
        spread over several slots cannot share a script; see :meth:`_decide_per_check`
        for what that costs in atomicity.
        """
        pending = pending or {}
        self.availability.ensure_available()
        if not keys and not pending:
            return True, [], {}
        timeout = self.redis_timeout if request_path else self.background_timeout
        spread = self.cluster and not same_slot([*keys, *pending])
        decide_one = self._decide_per_check if spread else self._decide_script
        return await decide_one(
            keys, checks, expire_ats, admit_all, pending, now_us=now_us, request_path=request_path, timeout=timeout
        )

    async def decide_batch(
        self,
        requests: Sequence[DecideRequest],
        admit_all: bool,
        nows: Sequence[int] | None = None,
        adds: Sequence[Pending] | None = None,
        *,
        on_answer: Answer | None = None,
    ) -> list[list[int] | RedisUnavailable]:
        """Several requests' decisions in one round trip; each is atomic on its own.

        Returns each request's would-be counts (see :meth:`decide`), or the
        :class:`RedisUnavailable` that request alone met (a key holding something that
        is not a counter fails its own script, not the others, which did run). A
        failure of the whole round trip raises. ``nows`` gives each request's script
        clock in microseconds (default: Redis ``TIME`` for all). Callers that
        coalesce the script calls of one event-loop iteration use this, and enforce
        their own request budget around it: the call itself may take up to the
        background timeout, so a late answer still tells the caller what Redis did.
        ``adds``: per request, hits its script adds first, whatever it decides (strict
        mode's attempted hits of ``overload: suppress``); their totals come back in
        :attr:`Counts.totals`.
        In Cluster mode the requests go out concurrently, one script (or one per check
        when they span slots) each, under that same background timeout (a call cut off at
        the budget may still run, and nobody would hear of it); one on a master known down
        fails alone (:mod:`.cluster_health`). ``on_answer`` hears ``(index, answer)`` of
        each request as soon as it is known: in Cluster when its own script returns, so a
        slow master does not hold the others' answers past their deadline (issue 31).
        """
        self.availability.ensure_available()
        clocks = list(nows) if nows is not None else [0] * len(requests)
        extra: Sequence[Pending] = adds if adds is not None else [{}] * len(requests)
        if self.cluster:
            return await asyncio.gather(
                *(
                    self._one_of_cluster_batch(
                        index, request, admit_all=admit_all, now_us=now_us, pending=pending, on_answer=on_answer
                    )
                    for index, (request, now_us, pending) in enumerate(zip(requests, clocks, extra, strict=True))
                )
            )
        calls = [
            ScriptCall(DECIDE, *decide_arguments(keys, checks, expiries, admit_all, pending, now_us=now_us))
            for (keys, checks, expiries), now_us, pending in zip(requests, clocks, extra, strict=True)
        ]
        replies = await self.run_scripts(calls, self.background_timeout, request_path=True)
        results: list[list[int] | RedisUnavailable] = [
            self._failed(reply, request_path=True)
            if isinstance(reply, Exception)
            else counts_of(reply, len(checks), len(pending), list(pending))
            for reply, (_, checks, _), pending in zip(replies, requests, extra, strict=True)
        ]
        if on_answer is not None:
            for index, result in enumerate(results):
                on_answer(index, result)
        return results

    async def _one_of_cluster_batch(
        self,
        index: int,
        request: DecideRequest,
        *,
        admit_all: bool,
        now_us: int,
        pending: Pending,
        on_answer: Answer | None,
    ) -> list[int] | RedisUnavailable:
        """One request of a Cluster batch, told to ``on_answer`` the moment it is known."""
        keys, checks, expire_ats = request
        answer: list[int] | RedisUnavailable
        try:
            answer = await self._decide_in_cluster(keys, checks, expire_ats, admit_all, now_us, pending=pending)
        except RedisUnavailable as error:
            answer = error
        if on_answer is not None:
            on_answer(index, answer)
        return answer

    async def _decide_in_cluster(
        self,
        keys: Sequence[str],
        checks: Sequence[Check],
        expire_ats: Sequence[int],
        admit_all: bool,
        now_us: int,
        *,
        pending: Pending | None = None,
    ) -> list[int]:
        """One request of a Cluster batch: a request-path call under the background timeout."""
        if not keys:
            return []
        pending = pending or {}
        decide_one = self._decide_script if same_slot([*keys, *pending]) else self._decide_per_check
        _, counts, totals = await decide_one(
            keys,
            checks,
            expire_ats,
            admit_all,
            pending,
            now_us=now_us,
            request_path=True,
            timeout=self.background_timeout,
        )
        if pending:
            counts = Counts(counts) if not isinstance(counts, Counts) else counts
            counts.totals = totals
        return counts

    async def run_scripts(
        self,
        calls: Sequence[ScriptCall | Command],
        timeout: float,
        *,
        request_path: bool = False,
        away_raises: bool = False,
        packed: bool = False,
    ) -> list[Any]:
        """Run ``calls`` in one pipeline; their replies, index-aligned, an error reply as a value.

        The one way scripts reach Redis: ``EVALSHA`` through ``execute_command`` (redis-py
        blocks ``pipe.evalsha`` on Cluster pipelines). Plain
        :data:`~sidecar.limiter.redis.pipeline.Command` tuples ride along as they are.
        A script call answered ``NOSCRIPT`` (restart, ``SCRIPT FLUSH``, failover to a node
        that never saw it) did not run, so those calls, and only those, go again in a
        second pipeline, with the script's body (which caches it again; see
        :func:`~sidecar.limiter.redis.pipeline.queue_calls`).

        Raises :class:`RedisUnavailable` and nothing else: Redis known down, the round
        trips not done within ``timeout`` (both together), the connection lost, and, with
        ``away_raises``, a reply saying Redis as a whole cannot run calls
        (:func:`~sidecar.limiter.redis.pipeline.redis_away`; for callers that retry every
        call later). ``request_path`` says which round-trip counter the pipelines go to.
        ``packed``: on plain Redis, script calls go packed by hand
        (:mod:`~sidecar.limiter.redis.packed`: the same replies and failures, a fraction of
        the loop's time per call; quota shares, a pipeline of 128 per loop turn).

        In Cluster mode each master's calls are one pipeline of their own, and a master
        that is down or fails the round trip fails its own calls only: they come back
        as :class:`RedisUnavailable` values (see :meth:`ClusterNodes.run`).
        """
        self.availability.ensure_available()
        budget = request_path and timeout <= self.redis_timeout  # the message names the budget only then
        if self.nodes is not None:
            replies = await self.nodes.run(calls, lambda part: self._send(part, request_path), timeout, budget)
        else:
            packed = packed and packable(self.client) and all(isinstance(call, ScriptCall) for call in calls)
            try:
                async with asyncio.timeout(timeout):
                    replies = await self._send(calls, request_path, packed)
            except FAILURES as error:
                raise self.availability.failed(error, budget) from error
            self.availability.answered()
        if away_raises:
            away = next((reply for reply in replies if redis_away(reply)), None)
            if away is not None:
                raise self.availability.failed(away, request_path=False)
        return replies

    async def _send(self, calls: Sequence[ScriptCall | Command], request_path: bool, packed: bool = False) -> list[Any]:
        """The calls in one pipeline, and those answered ``NOSCRIPT`` (they did not run)
        again in a second one, with their bodies."""
        replies = await self._pipeline(calls, request_path, with_body=False, packed=packed)
        missing = [index for index, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
        if missing:
            again = await self._pipeline(
                [calls[index] for index in missing], request_path, with_body=True, packed=packed
            )
            for index, reply in zip(missing, again, strict=True):
                replies[index] = reply
        return replies

    async def _pipeline(
        self, calls: Sequence[ScriptCall | Command], request_path: bool, with_body: bool, packed: bool = False
    ) -> list[Any]:
        """One round trip of :meth:`run_scripts`; ``with_body``: the resend after ``NOSCRIPT``.

        In Cluster mode redis-py does not follow ``TRYAGAIN``/``ASK``/``MOVED`` inside the
        pipeline: those replies come back, the node having answered, and
        :class:`ClusterNodes` resends those calls alone, so a redirection storm is not
        taken for the node's silence.
        """
        if packed:
            commands = commands_of(calls, with_body=with_body, cluster=False)
            self._count(request_path)
            return await run_packed(self.client, commands)  # type: ignore[arg-type]  # packable
        pipe = self.client.pipeline(transaction=False)
        queue_calls(pipe, calls, with_body=with_body, cluster=self.cluster)
        self._count(request_path)
        redirections = {"allow_redirections": False} if self.nodes is not None else {}
        replies: list[Any] = await pipe.execute(raise_on_error=False, **redirections)
        return replies

    async def flush(
        self,
        adds: Pending,
        reads: Sequence[str] = (),
        *,
        once: tuple[str, int] | None = None,
        live_since: float | None = None,
        bans: Mapping[str, int] | None = None,
    ) -> dict[str, int]:
        """Add ``adds`` (INCRBY, EXPIREAT) and read ``reads`` in one pipeline.

        Returns the current total of every key in ``adds`` and ``reads`` (absent keys
        are 0). Not atomic as a whole, only per key, which is all a reconciliation
        needs. Works in Cluster, where redis-py splits the pipeline by node.

        A key that holds something that is not a counter (another type, not an integer,
        beyond +-2^53) is left out of the result, adds nothing, and is reported to
        :attr:`corrupt` with the hits it refused: the other adds of the pipeline did
        land, so failing the whole call would make the caller send them twice. A key
        found corrupt before that reads as a counter again is reported repaired.

        ``once=(owner, sequence)`` makes the adds idempotent: a retry with the same
        owner, sequence and hits adds nothing if the first attempt landed, so a flush
        whose reply was lost can be sent again safely. On plain Redis the adds and reads
        are one ``flush_batch.lua`` call (a few hundred keys cost about a quarter of the
        client CPU of one call per key); in Cluster, one ``flush_once.lua`` per key.

        ``live_since`` also counts the replicas that beat since then, in the same round
        trip, returned under :attr:`replicas_key`: a replica learns of a new peer within
        one flush, not one heartbeat interval.

        A key whose call failed (in Cluster: its master is down) makes the call raise
        :class:`PartialFlush`, which names it and carries the others' totals.

        ``bans`` (``{ban key: until}``) are written first with ``SET NX EXAT until``, so
        a ban already running is neither extended nor shortened, and the ban keys among
        ``reads`` then tell when the ban in force ends.
        """
        self.availability.ensure_available()
        bans = bans or {}
        read_keys = [key for key in dict.fromkeys(reads) if key not in adds]
        if not adds and not read_keys and not bans:
            return {}
        calls: list[ScriptCall | Command] = [("SET", key, until, "EXAT", until, "NX") for key, until in bans.items()]
        batched = flush_calls(calls, adds, read_keys, once, prefix=self.prefix, cluster=self.cluster)
        if live_since is not None:
            calls.append(("ZCOUNT", self.replicas_key, live_since, "+inf"))
        replies = await self.run_scripts(calls, self.background_timeout)
        totals: dict[str, int] = {}
        if live_since is not None:
            live = replies.pop()
            if not isinstance(live, BaseException):
                totals[self.replicas_key] = int(live)
        del replies[: len(bans)]  # SET NX: nothing to learn (a failed one is retried with the batch)
        if batched:
            replies = batch_replies(replies, len(adds) + len(read_keys))
        stride = 2 if once is None else 1
        add_replies, read_replies = replies[: stride * len(adds) : stride], replies[stride * len(adds) :]
        failed: dict[str, RedisUnavailable] = {}
        for key, reply in zip([*adds, *read_keys], [*add_replies, *read_replies], strict=True):
            if isinstance(reply, BaseException) and type(reply) is not ResponseError:
                failed[key] = self.availability.failed(reply, request_path=False)
                continue
            problem = "holds no counter" if isinstance(reply, BaseException) else problem_with(reply)
            if problem is not None:
                self.corrupt.found(key, problem, adds[key][0] if key in adds else 0)
                continue
            totals[key] = int(reply or 0)
            if self.corrupt.keys:
                self.corrupt.repaired(key)
        if failed:
            raise PartialFlush(str(next(iter(failed.values()))), totals, list(failed))
        return totals

    def snapshot(
        self, *, counters: int, evictions: int, replicas: int, pending_hits: int, **rest: Any
    ) -> LimiterSnapshot:
        """A Redis backend's metrics: its own numbers plus this store's state, round trips and
        the event loop's lag (its max since the last call: one call per scrape)."""
        lag = self.availability.lag
        return LimiterSnapshot(
            loop_lag_latest=lag.latest,
            loop_lag_max=lag.take_max(),
            loop_lag=lag.buckets,
            counters=counters,
            evictions=evictions,
            redis_up=self.available,
            replicas=replicas,
            round_trips_request_path=self.round_trips_request_path,
            round_trips_background=self.round_trips_background,
            pending_hits=pending_hits,
            corrupt_keys=self.corrupt.found_times,
            refused_hits=self.corrupt.refused_hits,
            redis_nodes_up=self.nodes.states() if self.nodes is not None else None,
            **rest,
        )

    async def heartbeat(self, replica_id: str, now: float, ttl: float) -> int:
        """Mark this replica alive, forget replicas silent for ``ttl``; returns live replicas (>= 1)."""
        self.availability.ensure_available()
        key = self.replicas_key
        pipe = self.client.pipeline(transaction=False)
        pipe.zadd(key, {replica_id: now})
        pipe.zremrangebyscore(key, "-inf", f"({now - ttl}")
        pipe.zcard(key)
        # The set disappears with the last replica instead of lingering forever.
        pipe.expire(key, math.ceil(ttl) + 1)
        replies = await self._background(pipe.execute())
        return max(1, int(replies[2]))

    async def server_time(self, local: Clock) -> tuple[float, float, float]:
        """``(redis TIME, sent, received)``: Redis's clock, read between two ``local`` readings."""
        self.availability.ensure_available()
        sent = local()
        reply = await self._background(self.client.time())
        if isinstance(reply, dict):  # Redis Cluster asks one node per key slot holder: take one
            reply = next(iter(reply.values()))
        seconds, microseconds = reply
        return seconds + microseconds / 1e6, sent, local()

    async def leave(self, replica_id: str) -> None:
        """Remove this replica from the live set (clean shutdown)."""
        self.availability.ensure_available()
        await self._background(self.client.zrem(self.replicas_key, replica_id))

    # -- decide, two ways: one script, or one per check -----------------------------

    async def _decide_script(
        self,
        keys: Sequence[str],
        checks: Sequence[Check],
        expire_ats: Sequence[int],
        admit_all: bool,
        pending: Pending,
        *,
        now_us: int,
        request_path: bool,
        timeout: float,
    ) -> tuple[bool, list[int], dict[str, int]]:
        """The whole request in one ``decide.lua`` call (every key in one slot)."""
        call = ScriptCall(DECIDE, *decide_arguments(keys, checks, expire_ats, admit_all, pending, now_us=now_us))
        (reply,) = await self.run_scripts([call], timeout, request_path=request_path)
        if isinstance(reply, BaseException):
            raise self._failed(reply, request_path)
        values = [int(value) for value in reply]
        totals = values[1 + len(checks) : 1 + len(checks) + len(pending)]
        return values[0] == 1, counts_of(reply, len(checks), len(pending)), dict(zip(pending, totals, strict=True))

    async def _decide_per_check(
        self,
        keys: Sequence[str],
        checks: Sequence[Check],
        expire_ats: Sequence[int],
        admit_all: bool,
        pending: Pending,
        *,
        now_us: int,
        request_path: bool,
        timeout: float,
    ) -> tuple[bool, list[int], dict[str, int]]:
        """Cross-slot decision in Cluster: each check decided on its own slot, then the request.

        One pipeline applies the pending adds and runs ``decide.lua`` once per check,
        with that check alone and its own role, on the check's slot (a counter's window,
        previous window, bucket and ban keys share one hash tag), so sliding windows,
        token buckets and bans work exactly as in one script. Alone, a check consumes
        its hits exactly when it would in an admitted request (within its limit, shadow,
        or global shadow); :func:`protocol.decide` then runs over all the counts, and
        what an overall-rejected request consumed is given back in the background, off
        the request path (``DECRBY`` hits, or hits times the interval from a TAT).

        Atomic per check only: admitted hits never exceed a limit (each script is exact
        for its counter), but until a give-back lands, a concurrent request on the same
        counter sees the hits and may be rejected although this request was not
        admitted; a token bucket given back after a refill may return to a full bucket
        slightly later than it would have. A counter named twice in a request sees the
        earlier check's hits only if that check consumed them. Bans are set by each
        over check whatever the request's fate, as in one script.
        """
        calls = add_calls(pending, None)
        calls += [
            ScriptCall(DECIDE, *decide_arguments([key], [check], [expire_at], admit_all, {}, now_us=now_us))
            for key, check, expire_at in zip(keys, checks, expire_ats, strict=True)
        ]
        replies = await self.run_scripts(calls, timeout, request_path=request_path)
        added, decided = replies[: 2 * len(pending)], replies[2 * len(pending) :]
        took = [
            check.hits > 0 and not isinstance(reply, BaseException) and int(reply[0]) == 1
            for reply, check in zip(decided, checks, strict=True)
        ]
        failure = next((reply for reply in [*added, *decided] if isinstance(reply, BaseException)), None)
        if failure is not None:
            self._give_back_later(keys, checks, took)  # the request fails: it keeps nothing
            raise self._failed(failure, request_path)
        counts = Counts(int(reply[1]) for reply in decided)
        counts.ban_ends = tuple(float(reply[2]) if len(reply) > 2 else 0.0 for reply in decided)
        admitted, _, consume = decide(checks, counts, [check.limit for check in checks], admit_all)
        self._give_back_later(keys, checks, [spent and not spend for spent, spend in zip(took, consume, strict=True)])
        totals = {key: int(added[2 * index]) for index, key in enumerate(pending)}
        for key, check, spend in zip(keys, checks, consume, strict=True):
            if spend and key in totals:
                totals[key] += check.hits * per_hit(check)
        return admitted, counts, totals

    def _give_back_later(self, keys: Sequence[str], checks: Sequence[Check], marks: Sequence[bool]) -> None:
        """Give back, in the background, the hits of the marked checks (their scripts consumed them)."""
        amounts: dict[str, int] = {}
        for key, check, marked in zip(keys, checks, marks, strict=True):
            if marked:
                amounts[key] = amounts.get(key, 0) + check.hits * per_hit(check)
        if amounts:
            self._spawn(self._give_back(amounts))

    async def _give_back(self, amounts: Mapping[str, int]) -> None:
        """DECRBY what a rejected request's per-check scripts consumed: hits, or a TAT's microseconds."""
        pipe = self.client.pipeline(transaction=False)
        for key, amount in amounts.items():
            pipe.decrby(key, amount)
        try:
            await self._background(pipe.execute())
        except RedisUnavailable:
            # The counters stay too high until their window ends: false rejections, never overshoot.
            self.give_back_failures += 1

    def _spawn(self, call: Any) -> None:
        task: asyncio.Task[None] = asyncio.get_running_loop().create_task(call)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _count(self, request_path: bool) -> None:
        """A round trip goes out: counted, and Redis's silence measured from it (in Cluster,
        each master's, by :class:`ClusterNodes`)."""
        if self.nodes is None:
            self.availability.sent()
        if request_path:
            self.round_trips_request_path += 1
        else:
            self.round_trips_background += 1

    async def _background(self, call: Any) -> Any:
        """Await one background round trip with the background timeout; failures -> RedisUnavailable
        (in Cluster, this call's only: script calls, grouped per master, tell which one failed)."""
        self._count(request_path=False)
        try:
            async with asyncio.timeout(self.background_timeout):
                reply = await call
        except FAILURES as error:
            if self.nodes is not None:
                raise RedisUnavailable(f"redis cluster call failed: {self.availability.describe(error)}") from error
            raise self.availability.failed(error, request_path=False) from error
        self.availability.answered()
        return reply

    async def _probe_once(self) -> None:
        """One PING and the script loads; the scripts are loaded again after every outage.
        In Cluster mode, the slot map and then each master (:meth:`ClusterNodes.probe_all`)."""
        if self.nodes is not None:
            self._count(request_path=False)
            await self.nodes.probe_all()
            return
        async with asyncio.timeout(self.background_timeout):
            self._count(request_path=False)
            await self.client.ping()
            for script in SCRIPTS:
                self._count(request_path=False)
                sha = await self.client.script_load(script.source)
                if sha != script.sha:
                    raise RedisError(f"SCRIPT LOAD of {script.name} returned {sha}, expected {script.sha}")
