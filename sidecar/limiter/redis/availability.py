"""Whether Redis answers: one failure type for callers, up/down state, and the probe back.

Every failure (refused connection, timeout, Redis error, Cluster error) surfaces as
:class:`RedisUnavailable`, so callers apply their failure mode in one ``except``.
While Redis is unavailable, calls fail at once instead of waiting for a timeout: the
request path must never wait on a Redis that is known to be down. A background probe
retries with exponential backoff (capped at one second) and flips the state back to
available, telling the listeners (the failure policy logs it, limiters reconcile).

Redis down is a fact about Redis (issue 17): a refused or broken connection marks it
down at once (a reply refusing one call never does: :mod:`~sidecar.limiter.redis.faults`);
a timeout does only when Redis has been silent for well beyond any request's budget
(:func:`silence_before_down`) *while this process's event loop was free to read its
answer*. The loop's own lag (:class:`~sidecar.limiter.loop_lag.LoopLag`) is subtracted
from the silence: an answer that arrived in time but waited in the socket while the
loop ran other work (a burst, a CPU-throttled container) is not charged to Redis. The
request that waited still gets its failure-mode answer.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from redis.exceptions import RedisClusterException, RedisError

from sidecar.limiter.loop_lag import LoopLag
from sidecar.limiter.redis.connect import scrub
from sidecar.limiter.redis.faults import Fault, classify

FAILURES: tuple[type[BaseException], ...] = (RedisError, RedisClusterException, OSError)
"""What a Redis call can raise when Redis is away or refuses; ``TimeoutError`` is an ``OSError``."""
FIRST_BACKOFF = 0.01
MAX_BACKOFF = 1.0
SILENCE_BEFORE_DOWN = 0.1
"""Least silence (seconds, our own loop lag subtracted) after which a timeout marks Redis down."""
SILENCE_BUDGETS = 5
"""... or this many request budgets (``--redis-timeout``), whichever is longer."""


def silence_before_down(redis_timeout: float) -> float:
    """Silence of Redis, not explained by our loop's lag, after which a timed-out call
    marks it unavailable: well beyond any request's budget (the budget is at most
    ``redis_timeout``), so a merely slow answer fails its own request only."""
    return max(SILENCE_BEFORE_DOWN, SILENCE_BUDGETS * redis_timeout)


StateListener = Callable[[bool, str], None]
"""Called with ``(available, reason)`` each time the state changes."""


class RedisUnavailable(Exception):  # noqa: N818 - a state, not an error in our code; name fixed by the callers
    """Redis could not answer (down, slow, refusing); apply the failure mode."""


class Availability:
    """Up/down state of one Redis, its listeners, and the probe that brings it back up."""

    def __init__(
        self,
        probe: Callable[[], Awaitable[None]],
        redis_timeout: float,
        secrets: tuple[str, ...] = (),
        *,
        lag: LoopLag | None = None,
        clock: Callable[[], float] | None = None,
        what: str = "redis",
        max_backoff: float = MAX_BACKOFF,
    ) -> None:
        self._probe_once = probe
        self.what = what
        """What messages call this Redis: ``redis``, or ``redis node host:port`` (Cluster)."""
        self.max_backoff = max_backoff
        """One PING (and script loads); raises one of :data:`FAILURES` if Redis is not there."""
        self._secrets = secrets
        """Credentials of the URL: scrubbed from every reason this reports or logs."""
        self.redis_timeout = redis_timeout
        """``--redis-timeout``: how long a request-path call waits."""
        self.available = False
        self.last_error = "not started"
        self.lag = lag or LoopLag()
        """This process's event-loop lag: subtracted from Redis's silence."""
        self.down_after = silence_before_down(redis_timeout)
        self._clock = clock
        """Loop-clock seconds (``loop.time()``, as :attr:`lag` uses); tests give their own."""
        self._waiting_since: float | None = None
        """When the oldest call sent since Redis last answered went out (None: none waits)."""
        self._reported: bool | None = None
        """The state listeners last heard of (None before the first outage or success)."""
        self._listeners: list[StateListener] = []
        self._ready = asyncio.Event()
        self._probe: asyncio.Task[None] | None = None
        self._closed = False

    def add_listener(self, listener: StateListener) -> None:
        """Be told ``(available, reason)`` on every change of state."""
        self._listeners.append(listener)

    async def start(self) -> None:
        """Probe once; if Redis is down, start probing in the background and return anyway."""
        self.lag.start()
        try:
            await self._probe_once()
        except FAILURES as error:
            self.mark_down(self.describe(error))
        else:
            self.mark_up()

    async def probe(self) -> bool:
        """Try Redis once, now, instead of waiting for the backoff; returns :attr:`available`."""
        if not self.available:
            try:
                await self._probe_once()
            except FAILURES as error:
                self.last_error = self.describe(error)
            else:
                self.mark_up()
        return self.available

    async def wait_available(self) -> None:
        """Return once Redis is available (at once if it already is)."""
        await self._ready.wait()

    async def close(self) -> None:
        """Stop probing."""
        self._closed = True
        self.lag.stop()
        if self._probe is not None:
            await stop_task(self._probe)

    def retire(self) -> None:
        """Stop probing for good, without waiting (callable from within the probe: a
        Cluster node that left the slot map has nothing to come back to)."""
        self._closed = True

    def ensure_available(self) -> None:
        """Raise :class:`RedisUnavailable` at once while Redis is known to be down."""
        if not self.available:
            raise RedisUnavailable(f"{self.what} unavailable: {self.last_error}")

    def now(self) -> float:
        """The loop clock (or the test's)."""
        return self._clock() if self._clock is not None else asyncio.get_running_loop().time()

    def sent(self) -> None:
        """A call goes out: Redis's silence is measured from the oldest one unanswered."""
        if self._waiting_since is None:
            self._waiting_since = self.now()

    def answered(self) -> None:
        """Redis answered a call: it is not silent."""
        self._waiting_since = None

    def silence(self) -> float:
        """Seconds Redis has left a call unanswered while this loop was free to read the answer."""
        since = self._waiting_since
        if since is None:
            return 0.0
        now = self.now()
        return (now - since) - self.lag.busy_since(since, now)

    def failed(self, error: BaseException, request_path: bool) -> RedisUnavailable:
        """Record a failed call; returns the exception for the caller to raise.

        What the failure says about Redis is :func:`~sidecar.limiter.redis.faults.classify`'s
        to tell: a reply about this call (a key holding a non-integer, ``TRYAGAIN`` in a
        slot migration, ``LOADING``) fails this call only, or one bad key or slot would
        switch every request over; a lost connection marks Redis down; a timeout does
        under the silence rule.
        """
        if isinstance(error, RedisUnavailable):
            return error  # accounted for where it was raised
        reason = self.describe(error)
        fault = classify(error)
        if fault is Fault.CALL:
            return RedisUnavailable(f"{self.what} refused the call: {reason}")
        if fault is Fault.SILENCE:
            silence = self.silence()
            if silence < self.down_after:
                # Slow, or read late because we were busy: this call fails, Redis stays up.
                budget = f"{self.redis_timeout * 1000:g} ms" if request_path else "the background timeout"
                return RedisUnavailable(f"{self.what} did not answer within {budget}")
            reason = f"no answer for {silence * 1000:.0f} ms while this process's event loop was responsive ({reason})"
        self.mark_down(reason)
        return RedisUnavailable(f"{self.what} unavailable: {reason}")

    def silent_too_long(self) -> bool:
        """Whether a call has waited beyond the silence rule (our loop's lag not counted):
        :meth:`failed` with a timeout would mark this Redis down."""
        return self.silence() >= self.down_after

    def mark_down(self, reason: str) -> None:
        """Fail fast from now on, probe in the background, tell listeners once per outage."""
        reason = scrub(reason, self._secrets)
        self.available = False
        self._ready.clear()
        self.last_error = reason
        self._waiting_since = None
        if not self._closed and (self._probe is None or self._probe.done()):
            self._probe = asyncio.get_running_loop().create_task(self._probe_until_up())
        if self._reported is not False:
            self._reported = False
            self._notify(False, reason)

    def mark_up(self) -> None:
        """Serve calls again; listeners hear of it only if they heard of the outage."""
        self.available = True
        self._ready.set()
        self._waiting_since = None
        if self._reported is False:
            self._notify(True, "")
        self._reported = True

    def describe(self, error: BaseException) -> str:
        """:func:`describe` without the URL's credentials (redis-py's messages may quote parts of it)."""
        return scrub(describe(error), self._secrets)

    def _notify(self, available: bool, reason: str) -> None:
        for listener in self._listeners:
            listener(available, reason)

    async def _probe_until_up(self) -> None:
        """Retry the probe with exponential backoff until Redis answers."""
        delay = FIRST_BACKOFF
        while not self._closed:
            await asyncio.sleep(delay)
            try:
                await self._probe_once()
            except FAILURES as error:
                self.last_error = self.describe(error)
                delay = min(delay * 2, self.max_backoff)
                continue
            if self._closed:
                return
            self.mark_up()
            return


CLOSE_RETRY = 0.1
"""Seconds between two attempts of the last flush while Redis does not answer."""
CLOSE_WITHOUT_DEADLINE = 1.0
"""Seconds the last flush gets when the caller names no deadline."""


async def flush_until(
    attempt: Callable[[], Awaitable[object]],
    done: Callable[[], bool],
    deadline: float | None,
    first_budget: float,
) -> None:
    """The last flush on shutdown: run ``attempt`` until ``done()``, or until ``deadline``
    (``time.monotonic()``) has passed; each attempt is bounded by what is left.

    A Redis outage that ends within the shutdown grace loses nothing: the attempt
    probes Redis again every :data:`CLOSE_RETRY` seconds. The first attempt always
    runs (within ``first_budget`` if the deadline has passed already), so a stop with
    Redis up flushes whatever the grace left.
    """
    loop = asyncio.get_running_loop()
    if deadline is None:
        deadline = loop.time() + CLOSE_WITHOUT_DEADLINE
    else:
        deadline += loop.time() - time.monotonic()  # loop.time() is monotonic, maybe another origin
    first = True
    while not done():
        left = deadline - loop.time()
        if not first and left <= 0:
            return
        try:
            async with asyncio.timeout(max(left, first_budget) if first else left):
                await attempt()
        except TimeoutError:
            pass
        first = False
        if not done():
            await asyncio.sleep(max(0.0, min(CLOSE_RETRY, deadline - loop.time())))


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
