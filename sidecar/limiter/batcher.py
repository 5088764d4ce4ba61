"""Coalesce the atomic decisions of one event-loop iteration into one Redis round trip.

A Redis round trip costs far more Python time (socket write, read, parse) than the
script it runs, so requests that need Redis in the same loop iteration share one
pipelined write. Each request still waits only its own budget; if the answer comes
later, the request has been answered otherwise (the failure mode) and the late
answer is handed to a callback, so the caller can count what Redis really did.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from sidecar.limiter.protocol import Check
from sidecar.limiter.redis_store import RedisStore, RedisUnavailable

LateAnswer = Callable[[list[int]], None]
"""Receives the would-be counts of a decision that arrived after its budget."""


@dataclass(slots=True)
class PendingDecision:
    """One request's script call, waiting to be sent with the others of its iteration."""

    keys: Sequence[str]
    checks: Sequence[Check]
    expire_ats: Sequence[int]
    answer: asyncio.Future[list[int]]


class DecisionBatcher:
    """Sends ``decide.lua`` calls in batches; one batch per loop iteration."""

    def __init__(self, store: RedisStore, admit_all: bool = False) -> None:
        self.store = store
        self.admit_all = admit_all
        self.late_answers = 0
        self._queue: list[PendingDecision] = []
        self._tasks: set[asyncio.Task[None]] = set()

    async def decide(
        self,
        keys: Sequence[str],
        checks: Sequence[Check],
        expire_ats: Sequence[int],
        budget: float,
        on_late: LateAnswer,
    ) -> list[int]:
        """Would-be counts from the atomic script (it records the hits if it admits).

        Raises :class:`RedisUnavailable`, or ``TimeoutError`` after ``budget`` seconds;
        after a timeout the call goes on and ``on_late`` gets its answer.
        """
        loop = asyncio.get_running_loop()
        pending = PendingDecision(keys, checks, expire_ats, loop.create_future())
        self._queue.append(pending)
        if len(self._queue) == 1:
            loop.call_soon(self._send)
        try:
            return await asyncio.wait_for(asyncio.shield(pending.answer), budget)
        except TimeoutError:
            pending.answer.add_done_callback(lambda answer: self._deliver_late(answer, on_late))
            raise

    async def drain(self) -> None:
        """Wait for batches still on the wire, so late answers are applied before exit."""
        if self._tasks:
            await asyncio.wait(set(self._tasks))

    def _deliver_late(self, answer: asyncio.Future[list[int]], on_late: LateAnswer) -> None:
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
        """One round trip for the batch; each answer wakes its request."""
        try:
            answers = await self.store.decide_batch(
                [(item.keys, item.checks, item.expire_ats) for item in batch], self.admit_all
            )
        except RedisUnavailable as error:
            for item in batch:
                if not item.answer.done():
                    item.answer.set_exception(error)
                item.answer.exception()  # an error nobody waits for any more is expected
            return
        for item, counts in zip(batch, answers, strict=True):
            if not item.answer.done():
                item.answer.set_result(counts)
