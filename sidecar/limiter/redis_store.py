"""Redis access for the limiter backends: few round trips, one failure type, reconnection.

Every public call is one network round trip (a script or a pipeline) so its cost is
predictable and countable: the accuracy harness reports ``round_trips_*`` per request.
Every failure (refused connection, timeout, Redis error, Cluster error) surfaces as
:class:`RedisUnavailable`, so callers apply their failure mode in one ``except``.

While Redis is unavailable, calls fail at once instead of waiting for a timeout: the
request path must never wait on a Redis that is known to be down. A background probe
retries with exponential backoff (capped at one second) and flips the store back to
available, telling the listeners (the failure policy logs it, limiters reconcile).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import NoBackoff
from redis.crc import key_slot
from redis.exceptions import NoScriptError, RedisClusterException, RedisError, ResponseError

from sidecar.limiter.keys import per_hit, replicas_key
from sidecar.limiter.protocol import Check, decide
from sidecar.limiter.scripts import DECIDE, FLUSH_BATCH, FLUSH_ONCE, SCRIPTS, Script, decide_arguments
from sidecar.limiter.sentinel import SentinelTarget, is_sentinel_url, parse_sentinel_url
from sidecar.limiter.windows import Clock
from sidecar.metrics import LimiterSnapshot
from sidecar.settings import Settings

FAILURES: tuple[type[BaseException], ...] = (RedisError, RedisClusterException, OSError)
"""What a Redis call can raise when Redis is away or refuses; ``TimeoutError`` is an ``OSError``."""

CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
MIN_BACKGROUND_TIMEOUT = 1.0
"""Background calls (flush, heartbeat, probe) may wait this long: they hold no request."""
FIRST_BACKOFF = 0.01
MAX_BACKOFF = 1.0
TIMEOUTS_BEFORE_DOWN = 3
"""Request-path timeouts in a row that mark Redis unavailable.

