"""An event loop on a virtual clock: sleeps and timeouts take no wall time.

When nothing is ready, the loop would block in ``select`` until its next timer; here the
selector polls without blocking and moves the clock to that timer instead. So code that
only waits on timers (``asyncio.sleep``, ``asyncio.timeout``, ``wait_for``) and on other
tasks runs in milliseconds, deterministically, whatever the machine's load; its times are
``loop.time()``. Nothing that waits on a real socket belongs on it (the wait would be
skipped): tests put fakes in place of the network.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class _JumpingSelector(selectors.DefaultSelector):
    """Polls instead of blocking, and moves the clock by the time it would have blocked."""

    def __init__(self, clock: list[float]) -> None:
        super().__init__()
        self.clock = clock

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        ready = super().select(0)
        if not ready and timeout is not None and timeout > 0:
            self.clock[0] += timeout
        if not ready and timeout is None:
            raise RuntimeError("virtual time: nothing scheduled and nothing ready (a deadlock)")
        return ready


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """``time()`` is virtual, starting at ``start``; waiting for the next timer costs nothing."""

    def __init__(self, start: float = 0.0) -> None:
        self._virtual = [start]
        super().__init__(_JumpingSelector(self._virtual))

    def time(self) -> float:
        return self._virtual[0]


def run_virtual(main: Coroutine[Any, Any, T], start: float = 0.0) -> T:
    """Run ``main`` to completion on a fresh :class:`VirtualTimeLoop`."""
    loop = VirtualTimeLoop(start)
    try:
        return loop.run_until_complete(main)
    finally:
        loop.close()
