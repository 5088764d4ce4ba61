"""Bulk work and the request path share one event loop: how bulk work gives way.

A chunk of bulk work (a report's usages, a reload's re-match, a share sync) that ends
with ``await asyncio.sleep(0)`` lets the loop run what is ready, but the loop then never
blocks in ``epoll`` while more chunks are queued, so it never lets go of the GIL for
long. gRPC's poller thread, which hands each new call and each of its steps to the loop,
must then wait for the GIL up to the interpreter's switch interval (5 ms) per hand-off,
and a call takes several: with 20,000 buckets adopted in chunks of 128, probe calls
waited 130-150 ms while the loop's own lag never passed 11 ms
(``python -m loadtest.reliability --areas loop-stalls``).

So between two chunks, bulk work **rests as long as the chunk ran** (at most
:data:`MAX_REST`): the loop is idle half the time, blocked in ``epoll`` with the GIL
free, and a call waits about one chunk. Bulk work then takes about twice its CPU time
in wall time, which nobody waits on (Envoy reports every 5 s; a reload or a sync is
not on the request path).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

SWITCH_INTERVAL = 0.001
"""Seconds a thread may keep the GIL while another waits for it, for the whole ``serve``
process (CPython's default is 0.005). Rests free the GIL between chunks; within a chunk
(up to :data:`MAX_REST`), or while a client keeps the loop busy, gRPC's poller thread
still waits up to this long per hand-off of a call. Measured with ``python -m
loadtest.reliability --areas loop-stalls`` rows run in alternation on one machine, probe
p99 at 5 ms -> 1 ms: big report 52, 41 -> 22, 31 ms; reconnect 35, 39 -> 15, 13 ms;
``/config`` reader 42, 46 -> 20, 13 ms. The cost: a busy thread is interrupted more often
when both want the GIL, which in this process happens only while one of them is bulk work."""
MAX_REST = 0.02
"""The longest rest between two chunks: a chunk that ran longer (a slow machine) does not
stretch the bulk work without bound."""
MIN_REST = 0.0005
"""A rest shorter than this is not worth a timer: the loop still blocks in ``epoll`` for it."""


class GiveWay:
    """Paces one piece of bulk work: ``await give_way()`` between its chunks."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.since = clock()
        """When the current chunk started (the end of the last rest)."""
        self.rested = 0.0
        """Seconds rested so far (for tests and figures)."""

    async def __call__(self) -> None:
        rest = min(max(self.clock() - self.since, MIN_REST), MAX_REST)
        self.rested += rest
        await asyncio.sleep(rest)
        self.since = self.clock()
