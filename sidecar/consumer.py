"""The consumer side: wait for a slot of a shared budget instead of failing.

A service that *calls* a rate-limited provider (a payment API, a partner's endpoint)
asks the sidecar before each call, with the descriptors of the provider's budget; all
its replicas share that budget through the sidecar's Redis modes. When the sidecar
refuses, :meth:`Consumer.acquire` waits for the window the sidecar reports and asks
again, until it is admitted or ``max_wait`` would be exceeded. The three policies of
the LINE design are values of ``max_wait``:

* ``max_wait=WAIT`` (``math.inf``): wait until admitted;
* ``max_wait=5.0``: wait at most 5 s, then :class:`RateLimitExceeded`;
* ``max_wait=FAIL_FAST`` (``0``): ask once, fail at once when refused.

**Failing fast, not in vain.** A refusal carries ``duration_until_reset``: when the
window with the next budget starts. If that is past the deadline (an hour window spent,
``max_wait`` 5 s), the call fails at once with :attr:`RateLimitExceeded.retry_after`
instead of sleeping 5 s first. **A caller gets its answer within ``max_wait`` plus
:data:`ANSWER_SLACK`**, however many start together: waiting for its turn counts
against ``max_wait``, every ask carries a gRPC deadline of what is left of it (plus the
slack, at most ``rpc_timeout``), later asks are timed so that their answer is expected
before the deadline, and the first is waited for until its gRPC deadline (so
``FAIL_FAST`` costs one round trip, about a millisecond, and gets the slack for it).

**No stampede at a window boundary.** A refused waiter does not retry at the boundary
(where every waiter of every replica would arrive together, and a provider would get
the whole next budget in one burst). It retries at ``boundary + U(0, W)``, a uniform
jitter over the window ``W`` of the limit that refused it (capped so the retry lands
before its deadline). Retries arrive at an even rate across the window, so admissions
do too, until the window's budget is spent; ``docs/consumer.md`` measures the spread
against plain retry-on-429 (``python -m loadtest.consumer_spread``). The boundary is
cut on this host's Unix clock, as the sidecar cuts windows (aligned to the epoch); the
reported reset, whole seconds rounded up, bounds it, so clock skew between the two can
only make a retry late or early by the skew (an early one is refused and retries).

**Fresh asks are paced too** (``pace=True``, the default; the rules are
:mod:`sidecar.consumer_pace`). Jittered retries alone do not spread a window's budget
when callers that were just served come straight back, so every ask for one request
through one client waits its turn: no sooner than ``hits * T / (remaining + hits)``
after the previous one (``remaining`` and ``T``, the time left in the window, from the
sidecar's latest answer). Callers queued and asks on their way claim what is left: one
that finds it all claimed, the next window starting after its deadline, fails at once
without asking, and one whose turn comes after its deadline asks at once, out of turn
(:attr:`ConsumerStats.out_of_turn`). Before the first answer (or once the last is
stale) one ask learns the pace and the others wait for its answer. ``FAIL_FAST`` never
waits. Each client paces itself from the shared ``remaining``, which every replica
spends, so ``K`` busy clients ask ``K`` times the even rate: ``docs/consumer.md``
measures it.

**Cancellation never consumes a hit.** A hit is spent only when the sidecar admits an
ask. While a caller sleeps between asks nothing is in flight, so cancelling it (task
cancelled, ``asyncio.timeout`` around it) costs nothing. An ask already sent cannot be
taken back: the sidecar may admit it at the moment the caller leaves, and the
rate-limit protocol has no give-back call. So the client never cuts an RPC half way
(that would leave the outcome unknown): the caller leaves at once (it is not held
past its deadline or its cancellation), the ask finishes in the background, and if it
was admitted its slot is *orphaned*: kept for the next :meth:`acquire` of the same
request on this client while its window lasts (handed over, :attr:`ConsumerStats.reused`),
and counted as :attr:`ConsumerStats.wasted` if nobody takes it in time. Every admitted
ask is counted in :attr:`ConsumerStats.granted`, so the sidecar's counters equal
``granted * hits``: the proof tests hold them to it. The one exception is an ask cut by
its gRPC deadline (:attr:`ConsumerStats.unanswered`: the sidecar took longer than
``max_wait`` plus the slack), whose outcome nobody learns.

A :class:`Consumer` is asyncio (``grpc.aio``); :class:`SyncConsumer` wraps one for
threaded code. Both offer ``acquire``, a context manager (``slot``) and a decorator
(``limited``). The sidecar's errors (unreachable, bad request) raise :class:`SidecarError`
at once: whether to call the provider anyway is the caller's decision.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import random
import threading
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ParamSpec, TypeVar

import grpc

from sidecar.client import ClientTLS, aio_channel, parse_descriptor
from sidecar.consumer_pace import (
    RECHECK,
    Ask,
    AwaitAnswer,
    Fail,
    Hold,
    Pace,
    PaceTable,
    Refused,
    plan_turn,
    read_answer,
    refusal,
    window_end,
)
from sidecar.protos.envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from sidecar.protos.envoy.service.ratelimit.v3 import rls_pb2
from sidecar.service.validate import request_problem

P = ParamSpec("P")
T = TypeVar("T")

METHOD = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit"
WAIT = math.inf
"""``max_wait`` that waits until admitted."""
FAIL_FAST = 0.0
"""``max_wait`` that asks once and fails at once when refused."""
DEFAULT_MAX_WAIT = 5.0
RPC_TIMEOUT = 2.0
"""Longest one ask may take; the sidecar answers in milliseconds (its Redis waits are bounded)."""
MIN_RPC_ALLOWANCE = 0.005
"""Time kept before a deadline for the last ask's answer, at least (else a measured average)."""
ANSWER_SLACK = 0.1
"""Seconds past ``max_wait`` a caller may get its answer at most: the gRPC deadline of every ask is
what is left of ``max_wait`` plus this (the sidecar answers in milliseconds; this is for its worst)."""
OVER_LIMIT = rls_pb2.RateLimitResponse.OVER_LIMIT
OK = rls_pb2.RateLimitResponse.OK
CHANNEL_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 50),
    ("grpc.max_reconnect_backoff_ms", 1000),
)