One late answer on a busy machine should not switch every request to the failure
mode; a refused or broken connection does at once.
"""

Pending = Mapping[str, tuple[int, int]]


class Counts(list[int]):
    """One request's would-be counts from ``decide.lua`` (a list, index-aligned with its
    checks), and when each check's ban ends where the request has bans (Unix seconds,
    0 for none; empty when no check has a ban duration)."""

    ban_ends: tuple[float, ...] = ()


def counts_of(reply: Sequence[Any], checks: int, pending: int = 0) -> Counts:
    """The :class:`Counts` in a ``decide.lua`` reply (see its header for the layout)."""
    counts = Counts(int(value) for value in reply[1 : 1 + checks])
    ends = reply[1 + checks + pending :]
    if ends:
        counts.ban_ends = tuple(float(value) for value in ends)
    return counts


"""Hits to add unconditionally: ``{window_key: (hits, expire_at)}``."""
DecideRequest = tuple[Sequence[str], Sequence[Check], Sequence[int]]
"""One request for :meth:`RedisStore.decide_batch`: window keys, checks, expiry times."""
StateListener = Callable[[bool, str], None]
"""Called with ``(available, reason)`` each time the store changes state."""


class RedisUnavailable(Exception):  # noqa: N818 - a state, not an error in our code; name fixed by the callers
    """Redis could not answer (down, slow, refusing); apply the failure mode."""


def client_url(url: str, cluster: bool) -> tuple[str, bool]:
    """The URL redis-py understands and whether it names a Cluster.

    ``redis+cluster://`` and ``rediss+cluster://`` are our spelling for "this is a
    Cluster seed node"; redis-py only knows ``redis://`` and ``rediss://``.
    """
    scheme, sep, rest = url.partition("://")
    if sep and scheme in CLUSTER_SCHEMES:
        return f"{CLUSTER_SCHEMES[scheme]}://{rest}", True
    return url, cluster


def sentinel_client(target: SentinelTarget, options: dict[str, Any]) -> Redis:
    """A client of ``target.service``'s current master, found through the sentinels.

    redis-py asks the sentinels on every new connection and drops its connections
    when one fails or finds the old master turned replica, so after a failover the
    store's reconnection lands on the new master.
    """
    tls: dict[str, Any] = {"ssl": True, **dict(target.tls_options)} if target.tls else {}
    options = options | tls
    sentinel_options = {key: options[key] for key in ("socket_timeout", "socket_connect_timeout")} | tls
    if target.sentinel_password:
        sentinel_options |= {"username": target.sentinel_username, "password": target.sentinel_password}
    sentinel = Sentinel(list(target.sentinels), sentinel_kwargs=sentinel_options)  # type: ignore[no-untyped-call]
    return sentinel.master_for(  # type: ignore[no-any-return]
        target.service, db=target.db, username=target.username, password=target.password, **options
    )


def background_timeout(request_timeout: float) -> float:
    """Socket timeout of every connection and budget of background calls."""
    return max(MIN_BACKGROUND_TIMEOUT, 2 * request_timeout)


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
        request_timeout: float = 0.005,
        background_timeout: float = MIN_BACKGROUND_TIMEOUT,
    ) -> None:
        self.client = client
        self.prefix = prefix
        self.replicas_key = replicas_key(prefix)
        """The sorted set of live replicas (heartbeats)."""
        self.request_timeout = request_timeout
        self.background_timeout = background_timeout
        self.cluster = isinstance(client, RedisCluster)
        self.available = False
        self.last_error = "not started"
        self.round_trips_request_path = 0
        self.round_trips_background = 0
        self.give_back_failures = 0
        self.refused_hits = 0
        """Hits :meth:`flush` could not add because their key does not hold a counter."""
        self._timeouts_in_a_row = 0
        self._reported: bool | None = None
        """The state listeners last heard of (None before the first outage or success)."""
        self._listeners: list[StateListener] = []
        self._ready = asyncio.Event()
        self._probe: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False

    @classmethod
    def from_settings(cls, settings: Settings) -> RedisStore:
        """A store for ``settings.redis_url``; connects lazily (call :meth:`start`)."""
        url, cluster = client_url(settings.redis_url, settings.redis_cluster)
        timeout = background_timeout(settings.redis_timeout)
        options: dict[str, Any] = {
            "socket_timeout": timeout,
            "socket_connect_timeout": timeout,
            # We decide what a failure means; redis-py's retries would eat the budget.
            "retry": Retry(NoBackoff(), 0),
            # No CLIENT SETINFO on connect: one round trip less per new connection.
            "driver_info": None,
        }
        client: Redis | RedisCluster
        if is_sentinel_url(url):
            client = sentinel_client(parse_sentinel_url(url), options)
        elif cluster:
            client = RedisCluster.from_url(url, **options)
        else:
            client = Redis.from_url(url, **options)
        return cls(
            client,
            prefix=settings.redis_prefix,
            request_timeout=settings.redis_timeout,
            background_timeout=timeout,
        )

    # -- life cycle -----------------------------------------------------------------

    def add_listener(self, listener: StateListener) -> None:
        """Be told ``(available, reason)`` on every change of state."""
        self._listeners.append(listener)

    async def start(self) -> None:
        """Connect and load the scripts; if Redis is down, start probing and return anyway.

        A sidecar whose Redis is down at boot still serves (in its failure mode)
        rather than crash-looping, and switches to Redis when the probe succeeds.
        """
        try:
            await self._probe_once()
        except FAILURES as error:
            self._mark_down(describe(error))
        else:
            self._mark_up()

    async def probe(self) -> bool:
        """Try Redis once, now, instead of waiting for the backoff; returns :attr:`available`.

        For shutdown: hits still owed to Redis should not be lost to a backoff sleep.
        """
        if not self.available:
            try:
                await self._probe_once()
            except FAILURES as error:
                self.last_error = describe(error)
            else:
                self._mark_up()
        return self.available

    async def wait_available(self) -> None:
        """Return once Redis is available (at once if it already is)."""
        await self._ready.wait()

    async def close(self) -> None:
        """Stop probing, let give-backs finish, close the connections."""
        self._closed = True
        if self._probe is not None:
            await stop_task(self._probe)
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
        per check (:func:`~sidecar.limiter.keys.check_window`); ``now_us`` is the
        script's clock, 0 for Redis ``TIME``. One round trip. In Cluster mode, keys
        spread over several slots cannot share a script; see :meth:`_decide_per_check`
        for what that costs in atomicity.
        """
        pending = pending or {}
        self._ensure_available()
        if not keys and not pending:
            return True, [], {}
        try:
            async with asyncio.timeout(self.request_timeout if request_path else self.background_timeout):
                if self.cluster and not same_slot([*keys, *pending]):
                    result = await self._decide_per_check(
                        keys, checks, expire_ats, admit_all, pending, now_us=now_us, request_path=request_path
                    )
                else:
                    result = await self._decide_script(
                        keys, checks, expire_ats, admit_all, pending, now_us=now_us, request_path=request_path
                    )
        except FAILURES as error:
            raise self._failed(error, request_path) from error
        self._timeouts_in_a_row = 0
        return result

    async def decide_batch(
        self, requests: Sequence[DecideRequest], admit_all: bool, nows: Sequence[int] | None = None
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
        In Cluster mode the requests go out concurrently, one script (or one per check
        when they span slots) each, under that same background timeout, not the request
        budget (a call cut off at the budget may still run, and nobody would hear of it).
        """
        self._ensure_available()
        clocks = list(nows) if nows is not None else [0] * len(requests)
        if self.cluster:
            answers = await asyncio.gather(
                *(
                    self._decide_in_cluster(keys, checks, expiries, admit_all, now_us)
                    for (keys, checks, expiries), now_us in zip(requests, clocks, strict=True)
                ),
                return_exceptions=True,
            )
            results: list[list[int] | RedisUnavailable] = []
            for answer in answers:
                if isinstance(answer, RedisUnavailable):
                    results.append(answer)
                elif isinstance(answer, BaseException):
                    raise answer
                else:
                    results.append(answer)
            return results
        replies = await self._decide_pipeline(requests, admit_all, clocks)
        missing = [index for index, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
        if missing:
            try:
                await self._probe_once()  # reloads the scripts; NOSCRIPT means the call did not run
            except FAILURES as error:
                raise self._failed(error, request_path=False) from error
            retried = await self._decide_pipeline(
                [requests[index] for index in missing], admit_all, [clocks[index] for index in missing]
            )
            for index, reply in zip(missing, retried, strict=True):
                replies[index] = reply
        return [
            self._failed(reply, request_path=True) if isinstance(reply, Exception) else counts_of(reply, len(checks))
            for reply, (_, checks, _) in zip(replies, requests, strict=True)
        ]

    async def _decide_in_cluster(
        self, keys: Sequence[str], checks: Sequence[Check], expire_ats: Sequence[int], admit_all: bool, now_us: int
    ) -> list[int]:
        """One request of a Cluster batch: a request-path call under the background timeout."""
        if not keys:
            return []
        try:
            async with asyncio.timeout(self.background_timeout):
                decide_one = self._decide_script if same_slot(keys) else self._decide_per_check
                decided = await decide_one(keys, checks, expire_ats, admit_all, {}, now_us=now_us, request_path=True)
        except FAILURES as error:
            raise self._failed(error, request_path=False) from error
        self._timeouts_in_a_row = 0
        return decided[1]

    async def _decide_pipeline(
        self, requests: Sequence[DecideRequest], admit_all: bool, nows: Sequence[int]
    ) -> list[Any]:
        """EVALSHA decide.lua once per request, pipelined; errors come back as values."""
        pipe = self.client.pipeline(transaction=False)
        for (keys, checks, expiries), now_us in zip(requests, nows, strict=True):
            script_keys, args = decide_arguments(keys, checks, expiries, admit_all, {}, now_us=now_us)
            pipe.evalsha(DECIDE.sha, len(script_keys), *script_keys, *args)
        self._count(request_path=True)
        try:
            async with asyncio.timeout(self.background_timeout):
                replies: list[Any] = await pipe.execute(raise_on_error=False)
        except FAILURES as error:
            raise self._failed(error, request_path=False) from error
        self._timeouts_in_a_row = 0
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

        A key Redis refuses to add to (it holds something that is not a counter) is
        left out of the result and its hits are counted in :attr:`refused_hits`: the
        other adds of the pipeline did land, so failing the whole call would make the
        caller send them twice.

        ``once=(owner, sequence)`` makes the adds idempotent: a retry with the same
        owner, sequence and hits adds nothing if the first attempt landed, so a flush
        whose reply was lost can be sent again safely. On plain Redis the adds and reads
        are one ``flush_batch.lua`` call (a few hundred keys cost about a quarter of the
        client CPU of one call per key); in Cluster, one ``flush_once.lua`` per key.

        ``live_since`` also counts the replicas that beat since then, in the same round
        trip, returned under :attr:`replicas_key`: a replica learns of a new peer within
        one flush, not one heartbeat interval.

        ``bans`` (``{ban key: until}``) are written first with ``SET NX EXAT until``, so
        a ban already running is neither extended nor shortened, and the ban keys among
        ``reads`` then tell when the ban in force ends.
        """
        self._ensure_available()
        bans = bans or {}
        read_keys = [key for key in dict.fromkeys(reads) if key not in adds]
        if not adds and not read_keys and not bans:
            return {}
        pipe = self.client.pipeline(transaction=False)
        for key, until in bans.items():
            pipe.set(key, until, exat=until, nx=True)
        batched = self._queue_flush(pipe, adds, read_keys, once)
        if live_since is not None:
            pipe.zcount(self.replicas_key, live_since, "+inf")
        replies = await self._background(pipe.execute(raise_on_error=False))
        if once is not None and any(isinstance(reply, NoScriptError) for reply in replies):
            await self._probe_once()  # reloads the scripts; NOSCRIPT means that call did not run
            return await self.flush(adds, reads, once=once, live_since=live_since, bans=bans)
        totals: dict[str, int] = {}
        if live_since is not None:
            live = replies.pop()
            if not isinstance(live, BaseException):
                totals[self.replicas_key] = int(live)
        del replies[: len(bans)]  # SET NX: nothing to learn (a failed one is retried with the batch)
        if batched:
            replies = self._batch_replies(replies, len(adds) + len(read_keys))
        stride = 2 if once is None else 1
        add_replies, read_replies = replies[: stride * len(adds) : stride], replies[stride * len(adds) :]
        for key, reply in zip([*adds, *read_keys], [*add_replies, *read_replies], strict=True):
            if type(reply) is ResponseError:
                self.refused_hits += adds[key][0] if key in adds else 0
            elif isinstance(reply, BaseException):
                raise self._failed(reply, request_path=False) from reply
            else:
                totals[key] = int(reply or 0)
        return totals

    def _queue_flush(self, pipe: Any, adds: Pending, reads: Sequence[str], once: tuple[str, int] | None) -> bool:
        """Queue a flush's adds and reads; True when they went as one ``flush_batch.lua`` call."""
        if once is None or self.cluster:
            self._queue_adds(pipe, adds, once)
            for key in reads:
                pipe.get(key)
            return False
        owner, sequence = once
        args: list[int] = [sequence, len(adds)]
        for hits, expire_at in adds.values():
            args += (hits, expire_at)
        keys = [f"{self.prefix}:flushed:{owner}", *adds, *reads]
        pipe.execute_command("EVALSHA", FLUSH_BATCH.sha, len(keys), *keys, *args)
        return True

    @staticmethod
    def _batch_replies(replies: list[Any], keys: int) -> list[Any]:
        """``flush_batch.lua``'s one reply as one reply per key, as the per-key calls give them.

        -1 marks a key that holds something other than a number: a ResponseError, so
        its hits are counted as refused (an add) or it is left out (a read).
        """
        (reply,) = replies
        if isinstance(reply, BaseException):
            return [reply] * keys
        refused = ResponseError("not a counter")
        return [refused if value == -1 else value for value in reply]

    @staticmethod
    def _queue_adds(pipe: Any, adds: Pending, once: tuple[str, int] | None) -> None:
        """INCRBY + EXPIREAT per key, or one idempotent ``flush_once.lua`` call per key."""
        for key, (hits, expire_at) in adds.items():
            if once is None:
                pipe.incrby(key, hits)
                pipe.expireat(key, expire_at)
            else:
                owner, sequence = once
                # execute_command, not pipe.evalsha: redis-py blocks the evalsha method on
                # Cluster pipelines, though it routes EVALSHA by its keys like any command.
                marker = f"{key}:flushed:{owner}"
                pipe.execute_command("EVALSHA", FLUSH_ONCE.sha, 2, key, marker, sequence, hits, expire_at)

    def snapshot(
        self, *, counters: int, evictions: int, replicas: int, pending_hits: int, **rest: Any
    ) -> LimiterSnapshot:
        """A Redis backend's metrics: its own numbers plus this store's state and round trips."""
        return LimiterSnapshot(
            counters=counters,
            evictions=evictions,
            redis_up=self.available,
            replicas=replicas,
            round_trips_request_path=self.round_trips_request_path,
            round_trips_background=self.round_trips_background,
            pending_hits=pending_hits,
            **rest,
        )

    async def heartbeat(self, replica_id: str, now: float, ttl: float) -> int:
        """Mark this replica alive, forget replicas silent for ``ttl``; returns live replicas (>= 1)."""
        self._ensure_available()
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
        self._ensure_available()
        sent = local()
        reply = await self._background(self.client.time())
        if isinstance(reply, dict):  # Redis Cluster asks one node per key slot holder: take one
            reply = next(iter(reply.values()))
        seconds, microseconds = reply
        return seconds + microseconds / 1e6, sent, local()

    async def leave(self, replica_id: str) -> None:
        """Remove this replica from the live set (clean shutdown)."""
        self._ensure_available()
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
    ) -> tuple[bool, list[int], dict[str, int]]:
        script_keys, args = decide_arguments(keys, checks, expire_ats, admit_all, pending, now_us=now_us)
        reply = await self._run_script(DECIDE, script_keys, args, request_path=request_path)
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
        pipe = self.client.pipeline(transaction=False)
        for key, (hits, expire_at) in pending.items():
            pipe.incrby(key, hits)
            pipe.expireat(key, expire_at)
        calls = [
            decide_arguments([key], [check], [expire_at], admit_all, {}, now_us=now_us)
            for key, check, expire_at in zip(keys, checks, expire_ats, strict=True)
        ]
        for script_keys, args in calls:
            # execute_command: redis-py blocks pipe.evalsha on Cluster pipelines, though it
            # routes EVALSHA by its keys like any command.
            pipe.execute_command("EVALSHA", DECIDE.sha, len(script_keys), *script_keys, *args)
        self._count(request_path)
        replies = await pipe.execute(raise_on_error=False)
        added, decided = replies[: 2 * len(pending)], replies[2 * len(pending) :]
        await self._run_missing_scripts(calls, decided, request_path)
        took = [
            check.hits > 0 and not isinstance(reply, BaseException) and int(reply[0]) == 1
            for reply, check in zip(decided, checks, strict=True)
        ]
        failure = next((reply for reply in [*added, *decided] if isinstance(reply, BaseException)), None)
        if failure is not None:
            self._give_back_later(keys, checks, took)  # the request fails: it keeps nothing
            raise failure
        counts = Counts(int(reply[1]) for reply in decided)
        counts.ban_ends = tuple(float(reply[2]) if len(reply) > 2 else 0.0 for reply in decided)
        admitted, _, consume = decide(checks, counts, [check.limit for check in checks], admit_all)
        self._give_back_later(keys, checks, [spent and not spend for spent, spend in zip(took, consume, strict=True)])
        totals = {key: int(added[2 * index]) for index, key in enumerate(pending)}
        for key, check, spend in zip(keys, checks, consume, strict=True):
            if spend and key in totals:
                totals[key] += check.hits * per_hit(check)
        return admitted, counts, totals

    async def _run_missing_scripts(
        self, calls: Sequence[tuple[list[str], list[int | str]]], replies: list[Any], request_path: bool
    ) -> None:
        """Send the calls Redis answered NOSCRIPT (so they did not run) again with their body."""
        missing = [index for index, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
        if not missing:
            return
        pipe = self.client.pipeline(transaction=False)
        for index in missing:
            script_keys, args = calls[index]
            pipe.execute_command("EVAL", DECIDE.source, len(script_keys), *script_keys, *args)
        self._count(request_path)
        for index, reply in zip(missing, await pipe.execute(raise_on_error=False), strict=True):
            replies[index] = reply

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

    async def _run_script(
        self, script: Script, keys: Sequence[str], args: Sequence[int | str], *, request_path: bool
    ) -> Any:
        """EVALSHA; on NOSCRIPT (flushed, restarted, failed over) send the body once with EVAL."""
        self._count(request_path)
        try:
            return await self.client.evalsha(script.sha, len(keys), *keys, *args)
        except NoScriptError:
            self._count(request_path)
            return await self.client.eval(script.source, len(keys), *keys, *args)

    # -- failures and recovery ---------------------------------------------------------

    async def _background(self, call: Any) -> Any:
        """Await one background round trip with the background timeout; failures -> RedisUnavailable."""
        self._count(request_path=False)
        try:
            async with asyncio.timeout(self.background_timeout):
                return await call
        except FAILURES as error:
            raise self._failed(error, request_path=False) from error

    def note_request_timeout(self) -> None:
        """A caller stopped waiting for a call still on the wire (its budget ran out).

        Counts as a request-path timeout of :meth:`decide` does: enough of them in a
        row mark Redis unavailable, so later requests stop waiting on it.
        """
        self._failed(TimeoutError(f"no answer within {self.request_timeout * 1000:g} ms"), request_path=True)

    def _count(self, request_path: bool) -> None:
        if request_path:
            self.round_trips_request_path += 1
        else:
            self.round_trips_background += 1

    def _ensure_available(self) -> None:
        if not self.available:
            raise RedisUnavailable(f"redis unavailable: {self.last_error}")

    def _failed(self, error: BaseException, request_path: bool) -> RedisUnavailable:
        """Record a failed call; returns the exception for the caller to raise."""
        reason = describe(error)
        if type(error) is ResponseError:
            # A reply about this call (a key holding a non-integer, a busy script), not about
            # the server: fail this call only, or one bad key would switch every request over.
            return RedisUnavailable(f"redis refused the call: {reason}")
        if request_path and isinstance(error, TimeoutError):
            self._timeouts_in_a_row += 1
            if self._timeouts_in_a_row < TIMEOUTS_BEFORE_DOWN:
                return RedisUnavailable(f"redis did not answer within {self.request_timeout * 1000:g} ms")
        self._mark_down(reason)
        return RedisUnavailable(f"redis unavailable: {reason}")

    def _mark_down(self, reason: str) -> None:
        """Fail fast from now on, probe in the background, tell listeners once per outage."""
        self.available = False
        self._ready.clear()
        self.last_error = reason
        self._timeouts_in_a_row = 0
        if not self._closed and (self._probe is None or self._probe.done()):
            self._probe = asyncio.get_running_loop().create_task(self._probe_until_up())
        if self._reported is not False:
            self._reported = False
            self._notify(False, reason)

    def _mark_up(self) -> None:
        """Serve calls again; listeners hear of it only if they heard of the outage."""
        self.available = True
        self._ready.set()
        self._timeouts_in_a_row = 0
        if self._reported is False:
            self._notify(True, "")
        self._reported = True

    def _notify(self, available: bool, reason: str) -> None:
        for listener in self._listeners:
            listener(available, reason)

    async def _probe_until_up(self) -> None:
        """Retry PING + SCRIPT LOAD with exponential backoff until Redis answers."""
        delay = FIRST_BACKOFF
        while not self._closed:
            await asyncio.sleep(delay)
            try:
                await self._probe_once()
            except FAILURES as error:
                self.last_error = describe(error)
                delay = min(delay * 2, MAX_BACKOFF)
                continue
            self._mark_up()
            return

    async def _probe_once(self) -> None:
        """One PING and the script loads; the scripts are loaded again after every outage."""
        async with asyncio.timeout(self.background_timeout):
            self._count(request_path=False)
            await self.client.ping()
            for script in SCRIPTS:
                self._count(request_path=False)
                sha = await self.client.script_load(script.source)
                if sha != script.sha:
                    raise RedisError(f"SCRIPT LOAD of {script.name} returned {sha}, expected {script.sha}")

    def _spawn(self, call: Any) -> None:
        task: asyncio.Task[None] = asyncio.get_running_loop().create_task(call)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


async def stop_task(task: asyncio.Task[Any]) -> None:
    """Cancel ``task`` and wait until it has ended, cancelling again if needed.

    One ``cancel()`` is not always enough: on Python 3.11, ``asyncio.wait_for`` (which
    redis-py uses to send commands) swallows a cancellation that arrives just as the
    send completes, and the task carries on (a heartbeat loop would then run forever).
    """
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=0.1)
    if not task.cancelled():
        task.exception()  # retrieved, so asyncio does not log it as never retrieved


def describe(error: BaseException) -> str:
    """One line naming an error, for logs and messages."""
    text = str(error)
    return f"{type(error).__name__}: {text}" if text else type(error).__name__
