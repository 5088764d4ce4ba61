"""Coalesce the atomic decisions of one event-loop iteration into one Redis round trip.

A Redis round trip costs far more Python time (socket write, read, parse) than the
script it runs, so requests that need Redis in the same loop iteration share one
pipelined write. Each request still waits only its own budget; if the answer comes
later, the request has been answered otherwise (the failure mode) and the late
answer is handed to a callback, so the caller can count what Redis really did.

In Redis Cluster the requests of a batch go out concurrently, one call each, and each
request is answered the moment its own call returns: one slow or dead master does not
hold the answers of requests on the others past their deadline (issue 31).

The budget is Redis's time, not ours (issue 17): time this process's event loop
could not run (its lag, :class:`~sidecar.limiter.loop_lag.LoopLag`) is not
charged to it, so an answer that arrived in time but waited in the socket while the
loop ran other requests is still taken. The wait never goes past ``limit``, the
caller's deadline (less the margin its answer needs).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from sidecar.limiter.loop_lag import LoopLag
from sidecar.limiter.protocol import Check
from sidecar.limiter.redis.availability import RedisUnavailable
from sidecar.limiter.redis.store import Pending, RedisStore

LateAnswer = Callable[[list[int]], None]
"""Receives the would-be counts of a decision that arrived after its budget."""
Checks = Sequence[Check] | Callable[[], Sequence[Check]]
"""A request's checks, or a function that gives them when its batch is sent."""


@dataclass(slots=True)
class PendingDecision:
    """One request's script call, waiting to be sent with the others of its iteration."""

    keys: Sequence[str]
    checks: Checks
    expire_ats: Sequence[int]
    answer: asyncio.Future[list[int]]
    now_us: int = 0
    """The script's clock in microseconds; 0 for Redis ``TIME``."""
    adds: Pending | None = None
    """Hits the script adds whatever it decides (strict mode's attempted hits)."""


class DeadlineReached(TimeoutError):  # noqa: N818 - a timeout, named for the caller
    """The caller's deadline (``limit``) ran out before Redis had used its budget."""


class DecisionBatcher:
    """Sends ``decide.lua`` calls in batches; one batch per loop iteration."""

    def __init__(self, store: RedisStore, admit_all: bool = False, lock: asyncio.Lock | None = None) -> None:
        self.store = store
        self.admit_all = admit_all
        self.lock = lock
        """Held while a batch is on the wire, if given: whoever else takes it (sync mode's
        flusher) never has a call in Redis at the same time as a batch."""
        self.late_answers = 0
        availability = getattr(store, "availability", None)  # simulated stores have none
        self.lag: LoopLag | None = availability.lag if availability is not None else None
        """This process's event-loop lag: not charged to Redis's budget."""
        self._queue: list[PendingDecision] = []
        self._tasks: set[asyncio.Task[None]] = set()

    async def decide(
        self,
        keys: Sequence[str],
        checks: Checks,
        expire_ats: Sequence[int],
        budget: float,
        on_late: LateAnswer,
        *,
        now_us: int = 0,
        limit: float | None = None,
        on_settled: Callable[[], None] | None = None,
        adds: Pending | None = None,
    ) -> list[int]:
        """Would-be counts from the atomic script (it records the hits if it admits).

        ``checks`` may be a function: it is called when the batch is sent, holding
        :attr:`lock`, for limits that depend on state only settled then. ``now_us`` is
        the script's clock (sliding weights, token buckets), 0 for Redis ``TIME``.
        Raises :class:`RedisUnavailable`, or ``TimeoutError`` once Redis has had
        ``budget`` seconds (waiting for the lock included; our loop's lag not counted),
        :class:`DeadlineReached` once ``limit`` seconds have passed (default ``budget``);
        after a timeout the call goes on and ``on_late`` gets its answer, and
        ``on_settled`` is called once the call has ended, answered or failed. ``adds``:
        keys the script adds hits to first, whatever it decides (their totals come back
        in the answer's ``totals``).
        """
        loop = asyncio.get_running_loop()
        pending = PendingDecision(keys, checks, expire_ats, loop.create_future(), now_us, adds)
        self._queue.append(pending)
        if len(self._queue) == 1:
            loop.call_soon(self._send)
        started = loop.time()
        end = started + max(budget, limit or 0.0)
        wait = budget
        lag = self.lag
        while True:
            try:
                return await asyncio.wait_for(asyncio.shield(pending.answer), wait)
            except TimeoutError:
                now = loop.time()
                charged = (now - started) - (lag.busy_since(started, now) if lag is not None else 0.0)
                if charged < budget and now < end:
                    wait = min(budget - charged, end - now)  # our loop was late: Redis gets its time
                    continue
                pending.answer.add_done_callback(lambda answer: self._deliver_late(answer, on_late, on_settled))
                if charged < budget:
                    raise DeadlineReached from None
                raise

    async def drain(self) -> None:
        """Wait for batches still on the wire, so late answers are applied before exit."""
        if self._tasks:
            await asyncio.wait(set(self._tasks))

    def _deliver_late(
        self, answer: asyncio.Future[list[int]], on_late: LateAnswer, on_settled: Callable[[], None] | None = None
    ) -> None:
        if on_settled is not None:
            on_settled()
        if answer.cancelled() or answer.exception() is not None:
            return
        self.late_answers += 1
        on_late(answer.result())

    def _send(self) -> None:
        batch, self._queue = self._queue, []
        task = asyncio.get_running_loop().create_task(self._run(batch))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, batch: list[PendingDecision]) -> None:
        """One round trip for the batch; each answer wakes its request (in Cluster, as soon
        as that request's own call returns)."""
        async with self.lock or contextlib.nullcontext():
            requests = [
                (item.keys, item.checks() if callable(item.checks) else item.checks, item.expire_ats) for item in batch
            ]
            nows = [item.now_us for item in batch]
            try:
                if getattr(self.store, "cluster", False):  # each request answered when its own call returns
                    adds = [item.adds or {} for item in batch]
                    answers = await self.store.decide_batch(
                        requests, self.admit_all, nows, adds, on_answer=lambda index, got: answer_one(batch[index], got)
                    )
                elif any(item.adds for item in batch):
                    adds = [item.adds or {} for item in batch]
                    answers = await self.store.decide_batch(requests, self.admit_all, nows, adds)
                elif any(nows):
                    answers = await self.store.decide_batch(requests, self.admit_all, nows)
                else:  # Redis TIME for every request (always so in sync mode): the plain call
                    answers = await self.store.decide_batch(requests, self.admit_all)
            except RedisUnavailable as error:
                for item in batch:
                    if not item.answer.done():
                        item.answer.set_exception(error)
                    item.answer.exception()  # an error nobody waits for any more is expected
                return
            # Answered while holding the lock: late answers (callbacks run in order) are
            # applied before the lock's next holder (the owner's flush) goes on.
            for item, answer in zip(batch, answers, strict=True):
                answer_one(item, answer)


def answer_one(item: PendingDecision, answer: list[int] | RedisUnavailable) -> None:
    """Wake ``item``'s request with its answer (once: a later call of the same answer is ignored)."""
    if item.answer.done():
        return
    if isinstance(answer, RedisUnavailable):
        item.answer.set_exception(answer)
        item.answer.exception()  # nobody may be waiting any more
    else:
        item.answer.set_result(answer)