Descriptor = str | Mapping[str, str] | Sequence[tuple[str, str]]
"""One descriptor: ``"key=value,key2=value2"``, ``{"key": "value"}`` or ``[("key", "value")]``."""


class ConsumerError(Exception):
    """Base of what :class:`Consumer` raises."""


class RateLimitExceeded(ConsumerError):  # noqa: N818 - reads as what happened to the call
    """Not admitted within ``max_wait``.

    ``retry_after``: seconds from now until the sidecar expects budget again (None when the
    deadline struck while an ask was in flight); ``waited``: how long this call took.
    """

    def __init__(self, message: str, *, retry_after: float | None, waited: float, attempts: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after
        self.waited = waited
        self.attempts = attempts


class SidecarError(ConsumerError):
    """The sidecar did not decide: unreachable, timed out, or the request is invalid."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


@dataclass(frozen=True, slots=True)
class Permit:
    """An admitted call: how long it waited, how many asks it took, what is left of the budget."""

    waited: float
    attempts: int
    remaining: int | None
    """Hits left in the tightest limit's window after this one (None for a handed-over slot)."""
    handed_over: bool = False
    """True when the slot came from an ask whose caller had left (see the module docstring)."""


@dataclass
class ConsumerStats:
    """What a :class:`Consumer` did; ``granted == acquired - reused + orphaned`` always holds."""

    asks: int = 0
    granted: int = 0
    """Asks the sidecar admitted: ``granted * hits`` is what its counters hold for us."""
    refused: int = 0
    acquired: int = 0
    """Permits handed to callers (fresh grants and reused orphans)."""
    failed_fast: int = 0
    """Calls that failed before their deadline: the next budget came too late."""
    timed_out: int = 0
    """Calls whose deadline struck while an ask was in flight."""
    cancelled: int = 0
    orphaned: int = 0
    """Asks admitted after their caller had left (cancelled or timed out)."""
    reused: int = 0
    paced: int = 0
    """Asks held back by the pace (see the module docstring)."""
    out_of_turn: int = 0
    """Asks sent before their turn because the caller's deadline came first."""
    wasted: int = 0
    """Orphaned slots nobody took before their window ended."""
    unanswered: int = 0
    """Asks cut by their gRPC deadline: whether the sidecar admitted them is unknown."""
    rpc_seconds: float = 0.005
    """Moving average of an ask's round trip."""


@dataclass
class _Orphans:
    """Admitted slots whose callers left, per request payload: each usable until its window ends."""

    until: dict[bytes, list[float]] = field(default_factory=lambda: defaultdict(list))

    def add(self, key: bytes, expires: float) -> None:
        self.until[key].append(expires)

    def take(self, key: bytes, now: float, stats: ConsumerStats) -> bool:
        slots = self.until.get(key)
        while slots:
            expires = slots.pop()
            if expires > now:
                return True
            stats.wasted += 1
        self.until.pop(key, None)
        return False

    def expire(self, now: float, stats: ConsumerStats) -> None:
        for key in list(self.until):
            kept = [expires for expires in self.until[key] if expires > now]
            stats.wasted += len(self.until[key]) - len(kept)
            if kept:
                self.until[key] = kept
            else:
                del self.until[key]


def descriptor_message(descriptor: Descriptor) -> Any:
    """A ``RateLimitDescriptor`` from any :data:`Descriptor` spelling."""
    if isinstance(descriptor, str):
        return parse_descriptor(descriptor)
    pairs = list(descriptor.items()) if isinstance(descriptor, Mapping) else list(descriptor)
    entries = []
    for pair in pairs:
        if not (isinstance(pair, tuple) and len(pair) == 2):
            raise ValueError(f"descriptor {descriptor!r}: entries are (key, value) pairs")
        entries.append(ratelimit_pb2.RateLimitDescriptor.Entry(key=str(pair[0]), value=str(pair[1])))
    return ratelimit_pb2.RateLimitDescriptor(entries=entries)


def request_payload(domain: str, descriptors: Descriptor | Sequence[Descriptor], hits: int) -> bytes:
    """The serialized ``RateLimitRequest``; ``ValueError`` with the sidecar's own message if it is out of bounds.

    A single ``str`` or mapping is one descriptor; otherwise ``descriptors`` is a sequence of them.
    """
    if hits < 1:
        raise ValueError("hits: at least 1")
    items: list[Any] = [descriptors] if isinstance(descriptors, str | Mapping) else list(descriptors)
    request = rls_pb2.RateLimitRequest(
        domain=domain, descriptors=[descriptor_message(item) for item in items], hits_addend=hits
    )
    problem = request_problem(request)
    if problem is not None:
        raise ValueError(problem)
    payload: bytes = request.SerializeToString()
    return payload


def admitted_remaining(response: Any) -> int | None:
    limited = [status.limit_remaining for status in response.statuses if status.HasField("current_limit")]
    return min(limited) if limited else None


def reset_of_admitted(response: Any) -> float:
    """Seconds until the earliest window of an admitted answer ends: how long its slot stays good."""
    resets = [status.duration_until_reset.seconds for status in response.statuses if status.HasField("current_limit")]
    return float(min(resets)) if resets else 0.0


class Consumer:
    """Asks a sidecar for slots and waits for them; one per event loop, shared by its tasks.

    ``spread=False`` retries at the window boundary itself (for comparisons: it stampedes);
    ``pace=False`` sends fresh asks at once (the budget then goes early in each window).
    ``monotonic``, ``wall`` and ``rng`` are injectable for tests.
    """

    def __init__(
        self,
        address: str,
        *,
        tls: ClientTLS | None = None,
        rpc_timeout: float = RPC_TIMEOUT,
        spread: bool = True,
        pace: bool = True,
        monotonic: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        rng: random.Random | None = None,
    ) -> None:
        self.address = address
        self.tls = tls
        self.rpc_timeout = rpc_timeout
        self.spread = spread
        self.pace = pace
        self.monotonic = monotonic
        self.wall = wall
        self.rng = rng or random.Random()
        self.stats = ConsumerStats()
        self._channel: grpc.aio.Channel | None = None
        self._call: Any = None
        self._orphans = _Orphans()
        self._paces = PaceTable()
        self._background: set[asyncio.Task[Any]] = set()

    async def __aenter__(self) -> Consumer:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()

    async def close(self, grace: float = 1.0) -> None:
        """Let asks still in flight finish (their outcome is counted), then close the channel."""
        if self._background:
            await asyncio.wait(set(self._background), timeout=grace)
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    def _method(self) -> Any:
        if self._call is None:
            self._channel = aio_channel(self.address, self.tls, CHANNEL_OPTIONS)
            self._call = self._channel.unary_unary(
                METHOD, request_serializer=None, response_deserializer=rls_pb2.RateLimitResponse.FromString
            )
        return self._call

    async def _ask(self, payload: bytes, timeout: float) -> Any:
        """One RPC with a gRPC deadline of ``timeout`` seconds."""
        started = self.monotonic()
        try:
            response = await self._method()(payload, timeout=timeout)
        except grpc.aio.AioRpcError as error:
            if error.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                self.stats.unanswered += 1
            raise SidecarError(error.code(), error.details() or "") from None
        self.stats.asks += 1
        self.stats.rpc_seconds += (self.monotonic() - started - self.stats.rpc_seconds) / 8
        if response.overall_code == OVER_LIMIT:
            self.stats.refused += 1
        else:
            self.stats.granted += 1
        return response

    async def acquire(
        self,
        domain: str,
        descriptors: Descriptor | Sequence[Descriptor],
        hits: int = 1,
        *,
        max_wait: float = DEFAULT_MAX_WAIT,
    ) -> Permit:
        """Wait until the sidecar admits ``hits`` for ``descriptors`` in ``domain``, at most ``max_wait`` seconds.

        Raises :class:`RateLimitExceeded` (at once when the next budget comes after the
        deadline), :class:`SidecarError` when the sidecar does not decide, ``ValueError``
        for a request outside the sidecar's bounds. The answer comes within ``max_wait``
        plus :data:`ANSWER_SLACK`. Cancelling the call spends no hit unless an ask was
        already on its way (see the module docstring).
        """
        if max_wait < 0 or math.isnan(max_wait):
            raise ValueError("max_wait: 0 (fail fast), a number of seconds, or WAIT")
        payload = request_payload(domain, descriptors, hits)
        started = self.monotonic()
        deadline = started + max_wait
        pace = self._paces.get(payload)
        attempts = 0
        try:
            while True:
                if self._orphans.take(payload, self.monotonic(), self.stats):
                    self.stats.reused += 1
                    self.stats.acquired += 1
                    return Permit(self.monotonic() - started, attempts, None, handed_over=True)
                # Waiting for the turn, nothing is in flight: cancelling it spends nothing.
                turn = await self._wait_turn(pace, deadline, hits) if self.pace and max_wait > 0 else Ask()
                if not isinstance(turn, Ask):
                    raise self._no_slot(domain, max_wait, turn, self.monotonic() - started, attempts)
                attempts += 1
                response = await self._ask_before(
                    pace, payload, hits, deadline, probe=turn.probe, started=started, attempts=attempts
                )
                now = self.monotonic()
                waited = now - started
                if response.overall_code != OVER_LIMIT:
                    self.stats.acquired += 1
                    return Permit(waited, attempts, admitted_remaining(response))
                delay = self._retry_delay(refusal(response), deadline - now)
                if delay is None:
                    retry_after = window_end(self.wall(), refusal(response)) - self.wall()
                    raise self._no_slot(domain, max_wait, Fail(max(0.0, retry_after)), waited, attempts)
                await asyncio.sleep(delay)  # nothing in flight: cancelling here spends nothing
        except asyncio.CancelledError:
            self.stats.cancelled += 1
            raise

    def _no_slot(
        self, domain: str, max_wait: float, verdict: Fail | AwaitAnswer, waited: float, attempts: int
    ) -> RateLimitExceeded:
        """The :class:`RateLimitExceeded` of a call that gets no slot in time: ``Fail`` says when budget comes
        back; ``AwaitAnswer`` is a deadline that struck while the answer setting the pace was on its way."""
        if isinstance(verdict, AwaitAnswer):
            self.stats.timed_out += 1
            return RateLimitExceeded(
                "max_wait reached while asking the sidecar", retry_after=None, waited=waited, attempts=attempts
            )
        self.stats.failed_fast += 1
        return RateLimitExceeded(
            f"{domain}: no budget within max_wait={max_wait:g}s (next in {verdict.retry_after:.2f}s)",
            retry_after=verdict.retry_after,
            waited=waited,
            attempts=attempts,
        )

    def _retry_delay(self, refused: Refused, time_left: float) -> float | None:
        """Seconds to sleep before the next ask, or None when it could not be answered in time."""
        now = self.wall()
        boundary = window_end(now, refused) - now
        room = time_left - self._allowance() - boundary
        if room < 0:
            return None
        if not self.spread:
            return boundary
        return boundary + self.rng.uniform(0.0, min(refused.window, room))

    def _allowance(self) -> float:
        """Time kept before a deadline for an ask's answer."""
        return max(MIN_RPC_ALLOWANCE, 2 * self.stats.rpc_seconds)

    async def _wait_turn(self, pace: Pace, deadline: float, hits: int) -> Ask | Fail | AwaitAnswer:
        """Wait until this request's pace lets the next ask go (:class:`Ask`), or say why no slot comes in time.

        The rule is :func:`sidecar.consumer_pace.plan_turn`, asked again whenever the state
        may have moved (an answer came, a hold ended, the queue gave up at the deadline).
        The caller's claim (an ask on its way) is counted when it asks, in the same loop
        turn as the plan, so the next caller to plan sees it.
        """
        latest = deadline - self._allowance()
        while True:
            now = self.monotonic()
            turn = plan_turn(pace, now, latest, hits)
            if isinstance(turn, Ask):
                self.stats.out_of_turn += int(turn.out_of_turn)
                return turn
            if isinstance(turn, Fail):
                return turn
            if isinstance(turn, AwaitAnswer):
                try:
                    await asyncio.wait_for(pace.answered.wait(), None if math.isinf(latest) else latest - now)
                except TimeoutError:
                    return turn
            elif isinstance(turn, Hold):
                await asyncio.sleep(max(0.0, turn.until - now))
            elif await self._queue(pace, latest):
                return Ask()

    async def _queue(self, pace: Pace, latest: float) -> bool:
        """Wait in the queue until this caller's turn: True to ask now, False to plan again.

        False when ``latest`` comes first, or when an answer meanwhile says the budget is
        spent until after it (the plan then fails the call at once).
        """
        pace.waiting += 1
        try:
            async with asyncio.timeout(None if math.isinf(latest) else latest - self.monotonic()), pace.lock:
                held = False
                while (wait := pace.not_before - (now := self.monotonic())) > 0:
                    if pace.spent_past(latest, now):
                        return False
                    held = True
                    await asyncio.sleep(min(wait, RECHECK))  # an answer meanwhile may move not_before
                self.stats.paced += int(held)
                # Until this ask's answer says better; with no fresh answer, one round trip.
                pace.not_before = now + (pace.interval if pace.fresh(now) else self.stats.rpc_seconds)
                return True
        except TimeoutError:
            return False
        finally:
            pace.waiting -= 1

    async def _ask_paced(self, pace: Pace, payload: bytes, hits: int, timeout: float, *, probe: bool) -> Any:
        """One ask, a claim on the pace until it ends; its answer sets the pace of the next."""
        try:
            response = await self._ask(payload, timeout)
            pace.learn(read_answer(response, hits, self.wall()), self.monotonic())
            return response
        finally:
            pace.in_flight -= 1
            if probe:
                pace.probing = False
            pace.ask_ended()

    async def _ask_before(
        self, pace: Pace, payload: bytes, hits: int, deadline: float, *, probe: bool, started: float, attempts: int
    ) -> Any:
        """One ask with a gRPC deadline of what is left of ``max_wait`` plus :data:`ANSWER_SLACK`.

        The first ask is waited for until that deadline; a later one is left at the caller's
        deadline (it was timed to be answered before it) and finishes in the background, never
        cut half way but by its gRPC deadline (see the module docstring).
        """
        now = self.monotonic()
        timeout = min(self.rpc_timeout, max(0.0, deadline + ANSWER_SLACK - now))
        pace.in_flight += 1  # claimed now, in the loop turn of the plan, so the next plan counts it
        pace.probing = pace.probing or probe
        task = asyncio.ensure_future(self._ask_paced(pace, payload, hits, timeout, probe=probe))
        leave_in = None if attempts == 1 or math.isinf(deadline) else max(0.0, deadline - now)
        try:
            done, _ = await asyncio.wait({task}, timeout=leave_in)
        except asyncio.CancelledError:
            self._abandon(task, payload)
            raise
        if not done:
            self._abandon(task, payload)
            self.stats.timed_out += 1
            raise RateLimitExceeded(
                "max_wait reached while asking the sidecar", retry_after=None, waited=self.monotonic() - started,
                attempts=attempts,
            )  # fmt: skip
        error = task.exception()
        if (
            isinstance(error, SidecarError)
            and error.code == grpc.StatusCode.DEADLINE_EXCEEDED
            and timeout < self.rpc_timeout
        ):
            self.stats.timed_out += 1  # cut by max_wait, not by a sidecar slower than rpc_timeout
            raise RateLimitExceeded(
                "max_wait reached while asking the sidecar", retry_after=None, waited=self.monotonic() - started,
                attempts=attempts,
            )  # fmt: skip
        return task.result()

    def _abandon(self, task: asyncio.Task[Any], payload: bytes) -> None:
        """The caller left while ``task`` asks: keep it, and keep its slot if it is admitted."""
        self._background.add(task)

        def settled(finished: asyncio.Task[Any]) -> None:
            self._background.discard(finished)
            if finished.cancelled() or finished.exception() is not None:
                return
            response = finished.result()
            if response.overall_code != OVER_LIMIT:
                self.stats.orphaned += 1
                now = self.monotonic()
                self._orphans.expire(now, self.stats)
                self._orphans.add(payload, now + reset_of_admitted(response) - 1)  # the reset is rounded up

        task.add_done_callback(settled)

    @contextlib.asynccontextmanager
    async def slot(
        self,
        domain: str,
        descriptors: Descriptor | Sequence[Descriptor],
        hits: int = 1,
        *,
        max_wait: float = DEFAULT_MAX_WAIT,
    ) -> AsyncIterator[Permit]:
        """``async with consumer.slot("payments", {"provider": "acme"}) as permit:`` call the provider."""
        yield await self.acquire(domain, descriptors, hits, max_wait=max_wait)

    def limited(
        self,
        domain: str,
        descriptors: Descriptor | Sequence[Descriptor],
        hits: int = 1,
        *,
        max_wait: float = DEFAULT_MAX_WAIT,
    ) -> Callable[[Callable[P, Awaitable[T]]], Callable[P, Awaitable[T]]]:
        """A decorator: every call of the coroutine function first acquires a slot."""

        def decorate(function: Callable[P, Awaitable[T]]) -> Callable[P, Awaitable[T]]:
            @functools.wraps(function)
            async def wrapper(*args: P.args, **kwargs: P.kwargs) -> T:
                await self.acquire(domain, descriptors, hits, max_wait=max_wait)
                return await function(*args, **kwargs)

            return wrapper

        return decorate


class SyncConsumer:
    """:class:`Consumer` for threaded code: its own event loop in a daemon thread.

    ``acquire`` blocks the calling thread; several threads may call at once. An
    interrupted wait (``KeyboardInterrupt`` in the caller) cancels the call like a
    cancelled task: no hit spent unless an ask was on its way.
    """

    def __init__(self, address: str, **options: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="rls-consumer", daemon=True)
        self._thread.start()
        self.consumer = Consumer(address, **options)

    @property
    def stats(self) -> ConsumerStats:
        return self.consumer.stats

    def __enter__(self) -> SyncConsumer:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        if self._loop.is_closed():
            return
        asyncio.run_coroutine_threadsafe(self.consumer.close(), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def acquire(
        self,
        domain: str,
        descriptors: Descriptor | Sequence[Descriptor],
        hits: int = 1,
        *,
        max_wait: float = DEFAULT_MAX_WAIT,
    ) -> Permit:
        """:meth:`Consumer.acquire`, blocking."""
        future = asyncio.run_coroutine_threadsafe(
            self.consumer.acquire(domain, descriptors, hits, max_wait=max_wait), self._loop
        )
        try:
            return future.result()
        except BaseException:
            future.cancel()
            raise

    @contextlib.contextmanager
    def slot(
        self,
        domain: str,
        descriptors: Descriptor | Sequence[Descriptor],
        hits: int = 1,
        *,
        max_wait: float = DEFAULT_MAX_WAIT,
    ) -> Iterator[Permit]:
        """``with consumer.slot("payments", {"provider": "acme"}):`` call the provider."""
        yield self.acquire(domain, descriptors, hits, max_wait=max_wait)

    def limited(
        self,
        domain: str,
        descriptors: Descriptor | Sequence[Descriptor],
        hits: int = 1,
        *,
        max_wait: float = DEFAULT_MAX_WAIT,
    ) -> Callable[[Callable[P, T]], Callable[P, T]]:
        """A decorator: every call of the function first acquires a slot (blocking)."""

        def decorate(function: Callable[P, T]) -> Callable[P, T]:
            @functools.wraps(function)
            def wrapper(*args: P.args, **kwargs: P.kwargs) -> T:
                self.acquire(domain, descriptors, hits, max_wait=max_wait)
                return function(*args, **kwargs)

            return wrapper

        return decorate
